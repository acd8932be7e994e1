// Chapter 15, the exercise: which chapter's step runs over which group.
#include "15_trainer_5d/trainer_5d.h"
#include "fivefold/error.h"

namespace fivefold::ch15 {

ch03::StepFactory compose_step(const Layout& layout, const Groups& groups, int64_t world_size) {
  // Hint: start from the innermost step and wrap outwards (README, "Composing the steps").
  // - The replicas of a parameter are groups.data (dp x cp), or groups.experts.edp when
  //   layout.ep > 1; with experts split, the model-parallel steps take ch13::make_model over
  //   groups.experts as their `whole` builder and ch13::expert_parallel_hooks(groups.experts).
  // - pp > 1: ch11::pipeline_parallel_step (a ch11::PipelineLayout over groups.pp, groups.pp_tp,
  //   groups.tp); else tp > 1: ch10::tensor_parallel_step; else ep > 1:
  //   ch13::expert_parallel_step(experts, zero); else, for more than one process or ZeRO > 0,
  //   ch09::data_parallel_step over groups.data.
  // - ep > 1 with tp or pp: wrap that step in ch13::expert_parallel_step(experts, step).
  // - cp > 1: wrap everything in ch12::context_parallel_step (a data-parallel step inside when
  //   nothing else was made).
  (void)layout;
  (void)groups;
  (void)world_size;
  throw NotImplemented("ch15: compose_step (chapters/15_trainer_5d/README.md, \"Composing the steps\")");
}

}  // namespace fivefold::ch15
