// Chapter 01 plumbing: the schemes, and drawing a weight in full from its own generator so that
// every parallel layout slices the same numbers.

#include <cmath>

#include "01_weight_init/weight_init.h"
#include "fivefold/error.h"
#include "fivefold/seed.h"

namespace fivefold::ch01 {

double libtorch_gain(Activation activation) {
  switch (activation) {
    case Activation::ReLU: return std::sqrt(2.0);
    case Activation::Tanh: return 5.0 / 3.0;
    default: return 1.0;
  }
}

double init_std(const InitSpec& spec, int64_t fan_in, int64_t fan_out) {
  FIVEFOLD_CHECK(fan_in > 0 && fan_out > 0, "init_std: fan_in and fan_out must be positive, got ",
                 fan_in, " and ", fan_out);
  switch (spec.scheme) {
    case Scheme::LibTorchDefault: return 1.0 / std::sqrt(3.0 * fan_in);  // U(±a): std a/sqrt(3)
    case Scheme::Xavier: return std::sqrt(2.0 / static_cast<double>(fan_in + fan_out));
    case Scheme::Kaiming: return variance_preserving_std(fan_in, spec.activation);
    case Scheme::Gpt2:
      FIVEFOLD_CHECK(spec.n_layer >= 1, "init_std: GPT-2 scheme needs n_layer >= 1");
      // Each block adds two residual branches (attention, MLP): 2·n_layer terms in the sum.
      return spec.residual_projection ? spec.std / std::sqrt(2.0 * spec.n_layer) : spec.std;
    case Scheme::FixedStd: return spec.std;
  }
  throw Error("init_std: unknown scheme");
}

torch::Tensor init_weight(const std::string& name, int64_t out_features, int64_t in_features,
                          const InitSpec& spec, uint64_t seed) {
  const double std = init_std(spec, in_features, out_features);
  auto generator = generator_for(seed, name);
  if (spec.scheme == Scheme::LibTorchDefault) {
    const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
    return torch::rand({out_features, in_features}, generator) * (2 * bound) - bound;
  }
  return torch::randn({out_features, in_features}, generator) * std;
}

torch::Tensor init_weight_shard(const std::string& name, int64_t out_features, int64_t in_features,
                                const InitSpec& spec, uint64_t seed, int64_t dim, int64_t index,
                                int64_t count) {
  // Draw the whole tensor, then keep our part: costs memory for the full tensor once, and in
  // exchange every layout gets exactly the single-device numbers (notes/01_weight_init.md).
  return shard(init_weight(name, out_features, in_features, spec, seed), dim, index, count).clone();
}

torch::Tensor activate(const torch::Tensor& x, Activation activation) {
  switch (activation) {
    case Activation::Linear: return x;
    case Activation::ReLU: return torch::relu(x);
    case Activation::Tanh: return torch::tanh(x);
    case Activation::SiLU: return torch::silu(x);
  }
  throw Error("activate: unknown activation");
}

std::string activation_name(Activation activation) {
  switch (activation) {
    case Activation::Linear: return "linear";
    case Activation::ReLU: return "relu";
    case Activation::Tanh: return "tanh";
    case Activation::SiLU: return "silu";
  }
  return "?";
}

}  // namespace fivefold::ch01
