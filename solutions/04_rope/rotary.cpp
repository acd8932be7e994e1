// Chapter 04 plumbing: frequencies, the cos/sin cache, the complex form, the layout permutation,
// and installing RoPE in chapter 03's model.

#include "03_transformer/checkpoint.h"
#include "04_rope/rope.h"
#include "fivefold/error.h"

namespace fivefold::ch04 {

torch::Tensor rope_frequencies(int64_t head_dim, double base) {
  FIVEFOLD_CHECK(head_dim > 0 && head_dim % 2 == 0, "RoPE: head_dim must be even, got ", head_dim);
  FIVEFOLD_CHECK(base > 0, "RoPE: base must be positive, got ", base);
  auto i = torch::arange(head_dim / 2, torch::kDouble);
  return torch::pow(base, -2.0 * i / static_cast<double>(head_dim));  // θ_i = base^(-2i/d)
}

std::pair<torch::Tensor, torch::Tensor> rope_angles(const torch::Tensor& frequencies, int64_t first,
                                                    int64_t count) {
  return rope_angles(frequencies, torch::arange(first, first + count, torch::kLong));
}

std::pair<torch::Tensor, torch::Tensor> rope_angles(const torch::Tensor& frequencies,
                                                    const torch::Tensor& positions) {
  auto angles = torch::outer(positions.to(torch::kDouble), frequencies);  // [count, d/2]: m·θ_i
  return {angles.cos().to(torch::kFloat), angles.sin().to(torch::kFloat)};
}

torch::Tensor apply_rope_complex(const torch::Tensor& x, int64_t first, double base) {
  const int64_t seq = x.size(-2), d = x.size(-1);
  auto angles = torch::outer(torch::arange(first, first + seq, torch::kDouble),
                             rope_frequencies(d, base));           // [seq, d/2]
  auto rotation = torch::polar(torch::ones_like(angles), angles);  // e^{i·m·θ_i}
  auto z = torch::view_as_complex(x.to(torch::kDouble).unflatten(-1, {d / 2, 2}).contiguous());
  return torch::view_as_real(z * rotation).flatten(-2).to(x.scalar_type());
}

torch::Tensor interleaved_to_half_split(int64_t head_dim) {
  FIVEFOLD_CHECK(head_dim % 2 == 0, "RoPE: head_dim must be even, got ", head_dim);
  // Half-split feature j < d/2 is the first member of pair j (interleaved 2j); feature d/2 + j
  // is its second member (interleaved 2j + 1).
  auto even = torch::arange(0, head_dim, 2, torch::kLong), odd = even + 1;
  return torch::cat({even, odd});
}

RotaryEmbedding::RotaryEmbedding(int64_t head_dim, double base, RopeLayout layout,
                                 int64_t cached_positions)
    : layout_(layout), frequencies_(rope_frequencies(head_dim, base)) {
  FIVEFOLD_CHECK(cached_positions >= 0, "RoPE: cached_positions must be >= 0");
  std::tie(cos_, sin_) = rope_angles(frequencies_, 0, cached_positions);
}

std::pair<torch::Tensor, torch::Tensor> RotaryEmbedding::angles(
    const torch::Tensor& positions) const {
  if (positions.numel() > 0 && positions.min().item<int64_t>() >= 0 &&
      positions.max().item<int64_t>() < cos_.size(0)) {  // the cached rows of those positions
    return {cos_.index_select(0, positions), sin_.index_select(0, positions)};
  }
  return rope_angles(frequencies_, positions);  // beyond the cache: the same angles, computed now
}

std::pair<torch::Tensor, torch::Tensor> RotaryEmbedding::encode(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& positions) const {
  const auto [cos, sin] = angles(positions);  // [seq, d/2]
  return {apply_rope(q, cos, sin, layout_), apply_rope(k, cos, sin, layout_)};
}

ch03::ModelRecipe recipe(const ch03::ModelConfig& config) {
  config.validate();  // the config first: its errors name the config, not a module
  FIVEFOLD_CHECK(config.extensions.is_null(),
                 "config: a deepseek_v3 model (MLA, MoE) needs chapter 06's make_model");
  FIVEFOLD_CHECK(config.rope_scaling.is_null(),
                 "config: 'rope_scaling' (context extension) needs chapter 05's make_model");
  ch03::ModelRecipe r;
  if (config.rope_theta > 0) {
    r.position_encoding =
        std::make_shared<RotaryEmbedding>(config.resolved_head_dim(), config.rope_theta);
  }
  return r;
}

ch03::Transformer make_model(const ch03::ModelConfig& config, const ch03::ModelPart& part) {
  return ch03::Transformer(config, recipe(config), part);
}

ch03::Transformer load_model(const std::string& dir) { return ch03::load_model(dir, make_model); }

}  // namespace fivefold::ch04
