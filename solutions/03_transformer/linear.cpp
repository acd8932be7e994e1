// Chapter 03: the linear map y = x·Wᵀ that every weight matrix of the model goes through, and the
// seams it offers later chapters (seams.h): the weight gradients put off (chapter 11), the
// library that multiplies (the training run's fast paths, chapter 14's bf16).

#include <cmath>
#include <memory>
#include <utility>

#include "03_transformer/model.h"
#include "fivefold/error.h"

namespace fivefold::ch03 {

namespace {

thread_local WeightGradientStore* deferred = nullptr;
std::shared_ptr<const MatmulKernel> g_matmul;  // set before training (set_matmul_kernel)

// a·b for 2-D a and b, through the MatmulKernel set or at::mm (in the wider of their types when
// they differ: a weight kept in bf16 against fp32 activations).
torch::Tensor product(const torch::Tensor& a, const torch::Tensor& b) {
  if (g_matmul) return g_matmul->mm(a, b);
  const auto type = at::promote_types(a.scalar_type(), b.scalar_type());
  return a.to(type).mm(b.to(type));
}

// x [..., in] as rows [tokens, in].
torch::Tensor rows(const torch::Tensor& x) { return x.reshape({-1, x.size(-1)}); }

// [tokens, n] back to x's leading dimensions [..., n].
torch::Tensor unrows(const torch::Tensor& y, const torch::Tensor& like) {
  auto sizes = like.sizes().vec();
  sizes.back() = y.size(-1);
  return y.view(sizes);
}

// y = x·Wᵀ; backward: ∂L/∂x = ∂L/∂y·W, and ∂L/∂W = (∂L/∂y)ᵀ·x now or, deferred, later. x is kept
// in the kernel's operand form, converted once; or, with `remade`, not kept but made again.
class LinearFunction : public torch::autograd::Function<LinearFunction> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight,
                               const c10::intrusive_ptr<RemadeInput>& remade) {
    const auto x_operand = matmul_operand(x);
    if (remade) {
      ctx->save_for_backward({weight});
      ctx->saved_data["remade"] = c10::IValue::make_capsule(remade);
    } else {
      ctx->save_for_backward({weight, x_operand});
    }
    ctx->saved_data["input_type"] = static_cast<int64_t>(x.scalar_type());
    const auto type = g_matmul ? g_matmul->result_type(x.scalar_type()) : x.scalar_type();
    return unrows(product(rows(x_operand), weight.t()), x).to(type);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto& weight = saved[0];
    const auto grad_y = matmul_operand(grads[0]);
    const auto input_type = static_cast<at::ScalarType>(ctx->saved_data["input_type"].toInt());
    auto grad_x = unrows(product(rows(grad_y), weight), grad_y).to(input_type);
    torch::Tensor x;
    if (saved.size() > 1) {
      x = saved[1];
    } else {
      auto remade = ctx->saved_data["remade"].toCapsule();
      x = matmul_operand(static_cast<RemadeInput*>(remade.get())->remake());
    }
    if (deferred != nullptr) {
      deferred->keep(weight, x, grad_y);
      return {grad_x, torch::Tensor(), torch::Tensor()};
    }
    return {grad_x, product(rows(grad_y).t(), rows(x)).to(weight.scalar_type()), torch::Tensor()};
  }
};

}  // namespace

void WeightGradientStore::keep(torch::Tensor weight, torch::Tensor x, torch::Tensor grad_y) {
  pending_.push_back({std::move(weight), std::move(x), std::move(grad_y)});
}

void WeightGradientStore::flush() {
  torch::NoGradGuard no_grad;
  for (auto& p : pending_) {
    auto grad = product(rows(p.grad_y).t(), rows(p.x)).to(p.weight.scalar_type());
    auto& slot = p.weight.mutable_grad();
    if (slot.defined()) {
      slot.add_(grad);
    } else {
      slot = grad;
    }
  }
  pending_.clear();
}

DeferWeightGradients::DeferWeightGradients(WeightGradientStore& store) {
  FIVEFOLD_CHECK(deferred == nullptr, "DeferWeightGradients: scopes do not nest");
  deferred = &store;
}

DeferWeightGradients::~DeferWeightGradients() { deferred = nullptr; }

std::shared_ptr<const MatmulKernel> set_matmul_kernel(std::shared_ptr<const MatmulKernel> kernel) {
  std::swap(g_matmul, kernel);
  return kernel;
}

const MatmulKernel* matmul_kernel() { return g_matmul.get(); }

torch::Tensor matmul_operand(const torch::Tensor& t) { return g_matmul ? g_matmul->operand(t) : t; }

torch::Tensor at_least_fp32(const torch::Tensor& t) {
  return t.to(at::promote_types(t.scalar_type(), torch::kFloat));
}

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const c10::intrusive_ptr<RemadeInput>& remade) {
  return LinearFunction::apply(x, weight, remade);
}

LinearImpl::LinearImpl(int64_t in, int64_t out)
    : weight(register_parameter("weight", torch::empty({out, in}))) {
  // torch::nn::Linear's default draw (the same random numbers), for a module used on its own.
  torch::nn::init::kaiming_uniform_(weight, std::sqrt(5.0));
}

torch::Tensor LinearImpl::forward(const torch::Tensor& x) { return ch03::linear(x, weight); }

}  // namespace fivefold::ch03
