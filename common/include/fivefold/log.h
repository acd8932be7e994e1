#pragma once
/// @file log.h
/// @brief Rank-prefixed logging: `log() << "x=" << x;` prints one whole line, `[rank 2/8] x=3`.

#include <sstream>
#include <string>

namespace fivefold {

/// Severity of a log line. Lines below the threshold (env FIVEFOLD_LOG_LEVEL: debug, info,
/// warn, error; default info) are dropped.
enum class LogLevel { Debug = 0, Info = 1, Warn = 2, Error = 3 };

/// One log line, written atomically to stderr when it goes out of scope.
class LogLine {
 public:
  /// @param level severity; @param enabled false drops the line (another rank's log0()).
  LogLine(LogLevel level, bool enabled);
  /// Moves a line that is being built (returned by log()).
  LogLine(LogLine&&) = default;
  /// Writes the line.
  ~LogLine();
  /// Appends anything printable to the line.
  template <typename T>
  LogLine& operator<<(const T& value) {
    if (enabled_) buffer_ << value;
    return *this;
  }

 private:
  LogLevel level_;
  bool enabled_;
  std::ostringstream buffer_;
};

/// A line from this rank, whatever its rank.
LogLine log(LogLevel level = LogLevel::Info);
/// A line printed by rank 0 only (for messages every rank would repeat identically).
LogLine log0(LogLevel level = LogLevel::Info);
/// Sets the `[rank r/n]` prefix; called once the world is known.
void set_log_rank(int rank, int size);

}  // namespace fivefold
