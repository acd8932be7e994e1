#pragma once
/// @file timer.h
/// @brief Wall-clock timing with a monotonic clock.

#include <chrono>

namespace fivefold {

/// Measures elapsed wall time since construction or the last reset().
class Timer {
 public:
  Timer() : start_(Clock::now()) {}
  /// Restarts the measurement.
  void reset() { start_ = Clock::now(); }
  /// Seconds elapsed.
  double seconds() const { return std::chrono::duration<double>(Clock::now() - start_).count(); }
  /// Microseconds elapsed.
  double microseconds() const { return seconds() * 1e6; }

 private:
  using Clock = std::chrono::steady_clock;
  Clock::time_point start_;
};

}  // namespace fivefold
