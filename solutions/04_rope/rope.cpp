// The heart of chapter 04: rotating pairs of features by a position-dependent angle.

#include "04_rope/rope.h"

namespace fivefold::ch04 {

torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                         RopeLayout layout) {
  const int64_t half = x.size(-1) / 2;
  if (layout == RopeLayout::HalfSplit) {
    // Pair i is (x_i, x_{i+d/2}): the two halves of the last dimension.
    auto a = x.narrow(-1, 0, half), b = x.narrow(-1, half, half);  // [..., seq, d/2] each
    return torch::cat({a * cos - b * sin, a * sin + b * cos}, -1);
  }
  // Pair i is (x_{2i}, x_{2i+1}): view the last dimension as [d/2, 2].
  auto pairs = x.unflatten(-1, {half, 2});  // [..., seq, d/2, 2]
  auto a = pairs.select(-1, 0), b = pairs.select(-1, 1);
  return torch::stack({a * cos - b * sin, a * sin + b * cos}, -1).flatten(-2);
}

}  // namespace fivefold::ch04
