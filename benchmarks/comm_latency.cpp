// Latency and bandwidth of the Communicator: all-reduce over all ranks and a send/recv ping-pong
// between ranks 0 and 1, for several message sizes, on whichever backend the job runs
// (FIVEFOLD_BACKEND=mpi|gloo). Under MPI it also times the raw MPI calls on the same buffers, so
// the table shows what the interface (queue, checks, statistics) costs on top of MPI.
//
//   mpirun -np 4 -x OMP_WAIT_POLICY=passive build/bench_comm_latency [--sizes 1024,262144] [--iters
//   50] benchmarks/run_comm_latency.sh build   (2/4/8/16 ranks, both backends)
//
// Each figure is the median over --rounds rounds of the mean time of --iters operations (the
// slowest rank's). The interface and the raw MPI calls alternate round by round, so that both see
// the same machine load: the overhead column is a ratio measured in one window, not across runs.

#include <mpi.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "fivefold/cli.h"
#include "fivefold/error.h"
#include "fivefold/runtime.h"
#include "fivefold/timer.h"

using fivefold::dist::Communicator;

namespace {

// Mean seconds per call of `op` over `iters` calls, the slowest rank's.
double time_op(Communicator& world, int warmup, int iters, const std::function<void()>& op) {
  for (int i = 0; i < warmup; ++i) op();
  world.barrier();
  fivefold::Timer timer;
  for (int i = 0; i < iters; ++i) op();
  auto seconds = torch::tensor({timer.seconds() / iters}, torch::kDouble);
  world.all_reduce(seconds, fivefold::dist::ReduceOp::Max);
  return seconds.item<double>();
}

// Median over `rounds` of time_op(a) and time_op(b), alternating a and b (b may be empty).
std::pair<double, double> interleaved(Communicator& world, int warmup, int iters, int rounds,
                                      const std::function<void()>& a,
                                      const std::function<void()>& b) {
  std::vector<double> ta, tb;
  for (int r = 0; r < rounds; ++r) {
    ta.push_back(time_op(world, r == 0 ? warmup : 0, iters, a));
    if (b) tb.push_back(time_op(world, r == 0 ? warmup : 0, iters, b));
  }
  return {fivefold::median(ta), tb.empty() ? 0.0 : fivefold::median(tb)};
}

}  // namespace

namespace {
int run(int argc, char** argv) {
  fivefold::ArgParser args(
      "bench_comm_latency",
      "All-reduce and send/recv latency and bandwidth through the Communicator.");
  args.option("sizes", "1,1024,65536,262144,1048576", "message sizes in float32 elements");
  args.option("iters", "20", "timed operations per round").option("rounds", "5", "rounds (median)");
  args.option("warmup", "5", "untimed operations first");
  args.flag("header", "print the table header");
  if (!args.parse(argc, argv)) return 0;
  fivefold::Runtime runtime(fivefold::RuntimeOptions{"", 1, true});
  auto world = runtime.world();
  const int n = world->size();
  const int base_iters = static_cast<int>(args.integer("iters"));
  const int warmup = static_cast<int>(args.integer("warmup"));
  const int rounds = static_cast<int>(args.integer("rounds"));
  FIVEFOLD_CHECK(base_iters >= 1 && warmup >= 0 && rounds >= 1,
                 "--iters and --rounds must be >= 1, --warmup >= 0");
  const bool mpi = world->backend() == fivefold::dist::Backend::Mpi;
  if (world->rank() == 0 && args.on("header")) {
    std::printf("%-7s %5s %-11s %10s %12s %10s %10s %12s %9s\n", "backend", "ranks", "op", "bytes",
                "latency_us", "algbw_GB/s", "busbw_GB/s", "raw_mpi_us", "overhead");
  }
  for (int64_t elements : args.integers("sizes")) {
    FIVEFOLD_CHECK(elements >= 1, "--sizes must be positive");
    const double bytes = 4.0 * elements;
    // Operations on small messages take microseconds: 50x more of them for a stable mean.
    const int iters = bytes <= 65536 ? 50 * base_iters : base_iters;
    auto buffer = torch::ones({elements});

    // All-reduce. busbw = algbw · 2(n-1)/n (nccl-tests' convention).
    const double t = time_op(*world, warmup, iters, [&] { world->all_reduce(buffer); });
    double raw = 0;
    if (mpi) {
      raw = time_op(*world, warmup, iters, [&] {
        MPI_Allreduce(MPI_IN_PLACE, buffer.data_ptr(), static_cast<int>(elements), MPI_FLOAT,
                      MPI_SUM, MPI_COMM_WORLD);
      });
    }
    if (world->rank() == 0) {
      const double algbw = bytes / t / 1e9;
      std::printf("%-7s %5d %-11s %10.0f %12.2f %10.3f %10.3f", mpi ? "mpi" : "gloo", n,
                  "all_reduce", bytes, t * 1e6, algbw, algbw * 2.0 * (n - 1) / n);
      if (mpi)
        std::printf(" %12.2f %8.1f%%\n", raw * 1e6, 100.0 * (t - raw) / raw);
      else
        std::printf(" %12s %9s\n", "-", "-");
    }

    // Ping-pong between ranks 0 and 1: latency = half the round trip.
    if (n >= 2) {
      auto incoming = torch::empty({elements});
      auto ping = [&] {
        if (world->rank() == 0) {
          world->send(buffer, 1);
          world->recv(incoming, 1);
        } else if (world->rank() == 1) {
          world->recv(incoming, 0);
          world->send(buffer, 0);
        }
      };
      std::function<void()> raw_ping;
      if (mpi) {
        raw_ping = [&] {
          const int r = world->rank();
          const int count = static_cast<int>(elements);
          if (r == 0) {
            MPI_Send(buffer.data_ptr(), count, MPI_FLOAT, 1, 0, MPI_COMM_WORLD);
            MPI_Recv(incoming.data_ptr(), count, MPI_FLOAT, 1, 0, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
          } else if (r == 1) {
            MPI_Recv(incoming.data_ptr(), count, MPI_FLOAT, 0, 0, MPI_COMM_WORLD,
                     MPI_STATUS_IGNORE);
            MPI_Send(buffer.data_ptr(), count, MPI_FLOAT, 0, 0, MPI_COMM_WORLD);
          }
        };
      }
      const auto [round, raw_round] = interleaved(*world, warmup, iters, rounds, ping, raw_ping);
      if (world->rank() == 0) {
        const double one_way = round / 2;
        std::printf("%-7s %5d %-11s %10.0f %12.2f %10.3f %10s", mpi ? "mpi" : "gloo", n,
                    "send_recv", bytes, one_way * 1e6, bytes / one_way / 1e9, "-");
        if (mpi)
          std::printf(" %12.2f %8.1f%%\n", raw_round / 2 * 1e6,
                      100.0 * (round - raw_round) / raw_round);
        else
          std::printf(" %12s %9s\n", "-", "-");
      }
    }
  }
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  return fivefold::run_guarded("bench_comm_latency", [&] { return run(argc, argv); });
}
