// Chapter 15, the exercise: which chapter's step runs over which group.
#include "15_trainer_5d/trainer_5d.h"

namespace fivefold::ch15 {

ch03::StepFactory compose_step(const Layout& layout, const Groups& groups, int64_t world_size) {
  // Experts split over ep: the step below runs over the ranks holding the same experts (edp),
  // builds this rank's experts (chapter 13's model) and puts chapter 13's groups into the map.
  const bool experts = layout.ep > 1;
  const dist::CommunicatorPtr replicas = experts ? groups.experts.edp : groups.data;
  ch03::ModelBuilder whole = ch07::make_model;
  ch09::StepHooks hooks;
  if (experts) {
    whole = [group = groups.experts](const ch03::ModelConfig& config, const ch03::ModelPart& part) {
      return ch13::make_model(config, group, part);
    };
    hooks = ch13::expert_parallel_hooks(groups.experts);
  }

  ch03::StepFactory step;
  if (layout.pp > 1) {  // the pipeline, with tensor parallelism inside each stage if tp > 1
    ch11::PipelineLayout pipeline;
    pipeline.links = std::make_shared<ch11::PipelineLinks>(groups.pp);
    pipeline.dp = replicas;
    pipeline.model_parallel = groups.pp_tp;
    pipeline.tp = groups.tp;
    pipeline.zero = layout.zero;
    pipeline.schedule = layout.schedule;
    pipeline.virtual_stages = layout.virtual_stages;
    pipeline.hooks = hooks;
    step = ch11::pipeline_parallel_step(pipeline, whole);
  } else if (layout.tp > 1) {
    step = ch10::tensor_parallel_step(groups.tp, replicas, layout.zero, whole, hooks);
  } else if (experts) {
    step = ch13::expert_parallel_step(groups.experts, layout.zero);  // chapter 09's over edp
  } else if (world_size > 1 || layout.zero > 0) {
    step = ch09::data_parallel_step(groups.data, layout.zero);
  }
  // Chapter 10's or 11's step over edp does not know about the ep ranks: wrap it.
  if (experts && (layout.tp > 1 || layout.pp > 1)) step = ch13::expert_parallel_step(groups.experts, step);
  if (layout.cp > 1) {  // outermost: each rank keeps its tokens of every row
    if (!step) step = ch09::data_parallel_step(groups.data, layout.zero);
    step = ch12::context_parallel_step(step, {groups.cp, layout.cp_layout, layout.cp_attention});
  }
  return step;
}

}  // namespace fivefold::ch15
