#pragma once
/// @file comm_stats.h
/// @brief Counts of every Communicator operation on this rank, per communicator name and op,
/// so tests and notes can compare measured communication with the formulas.
///
/// Two byte counts are kept per operation, one measured and one modelled:
/// - `payload_bytes` (**measured**): the bytes this rank handed to the operation, counted from the
///   tensors themselves: the tensor reduced (all_reduce, reduce_scatter input), the full gathered
///   result (all_gather output), the tensor broadcast, sent (send, send_recv's send side) or
///   received (recv), all_to_all's input. A test or note that says "measured" means this.
/// - `modelled_wire_bytes` (**modelled**): what this rank would send over the network under a
///   formula per algorithm. For send, send_recv and all_to_all it is exact (rows addressed to
///   other ranks). For the library collectives, whose internal algorithm is the backend's and
///   cannot be observed, it is the bandwidth-optimal ring volume per rank, as nccl-tests' bus
///   bandwidth assumes, with S = payload and N = ranks: all_reduce 2(N-1)/N S, all_gather and
///   reduce_scatter (N-1)/N S, broadcast (N-1)/N S, recv and barrier 0. Chapter 08's own ring
///   algorithms are built from send_recv, so their wire bytes are exact.

#include <cstdint>
#include <map>
#include <string>

#include "fivefold/dist.h"

namespace fivefold::dist {

/// Totals for one (communicator, op) pair.
struct OpCounts {
  int64_t calls = 0;               ///< operations issued
  int64_t payload_bytes = 0;       ///< measured: bytes handed to the operations (file comment)
  double modelled_wire_bytes = 0;  ///< modelled: bytes this rank sends (file comment)
  /// Measured: seconds the calling thread was held up by the operations: inside the synchronous
  /// ones (waiting for queued ones first, then the transfer, including waiting for the peers),
  /// and inside Work::wait() for the asynchronous ones (zero when the transfer was already over:
  /// the part that overlap hid is not counted).
  double blocked_seconds = 0;
};

/// communicator name -> op -> counts.
using CommStats = std::map<std::string, std::map<Op, OpCounts>>;

/// A copy of this rank's counts so far.
CommStats comm_stats();

/// Sets every count to zero (e.g. after set-up, before the part a test measures).
void reset_comm_stats();

/// The counts added since `earlier` (a comm_stats() copy taken before): what one part of a run
/// communicated, e.g. a training step without the evaluation and checkpoints around it.
CommStats comm_stats_since(const CommStats& earlier);

/// Adds every count of `part` into `total`.
void accumulate_comm_stats(CommStats& total, const CommStats& part);

/// Counts for one communicator and op (zero if never used).
OpCounts comm_counts(const std::string& communicator, Op op);

/// Adds one operation to the counts; called by Communicator for every operation it issues.
void record_comm(const std::string& communicator, Op op, int64_t bytes, double wire_bytes);
/// Adds the seconds a synchronous operation blocked its caller; called by Communicator.
void record_comm_time(const std::string& communicator, Op op, double seconds);

/// A readable table of the counts (one row per communicator and op).
std::string format_comm_stats(const CommStats& stats);

}  // namespace fivefold::dist
