// The heart of chapter 01: the second moment of an activation under a unit Gaussian, and the
// weight std that keeps the variance of a layer's output equal to that of its input.

#include <cmath>

#include "01_weight_init/weight_init.h"

namespace fivefold::ch01 {

double activation_second_moment(Activation activation) {
  switch (activation) {
    case Activation::Linear: return 1.0;  // E[y²] = Var[y] = 1
    case Activation::ReLU: return 0.5;    // half the mass is zeroed, the other half keeps y²
    case Activation::Tanh:
    case Activation::SiLU: break;
  }
  // No closed form: integrate f(y)² φ(y) over y with the trapezoid rule. The Gaussian density φ
  // is below 1e-31 beyond |y| = 12, and the integrand is smooth, so 24000 steps give ~1e-12.
  const auto f = [activation](double y) {
    return activation == Activation::Tanh ? std::tanh(y) : y / (1.0 + std::exp(-y));
  };
  const double lo = -12.0, hi = 12.0;
  const int steps = 24000;
  const double h = (hi - lo) / steps;
  double sum = 0.0;
  for (int i = 0; i <= steps; ++i) {
    const double y = lo + i * h;
    const double weight = (i == 0 || i == steps) ? 0.5 : 1.0;
    const double density = std::exp(-0.5 * y * y) / std::sqrt(2.0 * M_PI);
    sum += weight * f(y) * f(y) * density;
  }
  return sum * h;
}

double variance_preserving_std(int64_t fan_in, Activation activation) {
  // Var[y] = fan_in · Var[w] · E[f(y_prev)²] = 1  =>  Var[w] = 1 / (fan_in · E[f(y_prev)²]).
  return 1.0 / std::sqrt(static_cast<double>(fan_in) * activation_second_moment(activation));
}

}  // namespace fivefold::ch01
