#include "fivefold/log.h"

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <mutex>

namespace fivefold {
namespace {
std::atomic<int> g_rank{0};
std::atomic<int> g_size{1};

LogLevel threshold() {
  static const LogLevel level = [] {
    const char* text = std::getenv("FIVEFOLD_LOG_LEVEL");
    if (text == nullptr) return LogLevel::Info;
    if (std::strcmp(text, "debug") == 0) return LogLevel::Debug;
    if (std::strcmp(text, "warn") == 0) return LogLevel::Warn;
    if (std::strcmp(text, "error") == 0) return LogLevel::Error;
    return LogLevel::Info;
  }();
  return level;
}

const char* level_tag(LogLevel level) {
  switch (level) {
    case LogLevel::Debug: return "debug: ";
    case LogLevel::Warn: return "WARNING: ";
    case LogLevel::Error: return "ERROR: ";
    default: return "";
  }
}
}  // namespace

LogLine::LogLine(LogLevel level, bool enabled)
    : level_(level), enabled_(enabled && level >= threshold()) {}

LogLine::~LogLine() {
  if (!enabled_) return;
  static std::mutex mutex;
  std::string line;
  if (g_size > 1) line = "[rank " + std::to_string(g_rank) + "/" + std::to_string(g_size) + "] ";
  line += level_tag(level_);
  line += buffer_.str();
  line += "\n";
  std::lock_guard<std::mutex> lock(mutex);
  std::cerr << line << std::flush;
}

LogLine log(LogLevel level) { return LogLine(level, true); }
LogLine log0(LogLevel level) { return LogLine(level, g_rank == 0); }

void set_log_rank(int rank, int size) {
  g_rank = rank;
  g_size = size;
}

}  // namespace fivefold
