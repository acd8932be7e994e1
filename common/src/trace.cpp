#include "fivefold/trace.h"

#include <chrono>
#include <mutex>
#include <vector>

namespace fivefold::trace {
namespace detail {
std::atomic<bool> g_recording{false};
}  // namespace detail

namespace {
std::mutex g_mutex;
std::vector<Event> g_events;
std::chrono::steady_clock::time_point g_zero = std::chrono::steady_clock::now();
}  // namespace

void start() {
  std::lock_guard<std::mutex> lock(g_mutex);
  g_events.clear();
  g_zero = std::chrono::steady_clock::now();
  detail::g_recording.store(true);
}

void stop() { detail::g_recording.store(false); }

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - g_zero).count();
}

void record(const std::string& name, const char* category, double start, double seconds,
            Lane lane, nlohmann::json args) {
  if (!recording()) return;
  std::lock_guard<std::mutex> lock(g_mutex);
  g_events.push_back({name, category, lane, start, seconds, std::move(args)});
}

Span::Span(std::string name, const char* category, Lane lane)
    : name_(std::move(name)), category_(category), lane_(lane) {
  if (recording()) start_ = now();
}

Span::~Span() {
  if (start_ >= 0) record(name_, category_, start_, now() - start_, lane_);
}

nlohmann::json chrome_trace(const std::vector<Event>& events, int pid, const std::string& process,
                            const std::vector<std::pair<int, std::string>>& lanes) {
  nlohmann::json out = nlohmann::json::array();
  out.push_back(
      {{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"args", {{"name", process}}}});
  for (const auto& [lane, label] : lanes)
    out.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", lane},
                   {"args", {{"name", label}}}});
  for (const Event& e : events) {
    nlohmann::json event = {{"ph", "X"},         {"name", e.name},
                            {"cat", e.category}, {"pid", pid},
                            {"tid", e.lane},     {"ts", e.start * 1e6},
                            {"dur", e.seconds * 1e6}};
    if (!e.args.is_null()) event["args"] = e.args;
    out.push_back(std::move(event));
  }
  return {{"traceEvents", out}, {"displayTimeUnit", "ms"}};
}

nlohmann::json chrome_trace(int rank) {
  std::lock_guard<std::mutex> lock(g_mutex);
  return chrome_trace(g_events, rank, "rank " + std::to_string(rank),
                      {{kMain, "training"}, {kWorker, "communication worker"}});
}

}  // namespace fivefold::trace
