#include "fivefold/runtime.h"

#include <gnu/libc-version.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <tuple>

#include "fivefold/blas.h"
#include "fivefold/error.h"
#include "fivefold/io.h"
#include "fivefold/log.h"
#include "internal.h"

namespace fivefold {
namespace {

std::atomic<int> g_rank{0};
std::atomic<bool> g_runtime_alive{false};
// Set when an exception took a Runtime of several processes out of scope: the backend is still
// up (kept on purpose) and exit_on_error must end the job rather than return.
std::atomic<int> g_failed_world_size{0};
std::atomic<bool> g_failed_mpi{false};

// SIGINT / SIGTERM (Ctrl-C, mpirun or a scheduler ending the job): say so, release the run
// folder's lock and end at once. Only async-signal-safe calls; the lines are written beforehand.
char g_stop_line[2][256];
struct sigaction g_previous[2];
constexpr int kStopSignals[2] = {SIGINT, SIGTERM};

extern "C" void on_stop_signal(int signal) {
  // The lock first: mpirun sends SIGKILL a second after SIGTERM, and the line goes through a
  // pipe that may be slow to take it while the job is torn down.
  io::release_held_locks_now();
  dist::detail::forget_rendezvous();  // unlink(2) on fixed storage: safe here too
  const int i = signal == SIGINT ? 0 : 1;
  const ssize_t ignored = ::write(STDERR_FILENO, g_stop_line[i], std::strlen(g_stop_line[i]));
  (void)ignored;
  ::_exit(128 + signal);
}

void install_stop_handlers(int rank) {
  for (int i = 0; i < 2; ++i) {
    std::snprintf(g_stop_line[i], sizeof(g_stop_line[i]),
                  "[rank %d] fivefold: ended by %s; a training run continues from its last "
                  "checkpoint with --resume\n",
                  rank, kStopSignals[i] == SIGINT ? "SIGINT" : "SIGTERM");
    struct sigaction action {};
    action.sa_handler = on_stop_signal;
    sigemptyset(&action.sa_mask);
    ::sigaction(kStopSignals[i], &action, &g_previous[i]);
  }
}

void restore_stop_handlers() {
  for (int i = 0; i < 2; ++i) ::sigaction(kStopSignals[i], &g_previous[i], nullptr);
}

LaunchInfo launch_environment_or_single();

// "[rank R on HOST] " in a job of several processes, "" alone. Before the world is made (an
// input refused while the flags are read) the rank is the launcher's.
std::string rank_prefix(bool several) {
  if (!several) return "";
  int rank = dist::detail::global_rank();
  if (rank == 0) rank = launch_environment_or_single().rank;
  return "[rank " + std::to_string(rank) + " on " + io::host_name() + "] ";
}

// An error that only says a peer's connection closed is the echo of that peer's own end.
std::string explain(const std::string& what) {
  if (what.find("Connection closed by peer") == std::string::npos &&
      what.find("Connection reset by peer") == std::string::npos)
    return what;
  return "another rank ended (its error, printed above, says why), closing its connection: " +
         what;
}

// std::terminate: an exception no code caught, such as the one Gloo's transport thread throws
// when a peer's connection closes while no operation is waiting on it. One line, then the same
// ending as exit_on_error, instead of an abort with a core dump.
[[noreturn]] void on_terminate() {
  std::string what = "std::terminate called without an exception";
  if (const auto error = std::current_exception()) {
    try {
      std::rethrow_exception(error);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
      what = "an exception of unknown type";
    }
  }
  const std::string line =
      rank_prefix(g_runtime_alive || g_failed_world_size > 1) + "fivefold: fatal: " + explain(what) + "\n";
  std::fputs(line.c_str(), stderr);
  std::fflush(stderr);
  dist::detail::forget_rendezvous();
  dist::detail::abort_backend(1);
  std::_Exit(1);
}

const char* env(const char* name) {
  const char* value = std::getenv(name);
  return (value != nullptr && *value != '\0') ? value : nullptr;
}

int env_int(const char* name, int fallback) {
  const char* text = env(name);
  if (text == nullptr) return fallback;
  char* end = nullptr;
  long value = std::strtol(text, &end, 10);
  FIVEFOLD_CHECK(end != text && *end == '\0', "environment variable ", name,
                 " must be an integer, got '", text, "'");
  return static_cast<int>(value);
}

}  // namespace

namespace dist::detail {
int global_rank() { return g_rank.load(); }
void set_global_rank(int rank) { g_rank.store(rank); }
}  // namespace dist::detail

LaunchInfo read_launch_environment() {
  LaunchInfo info;
  if (env("OMPI_COMM_WORLD_SIZE")) {
    info.launcher = "mpirun";
    info.rank = env_int("OMPI_COMM_WORLD_RANK", 0);
    info.size = env_int("OMPI_COMM_WORLD_SIZE", 1);
    info.local_rank = env_int("OMPI_COMM_WORLD_LOCAL_RANK", 0);
    info.local_size = env_int("OMPI_COMM_WORLD_LOCAL_SIZE", info.size);
    if (const char* job = env("OMPI_MCA_ess_base_jobid")) info.job_id = std::string("ompi-") + job;
  } else if (env("SLURM_PROCID") && env("SLURM_NTASKS")) {
    info.launcher = "srun";
    info.rank = env_int("SLURM_PROCID", 0);
    info.size = env_int("SLURM_NTASKS", 1);
    info.local_rank = env_int("SLURM_LOCALID", 0);
    // Exact per-node counts come from MPI once it starts (Runtime); this is a first guess.
    info.local_size =
        env_int("SLURM_NTASKS_PER_NODE", env_int("SLURM_NNODES", 1) == 1 ? info.size : 1);
    info.local_rank = std::min(info.local_rank, info.local_size - 1);
    if (const char* job = env("SLURM_JOB_ID")) {
      info.job_id =
          std::string("slurm-") + job + "." + (env("SLURM_STEP_ID") ? env("SLURM_STEP_ID") : "0");
    }
  } else if (env("WORLD_SIZE") && env("RANK")) {
    info.launcher = "torchrun";
    info.rank = env_int("RANK", 0);
    info.size = env_int("WORLD_SIZE", 1);
    info.local_rank = env_int("LOCAL_RANK", 0);
    info.local_size = env_int("LOCAL_WORLD_SIZE", info.size);
  } else {
    info.launcher = "single";
  }
  if (const char* addr = env("MASTER_ADDR")) info.master_addr = addr;
  info.master_port = env_int("MASTER_PORT", 0);
  FIVEFOLD_CHECK(info.size >= 1, info.launcher, ": world size must be >= 1, got ", info.size);
  FIVEFOLD_CHECK(info.rank >= 0 && info.rank < info.size, info.launcher, ": rank ", info.rank,
                 " is outside 0..", info.size - 1);
  FIVEFOLD_CHECK(info.local_size >= 1 && info.local_rank >= 0 && info.local_rank < info.local_size,
                 info.launcher, ": local rank ", info.local_rank, " / local size ", info.local_size,
                 " are inconsistent");
  FIVEFOLD_CHECK(info.master_port >= 0 && info.master_port < 65536, "MASTER_PORT ",
                 info.master_port, " is not a port number");
  return info;
}

Runtime::Runtime(RuntimeOptions options) : uncaught_(std::uncaught_exceptions()) {
  FIVEFOLD_CHECK(!g_runtime_alive.exchange(true), "only one fivefold::Runtime may exist at a time");
  try {
    launch_ = read_launch_environment();
    std::string backend = options.backend;
    if (backend.empty()) backend = env("FIVEFOLD_BACKEND") ? env("FIVEFOLD_BACKEND") : "auto";
    if (backend == "auto") backend = launch_.launcher == "torchrun" ? "gloo" : "mpi";
    FIVEFOLD_CHECK(backend == "mpi" || backend == "gloo", "unknown backend '", backend,
                   "': choose mpi, gloo or auto (FIVEFOLD_BACKEND)");
    FIVEFOLD_CHECK(!(backend == "mpi" && launch_.launcher == "torchrun"),
                   "the MPI backend needs mpirun or srun as launcher; under torchrun use "
                   "FIVEFOLD_BACKEND=gloo");

    // A rank started by a launcher ends when the launcher is gone (e.g. mpirun killed by
    // SIGKILL, which cannot tell its ranks), instead of running on as an orphan: from before the
    // ranks meet, where an orphan waited out the rendezvous's timeout (600 s) otherwise.
    dist::detail::set_global_rank(launch_.rank);
    dist::detail::start_watchdog(launch_.launcher == "single" ? 0 : static_cast<long>(::getppid()));
    world_ = backend == "mpi" ? dist::detail::start_mpi_world()
                              : dist::detail::start_gloo_world(launch_);
    FIVEFOLD_CHECK(world_->size() == launch_.size || launch_.launcher == "single", "backend sees ",
                   world_->size(), " ranks but the launcher started ", launch_.size);
    launch_.rank = world_->rank();
    launch_.size = world_->size();
    if (world_->backend() == dist::Backend::Mpi) {
      std::tie(launch_.local_rank, launch_.local_size) = dist::detail::mpi_node_rank_and_size();
    }
    dist::detail::set_global_rank(world_->rank());
    set_log_rank(world_->rank(), world_->size());

    // Each rank gets its share of this machine's cores (more would oversubscribe them).
    int threads = options.threads > 0 ? options.threads : env_int("FIVEFOLD_THREADS", 0);
    if (threads <= 0) {
      const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
      threads = std::max(1, cores / launch_.local_size);
    }
    torch::set_num_threads(threads);
    // OpenMP reads its wait policy when the library loads, before main: too late to set it here.
    if (launch_.local_size > 1 && env("OMP_WAIT_POLICY") == nullptr) {
      log0(LogLevel::Warn) << launch_.local_size
                           << " ranks share this machine but OMP_WAIT_POLICY is "
                           << "unset: idle OpenMP threads spin and slow the other ranks (measured "
                           << "up to 7x). Launch with OMP_WAIT_POLICY=passive (mpirun -x ...).";
    }

    install_stop_handlers(world_->rank());
    std::set_terminate(on_terminate);
    if (options.check_blas) warn_if_reference_blas();
  } catch (...) {
    restore_stop_handlers();
    dist::detail::stop_watchdog();
    world_.reset();
    g_runtime_alive = false;
    throw;
  }
}

Runtime::~Runtime() {
  restore_stop_handlers();
  dist::detail::stop_watchdog();
  const bool mpi = world_ && world_->backend() == dist::Backend::Mpi;
  if (std::uncaught_exceptions() > uncaught_ && world_ && world_->size() > 1) {
    // An error is leaving this rank while the others may be training on. MPI_Finalize (and a
    // Gloo group's teardown) would wait for them, and the error would never be printed: keep the
    // backend up, unreleased, for exit_on_error (the program's handler) to end the whole job.
    g_failed_world_size = world_->size();
    g_failed_mpi = mpi;
    new dist::CommunicatorPtr(std::move(world_));  // deliberately never released
    g_runtime_alive = false;
    return;
  }
  world_.reset();
  if (mpi) dist::detail::stop_mpi();
  g_runtime_alive = false;
}

namespace {
// The launcher's environment, or a single process's when it cannot be read (that process's own
// error says why).
LaunchInfo launch_environment_or_single() {
  try {
    return read_launch_environment();
  } catch (const std::exception&) {
    return LaunchInfo{};
  }
}
}  // namespace

int exit_on_error(const std::string& program, const std::string& what) {
  const std::string prefix = program + ": ";
  std::string line =
      prefix + "error: " + explain(what.rfind(prefix, 0) == 0 ? what.substr(prefix.size()) : what);
  const int size = std::max<int>(g_failed_world_size, launch_environment_or_single().size);
  line = rank_prefix(size > 1) + line + "\n";
  std::fputs(line.c_str(), stderr);  // one write: lines of ranks failing together stay whole
  std::fflush(stderr);
  if (size > 1) {
    // The launcher ends every rank once one fails: let ranks refusing the same input (they
    // check it in step) print theirs first.
    std::this_thread::sleep_for(std::chrono::seconds(2));
  }
  if (g_failed_world_size > 1) {
    if (g_failed_mpi) dist::detail::abort_backend(1);  // MPI_Abort: mpirun ends every rank
    dist::detail::forget_rendezvous();  // Gloo: its file would outlive the job
    std::_Exit(1);  // Gloo: the peers see the connection close
  }
  return 1;
}

namespace {
constexpr const char* kHugePages = "glibc.malloc.hugetlb";
}  // namespace

bool malloc_on_huge_pages() {
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  return tunables != nullptr &&
         std::string(tunables).find(std::string(kHugePages) + "=1") != std::string::npos;
}

bool huge_pages_wanted() {
  const char* off = std::getenv("FIVEFOLD_HUGE_PAGES");
  if (off != nullptr && std::string(off) == "0") return false;
  int major = 0, minor = 0;
  return std::sscanf(gnu_get_libc_version(), "%d.%d", &major, &minor) == 2 &&
         major * 1000 + minor >= 2035;
}

void restart_with_huge_pages(char** argv) {
  if (!huge_pages_wanted()) return;
  const char* tunables = std::getenv("GLIBC_TUNABLES");
  const std::string before = tunables != nullptr ? tunables : "";
  if (before.find(kHugePages) != std::string::npos) return;  // restarted, or the user's choice
  const std::string wanted = (before.empty() ? "" : before + ":") + kHugePages + "=1";
  if (::setenv("GLIBC_TUNABLES", wanted.c_str(), 1) != 0) return;
  ::execv("/proc/self/exe", argv);  // returns only when it failed: go on as started
  if (tunables != nullptr) {
    ::setenv("GLIBC_TUNABLES", before.c_str(), 1);
  } else {
    ::unsetenv("GLIBC_TUNABLES");
  }
}

}  // namespace fivefold
