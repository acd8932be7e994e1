// Chapter 15, the exercise: which chapter's step runs over which group.
// The loop (README, "How to do an exercise"): cmake --build build --target loop_ch15 &&
//   ctest --test-dir build -L loop_ch15 --output-on-failure; once it passes, the whole
//   chapter: ctest --test-dir build -L ch15 --output-on-failure
#include "15_trainer_5d/trainer_5d.h"
#include "fivefold/error.h"

namespace fivefold::ch15 {

ch03::StepFactory compose_step(const Layout& layout, const Groups& groups, int64_t world_size) {
  // Contract: a StepFactory whose steps, run on every rank of `groups` (one communicator per
  // dimension of `layout`, built by make_groups), give one process's loss, gradient norm and
  // update. Build it only from the chapters' steps (09 data parallel, 10 tensor, 11 pipeline, 12
  // context, 13 expert parallel), each over its group; an empty factory means chapter 03's
  // one-process step. Which step is innermost, what wraps what, and over which group does each
  // average its gradients? (README, "Composing the steps".) The tests run five 8-rank layouts
  // against one process: the loss, the norm, every gradient, then three steps of AdamW.
  (void)layout;
  (void)groups;
  (void)world_size;
  throw NotImplemented("ch15: compose_step (chapters/15_trainer_5d/README.md, \"Composing the steps\")");
}

}  // namespace fivefold::ch15
