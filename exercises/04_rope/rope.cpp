// Chapter 04 exercise: applying the rotation. Read chapters/04_rope/README.md, section
// "The exercise", then run: ctest --test-dir build -L ch04

#include "04_rope/rope.h"
#include "fivefold/error.h"

namespace fivefold::ch04 {

torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                         RopeLayout layout) {
  // x [..., seq, d]; cos, sin [seq, d/2]: the angle of pair i at each position.
  // 1. Find the two members (a, b) of every pair: for HalfSplit the halves of the last dimension,
  //    for Interleaved the even and odd features (unflatten the last dimension to [d/2, 2]).
  // 2. Rotate: (a, b) -> (a·cos − b·sin, a·sin + b·cos).
  // 3. Put the pairs back where they came from, so the output has x's shape and layout.
  throw NotImplemented("ch04: apply_rope (chapters/04_rope/README.md, 'The exercise')");
}

}  // namespace fivefold::ch04
