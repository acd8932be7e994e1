#pragma once
/// @file progress.h
/// @brief A progress bar for long work: redrawn in place on a terminal, a line every few seconds
/// otherwise (CI logs), and silent on ranks other than 0.

#include <cstdint>
#include <string>

#include "fivefold/timer.h"

namespace fivefold {

/// Progress of `total` units of work, with rate and time left.
class ProgressBar {
 public:
  /// @param total units of work; @param label shown before the bar; @param enabled false silences
  /// it.
  ProgressBar(int64_t total, std::string label, bool enabled = true);
  /// Sets the number of units done, with an optional status text (e.g. "loss 2.31").
  void update(int64_t done, const std::string& status = "");
  /// Erases the bar from a terminal so that a log line can be printed cleanly; the next update
  /// draws it again.
  void clear();
  /// Prints the final state and a newline.
  void finish(const std::string& status = "");

 private:
  void draw(bool final_line);
  int64_t total_;
  int64_t done_ = 0;
  std::string label_;
  std::string status_;
  bool enabled_;
  bool terminal_;
  bool finished_ = false;
  Timer timer_;
  double last_draw_ = -1e9;
};

}  // namespace fivefold
