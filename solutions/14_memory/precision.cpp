// Chapter 14: mixed precision through chapter 03's matmul slot.
#include "14_memory/precision.h"

#include <algorithm>
#include <optional>

#include "fivefold/error.h"
#include "fivefold/timer.h"

namespace fivefold::ch14 {

Precision parse_precision(const std::string& name) {
  if (name == "fp32") return Precision::Fp32;
  if (name == "bf16") return Precision::Bf16;
  throw Error("precision: '" + name + "' is not one of fp32, bf16");
}

std::string to_string(Precision precision) {
  return precision == Precision::Bf16 ? "bf16" : "fp32";
}

torch::Tensor Bf16MatmulKernel::mm(const torch::Tensor& a, const torch::Tensor& b) const {
  return a.to(torch::kBFloat16).mm(b.to(torch::kBFloat16));
}

torch::Tensor Bf16MatmulKernel::bmm(const torch::Tensor& a, const torch::Tensor& b) const {
  return a.to(torch::kBFloat16).bmm(b.to(torch::kBFloat16));
}

namespace {

// The activations operand() rounded last on this thread, and their roundings: q, k and v (gate and
// up) read the same input one after another, and keep one bf16 copy of it, not three; MLA reads
// the norm's output, then its query latent, then the norm's output again, so the last two are
// remembered. All are held weakly: the cache keeps nothing alive (a rounding lives as long as a
// linear map keeps it for backward), and an input freed since never matches.
using WeakTensor = c10::weak_intrusive_ptr<c10::TensorImpl, c10::UndefinedTensorImpl>;
struct Rounded {
  std::optional<WeakTensor> input, rounded;
  int64_t version = -1;  // an input changed in place since is not the one rounded
};
thread_local Rounded last_rounded[2];  // [0] the latest

}  // namespace

torch::Tensor Bf16MatmulKernel::operand(const torch::Tensor& t) const {
  if (t.scalar_type() == torch::kBFloat16) return t;
  for (auto& last : last_rounded) {
    if (last.input && last.input->lock().get() == t.unsafeGetTensorImpl() &&
        last.version == t._version()) {
      auto rounded = last.rounded->lock();
      if (rounded) return torch::Tensor(std::move(rounded));
    }
  }
  auto rounded = t.to(torch::kBFloat16);
  last_rounded[1] = last_rounded[0];
  last_rounded[0] = {WeakTensor(t.getIntrusivePtr()), WeakTensor(rounded.getIntrusivePtr()),
                     t._version()};
  return rounded;
}

void use_precision(Precision precision, std::shared_ptr<const ch03::MatmulKernel> fp32) {
  ch03::set_matmul_kernel(precision == Precision::Bf16 ? std::make_shared<Bf16MatmulKernel>()
                                                       : std::move(fp32));
}

namespace {

// GFLOP/s of a·b through `product`: the best of 10 after 2 warm-up products.
double gflops(const torch::Tensor& a, const torch::Tensor& b, const ch03::MatmulKernel* product) {
  auto run = [&] { return product != nullptr ? product->mm(a, b) : a.mm(b); };
  double best = 1e30;
  for (int i = 0; i < 12; ++i) {
    Timer timer;
    run();
    if (i >= 2) best = std::min(best, timer.seconds());
  }
  return 2.0 * static_cast<double>(a.size(0) * a.size(1) * b.size(1)) / best / 1e9;
}

}  // namespace

ProductSpeed measure_product_speed(int64_t rows, int64_t inner, int64_t cols) {
  FIVEFOLD_CHECK(rows >= 1 && inner >= 1 && cols >= 1, "measure_product_speed: empty product");
  const auto a = torch::randn({rows, inner}), b = torch::randn({inner, cols});
  const Bf16MatmulKernel bf16;
  return {gflops(a, b, ch03::matmul_kernel()), gflops(a, b, &bf16)};
}

}  // namespace fivefold::ch14
