// Chapter 05 exercise: YaRN's frequency interpolation. Read chapters/05_yarn/README.md, section
// "The exercise".
// The loop (README, "How to do an exercise"): cmake --build build --target loop_ch05 &&
//   ctest --test-dir build -L loop_ch05 --output-on-failure; once it passes, the whole
//   chapter: ctest --test-dir build -L ch05 --output-on-failure

#include "05_yarn/yarn.h"
#include "fivefold/error.h"

namespace fivefold::ch05 {

torch::Tensor yarn_frequencies(int64_t head_dim, double base, double factor,
                               int64_t original_max_positions, double beta_fast, double beta_slow) {
  // Contract: the d/2 rotation frequencies (float32, [head_dim / 2]) YaRN uses when the context is
  // stretched by `factor`: pairs that turn many times within original_max_positions keep RoPE's
  // frequency, pairs that turn less than once are interpolated (divided by factor), and the pairs
  // between are blended along a linear ramp whose ends yarn_correction_range gives (from
  // beta_fast and beta_slow). Which pairs are which, and how is the ramp built? (README,
  // "Walk-through": the table and "YaRN in code".) The tests compare every frequency with hand
  // computation, and require factor 1 to give chapter 04's rope_frequencies bit for bit: write
  // the blend so that it does.
  throw NotImplemented("ch05: yarn_frequencies (chapters/05_yarn/README.md, 'The exercise')");
}

}  // namespace fivefold::ch05
