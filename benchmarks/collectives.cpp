// Chapter 08's benchmark: the ring collectives built from send/recv against the backend's own,
// over message sizes, with nccl-tests' algorithm and bus bandwidth columns.
//
//   mpirun -np 4 -x OMP_WAIT_POLICY=passive build/bin/bench_collectives [--sizes ...] [--iters 20]
//   benchmarks/run_collectives.sh build      (2, 4, 8 ranks; MPI and Gloo)
//
// Each figure is the median over 3 rounds of the mean time of --iters operations, the slowest
// rank's; ring and library alternate round by round so that both see the same machine load.

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "08_collectives/ring.h"
#include "fivefold/cli.h"
#include "fivefold/runtime.h"
#include "fivefold/timer.h"

using fivefold::dist::Communicator;

namespace {

double mean_seconds(Communicator& world, int iters, const std::function<void()>& op) {
  op();  // warm-up
  world.barrier();
  fivefold::Timer timer;
  for (int i = 0; i < iters; ++i) op();
  auto seconds = torch::tensor({timer.seconds() / iters}, torch::kDouble);
  world.all_reduce(seconds, fivefold::dist::ReduceOp::Max);
  return seconds.item<double>();
}

// Medians of 3 alternating rounds of a and b.
std::pair<double, double> compare(Communicator& world, int iters, const std::function<void()>& a,
                                  const std::function<void()>& b) {
  std::vector<double> ta, tb;
  for (int round = 0; round < 3; ++round) {
    ta.push_back(mean_seconds(world, iters, a));
    tb.push_back(mean_seconds(world, iters, b));
  }
  std::sort(ta.begin(), ta.end());
  std::sort(tb.begin(), tb.end());
  return {ta[1], tb[1]};
}

std::string size_text(int64_t bytes) {
  char text[32];
  if (bytes >= (1 << 20))
    std::snprintf(text, sizeof(text), "%lld MiB", static_cast<long long>(bytes >> 20));
  else if (bytes >= 1024)
    std::snprintf(text, sizeof(text), "%lld KiB", static_cast<long long>(bytes >> 10));
  else
    std::snprintf(text, sizeof(text), "%lld B", static_cast<long long>(bytes));
  return text;
}

}  // namespace

namespace {
int run(int argc, char** argv) {
  fivefold::ArgParser args("bench_collectives",
                           "Ring collectives from send/recv vs the backend's, with algorithm and "
                           "bus bandwidth.");
  args.option("sizes", "1024,65536,1048576,8388608", "message sizes in bytes (multiples of 4)");
  args.option("iters", "10", "operations per timing");
  args.flag("header", "print the table header");
  if (!args.parse(argc, argv)) return 0;
  fivefold::Runtime runtime;
  auto world = runtime.world();
  const int n = world->size();
  if (args.on("header") && world->rank() == 0) {
    std::printf("%-6s %-5s %-15s %9s %12s %12s %11s %11s %8s\n", "ranks", "backend", "op", "size",
                "ring", "library", "ring busbw", "lib busbw", "ring/lib");
  }
  for (int64_t bytes : args.integers("sizes")) {
    const int64_t floats = bytes / 4;
    auto x = torch::ones({floats});
    const auto sizes = fivefold::ch08::chunk_sizes(floats, n);
    auto mine = torch::ones({sizes[world->rank()]});
    struct Case {
      const char* op;
      bool all_reduce;
      std::function<void()> ring, library;
    };
    const std::vector<Case> cases = {
        {"all-reduce", true, [&] { fivefold::ch08::ring_all_reduce(*world, x); },
         [&] {
           auto y = x.clone();
           world->all_reduce(y);
         }},
        {"reduce-scatter", false, [&] { fivefold::ch08::ring_reduce_scatter(*world, x); },
         [&] { world->reduce_scatter(x); }},
        {"all-gather", false, [&] { fivefold::ch08::ring_all_gather(*world, mine, sizes); },
         [&] { world->all_gather(mine, sizes); }}};
    for (const Case& c : cases) {
      const auto [ring, library] =
          compare(*world, static_cast<int>(args.integer("iters")), c.ring, c.library);
      if (world->rank() != 0) continue;
      // nccl-tests: algbw = S / t; busbw = algbw x 2(N-1)/N (all-reduce) or (N-1)/N.
      const double s = static_cast<double>(bytes);
      std::printf("%-6d %-5s %-15s %9s %9.1f us %9.1f us %6.2f GB/s %6.2f GB/s %8.2f\n", n,
                  backend_name(world->backend()), c.op, size_text(bytes).c_str(), ring * 1e6,
                  library * 1e6, fivefold::ch08::bus_bandwidth(s / ring, n, c.all_reduce) / 1e9,
                  fivefold::ch08::bus_bandwidth(s / library, n, c.all_reduce) / 1e9,
                  ring / library);
    }
  }
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  return fivefold::run_guarded("bench_collectives", [&] { return run(argc, argv); });
}
