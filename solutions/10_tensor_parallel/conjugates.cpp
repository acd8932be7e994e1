// Chapter 10 exercise: the conjugate operators f and g as autograd functions.

#include "10_tensor_parallel/mappings.h"

namespace fivefold::ch10 {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// f: identity forward; the gradient is summed over the ranks backward.
class CopyToTensorParallel : public torch::autograd::Function<CopyToTensorParallel> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, dist::CommunicatorPtr tp) {
    save_communicator(ctx, tp);
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto grad = grads[0].clone();  // all_reduce works in place: never on autograd's own buffer
    saved_communicator(ctx)->all_reduce(grad);
    return {grad, torch::Tensor()};  // no gradient for the communicator
  }
};

// g: the partial outputs summed forward; the gradient passes unchanged backward.
class ReduceFromTensorParallel : public torch::autograd::Function<ReduceFromTensorParallel> {
 public:
  static torch::Tensor forward(AutogradContext* /*ctx*/, torch::Tensor x,
                               dist::CommunicatorPtr tp) {
    auto sum = x.clone();
    tp->all_reduce(sum);
    return sum;
  }
  static variable_list backward(AutogradContext* /*ctx*/, variable_list grads) {
    return {grads[0], torch::Tensor()};
  }
};

}  // namespace

torch::Tensor copy_to_tensor_parallel(const torch::Tensor& x, const dist::CommunicatorPtr& tp) {
  return CopyToTensorParallel::apply(x, tp);
}

torch::Tensor reduce_from_tensor_parallel(const torch::Tensor& x, const dist::CommunicatorPtr& tp) {
  return ReduceFromTensorParallel::apply(x, tp);
}

}  // namespace fivefold::ch10
