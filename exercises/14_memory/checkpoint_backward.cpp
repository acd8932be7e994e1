// Chapter 14 exercise: the checkpoint function's backward. Read chapters/14_memory/README.md,
// section "The exercise", and the contract in chapters/14_memory/checkpoint_function.h.
// The loop (README, "How to do an exercise"): cmake --build build --target loop_ch14 &&
//   ctest --test-dir build -L loop_ch14 --output-on-failure; once it passes, the whole
//   chapter: ctest --test-dir build -L ch14 --output-on-failure
#include "03_transformer/train.h"
#include "14_memory/checkpoint_function.h"
#include "fivefold/error.h"

namespace fivefold::ch14 {

torch::autograd::variable_list CheckpointFunction::backward(torch::autograd::AutogradContext* ctx,
                                                            torch::autograd::variable_list grads) {
  // Forward (solutions/14_memory/checkpoint.cpp) kept ctx->get_saved_variables() (the inputs, or
  // the copies kept in their place: the region reads each in its input's own type,
  // SavedRegion::types) and ctx->saved_data["region"] (a SavedRegion: toCapsule(), then
  // c10::static_intrusive_pointer_cast). Give the region's inputs and the parameters it reads the
  // gradients they would have had if forward had kept everything, with the state forward saw in
  // force wherever the region depends on it. The tests: Checkpoint.*, then the whole chapter.
  (void)ctx;
  (void)grads;
  throw NotImplemented(
      "ch14::checkpoint's backward (chapters/14_memory/README.md, \"The exercise\")");
}

}  // namespace fivefold::ch14
