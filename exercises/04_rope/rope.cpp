// Chapter 04 exercise: applying the rotation. Read chapters/04_rope/README.md, section
// "The exercise".
// The loop (README, "How to do an exercise"): cmake --build build --target loop_ch04 &&
//   ctest --test-dir build -L loop_ch04 --output-on-failure; once it passes, the whole
//   chapter: ctest --test-dir build -L ch04 --output-on-failure

#include "04_rope/rope.h"
#include "fivefold/error.h"

namespace fivefold::ch04 {

torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                         RopeLayout layout) {
  // Contract: x [..., seq, d]; cos, sin [seq, d/2], the angle of pair i at each position
  // (broadcast over the leading dimensions). Return x with every pair rotated by its angle, in
  // x's shape and in x's layout: which two features form pair i under HalfSplit, and under
  // Interleaved? (README, "Walk-through".)
  throw NotImplemented("ch04: apply_rope (chapters/04_rope/README.md, 'The exercise')");
}

}  // namespace fivefold::ch04
