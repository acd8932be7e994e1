#pragma once
/// @file runtime.h
/// @brief What every fivefold program does first: read the launcher's environment, start the
/// communication backend, give each rank its share of the cores, and check the BLAS library.
///
/// ```
/// int main(int argc, char** argv) {
///   fivefold::Runtime runtime;               // MPI under mpirun/srun, Gloo under torchrun
///   auto world = runtime.world();
///   ...
/// }
/// ```

#include <memory>
#include <string>

#include "fivefold/dist.h"

namespace fivefold {

/// Who started this process, read from the environment before any backend starts.
struct LaunchInfo {
  std::string launcher;     ///< "mpirun", "srun", "torchrun" or "single"
  int rank = 0;             ///< global rank
  int size = 1;             ///< number of processes
  int local_rank = 0;       ///< rank among the processes on this machine
  int local_size = 1;       ///< processes on this machine
  std::string master_addr;  ///< torchrun's MASTER_ADDR (empty if unset)
  int master_port = 0;      ///< torchrun's MASTER_PORT (0 if unset)
  std::string job_id;       ///< unique per job and shared by its ranks (for rendezvous names)
};

/// Reads OpenMPI (OMPI_COMM_WORLD_*), SLURM (SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID) and
/// torchrun (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) variables.
/// Throws fivefold::Error for inconsistent values (e.g. RANK >= WORLD_SIZE).
LaunchInfo read_launch_environment();

/// Options of the runtime; defaults come from the environment.
struct RuntimeOptions {
  /// "auto" (MPI under mpirun/srun or alone, Gloo under torchrun), "mpi" or "gloo".
  /// Default: env FIVEFOLD_BACKEND, else "auto".
  std::string backend;
  /// Intra-op threads per rank; 0 = cores / ranks on this machine (at least 1), or
  /// env FIVEFOLD_THREADS.
  int threads = 0;
  /// Skip the reference-BLAS check (benchmarks that measure it themselves).
  bool check_blas = true;
};

/// The process-wide runtime. Exactly one may exist at a time; it is torn down (communicators
/// closed, MPI finalised) when it goes out of scope, except when an exception takes it out of
/// scope in a job of several processes: the other ranks may be working on, and MPI_Finalize
/// would wait for them, so the backend is left up for exit_on_error to end the whole job.
class Runtime {
 public:
  /// Starts the backend chosen by `options` (see RuntimeOptions) and sets up logging.
  explicit Runtime(RuntimeOptions options = {});
  ~Runtime();
  Runtime(const Runtime&) = delete;
  Runtime& operator=(const Runtime&) = delete;

  /// The communicator of all ranks, named "world".
  dist::CommunicatorPtr world() const { return world_; }
  /// The launcher's view of this process.
  const LaunchInfo& launch() const { return launch_; }
  /// The backend in use.
  dist::Backend backend() const { return world_->backend(); }

 private:
  LaunchInfo launch_;
  dist::CommunicatorPtr world_;
  int uncaught_ = 0;  // exceptions in flight when it started (std::uncaught_exceptions)
};

/// What a program does with an exception that reached its `main` (run_guarded calls it): prints
/// `<program>: error: <what>` on stderr once and returns the exit status 1. In a job of several
/// processes the line starts with `[rank R on HOST]`, and when the error left a Runtime (other
/// ranks may be computing on or waiting for this one) it ends the whole job instead of returning:
/// after a grace of 2 s, in which ranks that refuse the same input print theirs too, MPI_Abort
/// under MPI; under Gloo this rank exits and its peers' next operation fails on the closed
/// connection, which ends them the same way. Never waits on another rank.
int exit_on_error(const std::string& program, const std::string& what);

/// Starts this program again, once, with glibc's malloc on transparent huge pages
/// (GLIBC_TUNABLES=glibc.malloc.hugetlb=1; glibc reads a tunable only when a process starts, and
/// 2.35 is the first to have this one): a training step's large activations then come from 2 MB
/// pages, kept in malloc's heap for reuse (chapter 14's notes, §6: the fp32 step at d256 about 15%
/// faster in `fivefold train`). Restarting loads the program's libraries twice (about 0.5 s here),
/// so only long-running programs call it (`fivefold train` and `calibrate`, the training
/// benchmark). Call it first thing in `main`, with main's argv: when it restarts,
/// the new program replaces the process (the same pid, before any launcher or MPI state is
/// touched) and the call does not return. It returns, changing nothing, when the tunable is set
/// already (the restarted process, or the user's own choice), with FIVEFOLD_HUGE_PAGES=0 in the
/// environment, on an older glibc, or when the restart fails.
void restart_with_huge_pages(char** argv);

/// Whether restart_with_huge_pages would restart: glibc 2.35 or later, and FIVEFOLD_HUGE_PAGES is
/// not 0. What `fivefold info` reports for `fivefold train`.
bool huge_pages_wanted();

/// Whether this process's malloc was started on transparent huge pages (restart_with_huge_pages,
/// or the tunable set by the user): what `fivefold train` says when it starts training.
bool malloc_on_huge_pages();

}  // namespace fivefold
