// The heart of chapter 05: YaRN's frequencies, NTK-by-parts in pair-index space.

#include "05_yarn/yarn.h"

namespace fivefold::ch05 {

torch::Tensor yarn_frequencies(int64_t head_dim, double base, double factor,
                               int64_t original_max_positions, double beta_fast, double beta_slow) {
  auto theta = ch04::rope_frequencies(head_dim, base);  // [d/2]: θ_i = base^(-2i/d)
  auto [low, high] =
      yarn_correction_range(head_dim, base, original_max_positions, beta_fast, beta_slow);
  if (high == low) high += 0.001;  // a one-pair ramp would divide by zero (as the reference code)
  // γ_i: 0 for the fast pairs (i <= low), which keep θ_i; 1 for the slow ones (i >= high), which
  // are interpolated like Position Interpolation; linear in between.
  auto i = torch::arange(head_dim / 2, torch::kDouble);
  auto ramp = ((i - low) / (high - low)).clamp(0.0, 1.0);
  // θ_i·(1 − γ_i) + (θ_i/s)·γ_i, written so that s = 1 gives θ_i exactly.
  return theta * (1 - ramp * (1 - 1 / factor));
}

}  // namespace fivefold::ch05
