#include "fivefold/comm_stats.h"

#include <iomanip>
#include <mutex>
#include <sstream>

namespace fivefold::dist {
namespace {
std::mutex& stats_mutex() {
  static std::mutex mutex;
  return mutex;
}
CommStats& stats_table() {
  static CommStats table;
  return table;
}
}  // namespace

void record_comm(const std::string& communicator, Op op, int64_t bytes, double wire_bytes) {
  std::lock_guard<std::mutex> lock(stats_mutex());
  OpCounts& counts = stats_table()[communicator][op];
  counts.calls += 1;
  counts.payload_bytes += bytes;
  counts.modelled_wire_bytes += wire_bytes;
}

void record_comm_time(const std::string& communicator, Op op, double seconds) {
  std::lock_guard<std::mutex> lock(stats_mutex());
  stats_table()[communicator][op].blocked_seconds += seconds;
}

CommStats comm_stats() {
  std::lock_guard<std::mutex> lock(stats_mutex());
  return stats_table();
}

void reset_comm_stats() {
  std::lock_guard<std::mutex> lock(stats_mutex());
  stats_table().clear();
}

CommStats comm_stats_since(const CommStats& earlier) {
  CommStats now = comm_stats();
  for (auto& [comm, ops] : now) {
    const auto before = earlier.find(comm);
    if (before == earlier.end()) continue;
    for (auto& [op, counts] : ops) {
      const auto old = before->second.find(op);
      if (old == before->second.end()) continue;
      counts.calls -= old->second.calls;
      counts.payload_bytes -= old->second.payload_bytes;
      counts.modelled_wire_bytes -= old->second.modelled_wire_bytes;
      counts.blocked_seconds -= old->second.blocked_seconds;
    }
  }
  return now;
}

void accumulate_comm_stats(CommStats& total, const CommStats& part) {
  for (const auto& [comm, ops] : part) {
    for (const auto& [op, counts] : ops) {
      if (counts.calls == 0) continue;
      OpCounts& sum = total[comm][op];
      sum.calls += counts.calls;
      sum.payload_bytes += counts.payload_bytes;
      sum.modelled_wire_bytes += counts.modelled_wire_bytes;
      sum.blocked_seconds += counts.blocked_seconds;
    }
  }
}

OpCounts comm_counts(const std::string& communicator, Op op) {
  std::lock_guard<std::mutex> lock(stats_mutex());
  auto comm = stats_table().find(communicator);
  if (comm == stats_table().end()) return {};
  auto entry = comm->second.find(op);
  return entry == comm->second.end() ? OpCounts{} : entry->second;
}

std::string format_comm_stats(const CommStats& stats) {
  std::ostringstream out;
  out << std::left << std::setw(16) << "communicator" << std::setw(16) << "op" << std::right
      << std::setw(10) << "calls" << std::setw(16) << "payload bytes" << std::setw(16)
      << "modelled wire"
      << "\n";
  for (const auto& [comm, ops] : stats) {
    for (const auto& [op, counts] : ops) {
      out << std::left << std::setw(16) << comm << std::setw(16) << op_name(op) << std::right
          << std::setw(10) << counts.calls << std::setw(16) << counts.payload_bytes << std::setw(16)
          << std::fixed << std::setprecision(0) << counts.modelled_wire_bytes << "\n";
    }
  }
  return out.str();
}

}  // namespace fivefold::dist
