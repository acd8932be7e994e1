// The watchdog: every running operation is registered with its start time; a thread checks the
// table twice a second and aborts the job when one has run longer than the timeout
// (FIVEFOLD_COMM_TIMEOUT), naming the operation. It also ends a rank whose launcher is gone.

#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <thread>

#include "fivefold/dist.h"
#include "fivefold/error.h"
#include "internal.h"

namespace fivefold::dist {

using detail::OpLabel;

namespace {

// A peer as the user knows it, its world rank, with its rank inside the group when that differs.
std::string peer(int rank, int world_rank, const std::string& communicator) {
  std::string text = "rank " + std::to_string(world_rank);
  if (rank != world_rank) text += " (" + std::to_string(rank) + " in '" + communicator + "')";
  return text;
}

std::string describe(const OpLabel& label) {
  std::string text = std::string(op_name(label.op)) + " on '" + *label.communicator + "' (" +
                     std::to_string(label.bytes) + " bytes)";
  if (label.dst >= 0) text += " to " + peer(label.dst, label.dst_world, *label.communicator);
  if (label.src >= 0)
    text += (label.dst >= 0 ? ", from " : " from ") +
            peer(label.src, label.src_world, *label.communicator);
  return text;
}

struct Watchdog {
  std::mutex mutex;
  std::condition_variable wake;
  std::map<uint64_t, std::pair<OpLabel, std::chrono::steady_clock::time_point>> running;
  uint64_t next_id = 0;
  bool stop = false;
  std::thread thread;
};

Watchdog& watchdog() {
  static Watchdog* instance = new Watchdog();  // never destroyed: outlives every thread using it
  return *instance;
}

std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%g", seconds);
  return text;
}

}  // namespace

double comm_timeout_seconds() {
  static const double seconds = [] {
    const char* text = std::getenv("FIVEFOLD_COMM_TIMEOUT");
    if (text == nullptr || *text == '\0') return 600.0;
    char* end = nullptr;
    double value = std::strtod(text, &end);
    FIVEFOLD_CHECK(end != text && *end == '\0' && value > 0,
                   "FIVEFOLD_COMM_TIMEOUT must be a positive number of seconds, got '", text, "'");
    return value;
  }();
  return seconds;
}

namespace detail {

OpLabel label_of(const Communicator& c, Op op, int64_t bytes, int dst, int src) {
  return OpLabel{op,  &c.name(), bytes, dst, src, dst >= 0 ? c.world_rank(dst) : -1,
                 src >= 0 ? c.world_rank(src) : -1};
}

WatchdogGuard::WatchdogGuard(const OpLabel& what) {
  auto& w = watchdog();
  std::lock_guard<std::mutex> lock(w.mutex);
  id_ = w.next_id++;
  w.running[id_] = {what, std::chrono::steady_clock::now()};
}

WatchdogGuard::~WatchdogGuard() {
  auto& w = watchdog();
  std::lock_guard<std::mutex> lock(w.mutex);
  w.running.erase(id_);
}

void start_watchdog(long launcher) {
  auto& w = watchdog();
  std::lock_guard<std::mutex> lock(w.mutex);
  if (w.thread.joinable()) return;
  w.stop = false;
  const double timeout = comm_timeout_seconds();
  w.thread = std::thread([&w, timeout, launcher] {
    std::unique_lock<std::mutex> lock(w.mutex);
    while (!w.stop) {
      w.wake.wait_for(lock, std::chrono::milliseconds(500));
      if (launcher > 0 && static_cast<long>(::getppid()) != launcher) {
        // The launcher was killed: its job is over. Exit rather than abort through the backend,
        // whose launcher is the process that is gone.
        const std::string line = "[rank " + std::to_string(global_rank()) +
                                 "] fivefold: the launcher (pid " + std::to_string(launcher) +
                                 ") is gone: ending this rank\n";
        std::fputs(line.c_str(), stderr);
        std::fflush(stderr);
        std::_Exit(4);
      }
      const auto now = std::chrono::steady_clock::now();
      for (const auto& [id, entry] : w.running) {
        const double age = std::chrono::duration<double>(now - entry.second).count();
        if (age > timeout) {
          const std::string reason = describe(entry.first) + " has not completed after " +
                                     std::to_string(static_cast<int>(age)) +
                                     " s (FIVEFOLD_COMM_TIMEOUT=" + seconds_text(timeout) +
                                     "): a peer is dead, stuck, or issuing a different operation";
          lock.unlock();
          abort_job(3, reason);
        }
      }
    }
  });
}

void stop_watchdog() {
  auto& w = watchdog();
  {
    std::lock_guard<std::mutex> lock(w.mutex);
    if (!w.thread.joinable()) return;
    w.stop = true;
  }
  w.wake.notify_all();
  w.thread.join();
}

}  // namespace detail

}  // namespace fivefold::dist
