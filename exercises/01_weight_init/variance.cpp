// Chapter 01 exercise: write these two functions. Read chapters/01_weight_init/README.md,
// section "The exercise".
// The loop (README, "How to do an exercise"): cmake --build build --target loop_ch01 &&
//   ctest --test-dir build -L loop_ch01 --output-on-failure; once it passes, the whole
//   chapter: ctest --test-dir build -L ch01 --output-on-failure

#include "01_weight_init/weight_init.h"
#include "fivefold/error.h"

namespace fivefold::ch01 {

double activation_second_moment(Activation activation) {
  // Return E[f(y)²] for y ~ N(0, 1). Which activations have a closed form, and what is it? For
  // the others, integrate f(y)² φ(y) numerically (φ the standard normal density): over what range
  // of y, and with what rule, do you reach 1e-6?
  throw NotImplemented(
      "ch01: activation_second_moment (chapters/01_weight_init/README.md, 'The exercise')");
}

double variance_preserving_std(int64_t fan_in, Activation activation) {
  // Return the std of W's entries for which y = W x has the variance of y_prev when
  // x = f(y_prev). What is the variance of a sum of fan_in independent products w·x?
  throw NotImplemented(
      "ch01: variance_preserving_std (chapters/01_weight_init/README.md, 'The exercise')");
}

}  // namespace fivefold::ch01
