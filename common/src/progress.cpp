#include "fivefold/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace fivefold {

ProgressBar::ProgressBar(int64_t total, std::string label, bool enabled)
    : total_(std::max<int64_t>(total, 1)),
      label_(std::move(label)),
      enabled_(enabled),
      terminal_(isatty(STDERR_FILENO) != 0) {}

void ProgressBar::update(int64_t done, const std::string& status) {
  done_ = std::min(done, total_);
  status_ = status;
  if (!enabled_) return;
  // A terminal redraws at most 10 times a second; a log gets a line every 5 seconds.
  const double now = timer_.seconds();
  if (now - last_draw_ < (terminal_ ? 0.1 : 5.0) && done_ < total_) return;
  last_draw_ = now;
  draw(false);
}

void ProgressBar::clear() {
  if (!enabled_ || !terminal_ || finished_) return;
  std::fprintf(stderr, "\r\033[K");
  std::fflush(stderr);
  last_draw_ = -1e9;
}

void ProgressBar::finish(const std::string& status) {
  if (finished_) return;
  finished_ = true;
  if (!status.empty()) status_ = status;
  if (enabled_) draw(true);
}

void ProgressBar::draw(bool final_line) {
  const double elapsed = timer_.seconds();
  const double fraction = static_cast<double>(done_) / static_cast<double>(total_);
  const double rate = elapsed > 0 ? static_cast<double>(done_) / elapsed : 0.0;
  const double left = rate > 0 ? static_cast<double>(total_ - done_) / rate : 0.0;
  constexpr int width = 30;
  const int filled = static_cast<int>(fraction * width);
  std::string bar(filled, '#');
  bar.resize(width, '.');
  const std::string eta = final_line ? "" : "eta " + std::to_string(static_cast<int>(left)) + "s";
  char line[512];
  std::snprintf(line, sizeof(line), "%s [%s] %lld/%lld %5.1f%% %.1f/s %s %s", label_.c_str(),
                bar.c_str(), static_cast<long long>(done_), static_cast<long long>(total_),
                100.0 * fraction, rate, eta.c_str(), status_.c_str());
  if (terminal_) {
    std::fprintf(stderr, "\r%s\033[K%s", line, final_line ? "\n" : "");
  } else {
    std::fprintf(stderr, "%s\n", line);
  }
  std::fflush(stderr);
}

}  // namespace fivefold
