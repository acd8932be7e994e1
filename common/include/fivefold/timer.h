#pragma once
/// @file timer.h
/// @brief Wall-clock timing with a monotonic clock, and the median of repeated timings.

#include <algorithm>
#include <chrono>
#include <vector>

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
  /// When the measurement started, in seconds of the monotonic clock (CLOCK_MONOTONIC: since an
  /// instant fixed at boot, the same for every process of a machine): how processes on one
  /// machine line up their timelines (chapter 11's pipeline ranks).
  double started() const {
    return std::chrono::duration<double>(start_.time_since_epoch()).count();
  }

 private:
  using Clock = std::chrono::steady_clock;
  Clock::time_point start_;
};

/// The median of `values` (the upper middle one of an even count): what the benchmarks report of
/// repeated timings, less moved by a noisy machine's outliers than the mean. `values` not empty.
inline double median(std::vector<double> values) {
  std::nth_element(values.begin(), values.begin() + values.size() / 2, values.end());
  return values[values.size() / 2];
}

}  // namespace fivefold
