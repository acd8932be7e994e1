#include "fivefold/trace.h"

#include <chrono>
#include <mutex>
#include <vector>

namespace fivefold::trace {
namespace detail {
std::atomic<bool> g_recording{false};
}  // namespace detail

namespace {
struct Event {
  std::string name;
  const char* category;
  double start, seconds;
  Lane lane;
  nlohmann::json args;
};
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
  g_events.push_back({name, category, start, seconds, lane, std::move(args)});
}

Span::Span(std::string name, const char* category, Lane lane)
    : name_(std::move(name)), category_(category), lane_(lane) {
  if (recording()) start_ = now();
}

Span::~Span() {
  if (start_ >= 0) record(name_, category_, start_, now() - start_, lane_);
}

nlohmann::json chrome_trace(int rank) {
  std::lock_guard<std::mutex> lock(g_mutex);
  nlohmann::json events = nlohmann::json::array();
  events.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", rank},
                    {"args", {{"name", "rank " + std::to_string(rank)}}}});
  for (const auto& [lane, label] : {std::pair{kMain, "training"}, {kWorker, "communication worker"}})
    events.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", rank}, {"tid", lane},
                      {"args", {{"name", label}}}});
  for (const Event& e : g_events) {
    nlohmann::json event = {{"ph", "X"},          {"name", e.name},
                            {"cat", e.category},  {"pid", rank},
                            {"tid", e.lane},      {"ts", e.start * 1e6},
                            {"dur", e.seconds * 1e6}};
    if (!e.args.is_null()) event["args"] = e.args;
    events.push_back(std::move(event));
  }
  return {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}

}  // namespace fivefold::trace
