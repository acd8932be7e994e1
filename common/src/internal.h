#pragma once
// Declarations shared by the files of fivefold_common, not part of its public interface.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>

#include "fivefold/dist.h"
#include "fivefold/runtime.h"

namespace fivefold::dist::detail {

/// This process's rank in the world (0 before the runtime starts), for messages.
int global_rank();
/// Records the world's rank once known.
void set_global_rank(int rank);

/// Gloo under mpirun/srun: removes the job's rendezvous file (a job that fails never closes its
/// store, which would remove it). Nothing otherwise. Async-signal-safe (one unlink).
void forget_rendezvous();

/// Backend-specific part of abort_job: MPI_Abort when MPI is running; nothing otherwise.
void abort_backend(int code);

/// Starts the thread that aborts the job when an operation exceeds the timeout. With `launcher`
/// > 0 (the parent process that started this rank: mpirun, srun's step daemon, torchrun's agent)
/// it also ends this rank, within a second, when that process is gone (the rank has been
/// re-parented), so no rank outlives its job.
void start_watchdog(long launcher = 0);
/// Stops it.
void stop_watchdog();

/// What an operation is, kept as fields: formatted only if the watchdog has to report it.
struct OpLabel {
  Op op;
  const std::string* communicator;  // outlives the operation
  int64_t bytes;
  int dst;        // -1: none
  int src;        // -1: none
  int dst_world;  // the same peers' ranks in the world (what the logs' [rank N] says)
  int src_world;
};
/// The label of operation `op` of `bytes` on `c`, with its peers (-1: none).
OpLabel label_of(const Communicator& c, Op op, int64_t bytes, int dst, int src);

/// Registers an operation with the watchdog for as long as it lives.
class WatchdogGuard {
 public:
  explicit WatchdogGuard(const OpLabel& what);
  ~WatchdogGuard();
  WatchdogGuard(const WatchdogGuard&) = delete;
  WatchdogGuard& operator=(const WatchdogGuard&) = delete;

 private:
  uint64_t id_;
};

/// MPI: initialises MPI (MPI_THREAD_MULTIPLE) and returns MPI_COMM_WORLD as "world".
CommunicatorPtr start_mpi_world();
/// MPI: this rank's index among the ranks on its machine, and their number.
std::pair<int, int> mpi_node_rank_and_size();
/// MPI: finalises MPI (after every communicator is gone).
void stop_mpi();

/// Gloo: rendezvous (TCPStore at MASTER_ADDR:MASTER_PORT, or a FileStore named after the job id
/// when the launcher is mpirun/srun) and the world process group.
CommunicatorPtr start_gloo_world(const LaunchInfo& launch);

}  // namespace fivefold::dist::detail
