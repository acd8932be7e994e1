// Measuring how the signal's scale changes with depth: the experiment the chapter's derivation
// predicts, used by the demo (tables) and by the tests (prediction vs measurement).

#include "01_weight_init/weight_init.h"
#include "fivefold/seed.h"

namespace fivefold::ch01 {
namespace {
double std_of(const torch::Tensor& t) { return t.std().item<double>(); }
}  // namespace

DepthProfile mlp_profile(int64_t depth, int64_t width, int64_t batch, const InitSpec& spec,
                         uint64_t seed) {
  std::vector<torch::Tensor> weights;
  for (int64_t l = 0; l < depth; ++l) {
    weights.push_back(init_weight("mlp." + std::to_string(l) + ".weight", width, width, spec, seed)
                          .requires_grad_(true));
  }
  auto x = torch::randn({batch, width}, generator_for(seed, "mlp.input"));
  DepthProfile profile;
  torch::Tensor y = torch::matmul(x, weights[0].t());  // [batch, width]
  profile.activation_std.push_back(std_of(y));
  for (int64_t l = 1; l < depth; ++l) {
    y = torch::matmul(activate(y, spec.activation), weights[l].t());
    profile.activation_std.push_back(std_of(y));
  }
  auto g = torch::randn({batch, width}, generator_for(seed, "mlp.upstream_gradient"));
  (y * g).sum().backward();
  for (const auto& w : weights) profile.gradient_std.push_back(std_of(w.grad()));
  return profile;
}

DepthProfile residual_profile(int64_t depth, int64_t width, int64_t batch, const InitSpec& in_spec,
                              const InitSpec& out_spec, uint64_t seed) {
  auto h = torch::randn({batch, width}, generator_for(seed, "residual.input"));  // [batch, width]
  std::vector<torch::Tensor> w_ins;
  DepthProfile profile;
  for (int64_t l = 0; l < depth; ++l) {
    const std::string prefix = "block." + std::to_string(l);
    auto w_in = init_weight(prefix + ".w_in", 4 * width, width, in_spec, seed).requires_grad_(true);
    auto w_out =
        init_weight(prefix + ".w_out", width, 4 * width, out_spec, seed).requires_grad_(true);
    auto normed = h * torch::rsqrt(h.pow(2).mean(-1, /*keepdim=*/true) + 1e-6);  // RMSNorm
    h = h + torch::matmul(torch::relu(torch::matmul(normed, w_in.t())), w_out.t());
    profile.activation_std.push_back(h.std().item<double>());
    w_ins.push_back(w_in);
  }
  auto g = torch::randn({batch, width}, generator_for(seed, "residual.upstream_gradient"));
  (h * g).sum().backward();
  for (const auto& w : w_ins) profile.gradient_std.push_back(w.grad().std().item<double>());
  return profile;
}

}  // namespace fivefold::ch01
