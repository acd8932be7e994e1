// Chapter 10 exercise: the conjugate operators f and g as autograd functions.
//
// Write copy_to_tensor_parallel (f) and reduce_from_tensor_parallel (g), declared in
// chapters/10_tensor_parallel/mappings.h, as torch::autograd::Function classes (chapter 07's
// AddAuxiliaryLoss is one): a static forward(ctx, x, tp) and a static backward(ctx, grads) that
// returns one gradient per forward argument (an undefined tensor for the communicator).
// save_communicator / saved_communicator carry the communicator from forward to backward.
// Communicator::all_reduce works in place: reduce a copy, never the tensor autograd handed you.
// The loop (README, "How to do an exercise"): cmake --build build --target loop_ch10 &&
//   ctest --test-dir build -L loop_ch10 --output-on-failure; once it passes, the whole
//   chapter: ctest --test-dir build -L ch10 --output-on-failure

#include "10_tensor_parallel/mappings.h"
#include "fivefold/error.h"

namespace fivefold::ch10 {

torch::Tensor copy_to_tensor_parallel(const torch::Tensor& x, const dist::CommunicatorPtr& tp) {
  (void)x;
  (void)tp;
  throw NotImplemented("ch10::copy_to_tensor_parallel (f)");
}

torch::Tensor reduce_from_tensor_parallel(const torch::Tensor& x, const dist::CommunicatorPtr& tp) {
  (void)x;
  (void)tp;
  throw NotImplemented("ch10::reduce_from_tensor_parallel (g)");
}

}  // namespace fivefold::ch10
