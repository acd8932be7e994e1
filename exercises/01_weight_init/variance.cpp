// Chapter 01 exercise: write these two functions. Read chapters/01_weight_init/README.md,
// section "The exercise", then run: ctest --test-dir build -L ch01

#include "01_weight_init/weight_init.h"
#include "fivefold/error.h"

namespace fivefold::ch01 {

double activation_second_moment(Activation activation) {
  // Return E[f(y)²] for y ~ N(0, 1). Linear and ReLU have exact values (why is ReLU's 1/2?).
  // For Tanh and SiLU integrate f(y)² φ(y) numerically, φ the standard normal density.
  throw NotImplemented(
      "ch01: activation_second_moment (chapters/01_weight_init/README.md, 'The exercise')");
}

double variance_preserving_std(int64_t fan_in, Activation activation) {
  // Choose std so that Var[W x] = Var[y_prev] when x = f(y_prev): start from
  // Var[y] = fan_in · Var[w] · E[x²].
  throw NotImplemented(
      "ch01: variance_preserving_std (chapters/01_weight_init/README.md, 'The exercise')");
}

}  // namespace fivefold::ch01
