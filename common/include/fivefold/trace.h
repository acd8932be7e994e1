#pragma once
/// @file trace.h
/// @brief A per-rank timeline of a run, written as Chrome trace JSON (open it in
/// chrome://tracing or https://ui.perfetto.dev): the trainer's steps, evaluations and
/// checkpoints, and every communicator operation, both where the caller waited for it and, for
/// queued (asynchronous) operations, when the communicator's worker thread carried it out, so a
/// transfer hidden behind compute shows as a bar on the worker's lane with no wait beneath it.
///
/// Recording is off until start(); while off, a Span costs one relaxed atomic load.

#include <atomic>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace fivefold::trace {

/// Lanes of the timeline (Chrome's "thread" of an event).
enum Lane : int {
  kMain = 0,    ///< the training thread: steps, evaluations, waits for communication
  kWorker = 1,  ///< communicators' worker threads: queued operations as they run
};

namespace detail {
extern std::atomic<bool> g_recording;
}  // namespace detail

/// Clears what was recorded and starts recording; times are measured from now.
void start();
/// Stops recording (what was recorded stays until the next start()).
void stop();
/// Whether start() has been called and stop() has not.
inline bool recording() { return detail::g_recording.load(std::memory_order_relaxed); }
/// Seconds since start() (steady clock).
double now();
/// Records one complete event `name` of `category` on `lane`, from `start` (seconds since
/// start()) for `seconds`, with `args` shown beside it. Thread-safe; ignored when not recording.
void record(const std::string& name, const char* category, double start, double seconds,
            Lane lane = kMain, nlohmann::json args = {});

/// Records the time from its construction to its destruction as one event (when recording).
class Span {
 public:
  /// Starts timing `name` (shown under `category`, on `lane`) if recording.
  Span(std::string name, const char* category, Lane lane = kMain);
  /// Records the event (if recording began before the span did).
  ~Span();
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

 private:
  std::string name_;
  const char* category_;
  Lane lane_;
  double start_ = -1;  // negative: not recording when constructed
};

/// One complete event of a timeline.
struct Event {
  std::string name;      ///< what ran
  std::string category;  ///< Chrome's "cat"
  int lane = kMain;      ///< Chrome's thread ("tid")
  double start = 0;      ///< seconds from the timeline's origin
  double seconds = 0;    ///< how long it ran
  nlohmann::json args;   ///< shown beside it (null: none)
};

/// `events` as Chrome trace JSON: {"traceEvents": [...], "displayTimeUnit": "ms"}, complete
/// events ("ph": "X") in microseconds in process `pid` named `process`, each lane of `lanes` a
/// thread of that name. The one writer of the format: the run's timeline below, and chapter 11's
/// pipeline timelines.
nlohmann::json chrome_trace(const std::vector<Event>& events, int pid, const std::string& process,
                            const std::vector<std::pair<int, std::string>>& lanes);

/// What was recorded, as Chrome trace JSON (the function above): pid `rank`, named "rank N", one
/// thread per lane.
nlohmann::json chrome_trace(int rank);

}  // namespace fivefold::trace
