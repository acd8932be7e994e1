// Chapter 05 exercise: YaRN's frequency interpolation. Read chapters/05_yarn/README.md, section
// "The exercise", then run: ctest --test-dir build -L ch05

#include "05_yarn/yarn.h"
#include "fivefold/error.h"

namespace fivefold::ch05 {

torch::Tensor yarn_frequencies(int64_t head_dim, double base, double factor,
                               int64_t original_max_positions, double beta_fast, double beta_slow) {
  // 1. θ_i = base^(-2i/d) for the d/2 pairs: chapter 04's rope_frequencies.
  // 2. (low, high) = yarn_correction_range(...): the pair indices where the ramp starts and ends
  //    (if they are equal, add 0.001 to high, as the reference implementations do).
  // 3. γ_i = clamp((i − low) / (high − low), 0, 1) for i = 0 .. d/2 − 1.
  // 4. Blend: θ'_i = θ_i · (1 − γ_i) + (θ_i / factor) · γ_i. (Factor it as
  //    θ_i · (1 − γ_i·(1 − 1/factor)) and factor 1 gives θ_i exactly, which the tests check.)
  throw NotImplemented("ch05: yarn_frequencies (chapters/05_yarn/README.md, 'The exercise')");
}

}  // namespace fivefold::ch05
