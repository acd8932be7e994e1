// Chapter 12's benchmark: one training step of chapter 03's model on a sequence long enough that
// attention dominates, with context parallelism over every rank (cp = the world size, dp 1):
// step time, the peak memory a step adds on each rank (activations and their gradients), and how
// much of the ring's key/value traffic the overlap hides.
//
//   OMP_NUM_THREADS=2 build/bin/bench_cp_throughput        (one process: the reference)
//   mpirun -np 2 -x OMP_NUM_THREADS=1 -x OMP_WAIT_POLICY=passive build/bin/bench_cp_throughput
//   benchmarks/run_cp_throughput.sh build                  (cp 1, 2 and 4 on the same batch)
//
// The hidden share: the ring runs once with every transfer waited for as soon as it is posted
// (the same arithmetic and bytes, nothing hidden) and once overlapped; the time the compute thread
// spent blocked in the ring's send_recv (Work::wait) is measured in both, and
// hidden = 1 - blocked(overlapped) / blocked(not overlapped).
//
// Step times are medians of --steps steps after 2 warm-up steps, the slowest rank's; memory is the
// largest over the ranks of MemoryTracker's peak during a step above what was allocated before it.

#include <algorithm>
#include <cstdio>
#include <vector>

#include "03_transformer/train.h"
#include "07_moe/moe.h"
#include "09_data_parallel/step.h"
#include "12_context_parallel/context_parallel.h"
#include "bench_model.h"
#include "fivefold/cli.h"
#include "fivefold/comm_stats.h"
#include "fivefold/error.h"
#include "fivefold/memory.h"
#include "fivefold/runtime.h"
#include "fivefold/timer.h"

using namespace fivefold;
using namespace fivefold::ch03;

namespace {

struct Result {
  double step_seconds;     // median, slowest rank
  double peak_bytes;       // largest over the ranks
  double blocked_seconds;  // in the ring's send_recv, per step, slowest rank
};

enum class Variant { Chapter03, Overlapped, Waited, AllGather };

Result measure(const dist::CommunicatorPtr& world, const ModelConfig& config, Variant variant,
               const Batch& batch, int64_t steps) {
  TrainConfig t;
  auto model = ch07::make_model(config);
  std::unique_ptr<TrainingStep> step;
  if (variant == Variant::Chapter03) {  // one process, the T x T scores materialised
    step = std::make_unique<SingleProcessStep>(model, t);
  } else {
    ch12::ContextParallel group{
        world, ch12::CpLayout::Zigzag,
        variant == Variant::AllGather ? ch12::CpAttention::AllGather : ch12::CpAttention::Ring,
        variant != Variant::Waited};
    step = ch12::context_parallel_step(ch09::data_parallel_step(world, 0), group)(model, t);
  }
  std::vector<double> times;
  double peak = 0;
  for (int64_t s = 0; s < steps + 2; ++s) {
    world->barrier();
    if (s == 2) dist::reset_comm_stats();
    MemoryTracker tracker;
    Timer timer;
    step->step({batch}, s);
    auto seconds = torch::tensor({timer.seconds()}, torch::kDouble);
    world->all_reduce(seconds, dist::ReduceOp::Max);  // the slowest rank's step
    if (s >= 2) times.push_back(seconds.item<double>());
    peak = std::max(peak, static_cast<double>(tracker.peak_bytes()));
  }
  const double blocked = dist::comm_counts(world->name(), dist::Op::SendRecv).blocked_seconds /
                         static_cast<double>(steps);
  auto figures = torch::tensor({peak, blocked}, torch::kDouble);
  world->all_reduce(figures, dist::ReduceOp::Max);
  return {median(times), figures[0].item<double>(), figures[1].item<double>()};
}

int run(int argc, char** argv) {
  ArgParser args("bench_cp_throughput",
                 "Step time, peak step memory per rank and the ring's hidden traffic of "
                 "context-parallel training (cp = the world size, zig-zag) on a long sequence.");
  args.option("steps", "5", "timed steps per variant");
  args.option("d-model", "128", "hidden size").option("n-layers", "2", "blocks");
  args.option("seq", "2048", "tokens per row (a multiple of 2 x the world size)");
  args.option("batch", "1", "batch (rows)");
  if (!args.parse(argc, argv)) return 0;
  FIVEFOLD_CHECK(args.integer("steps") >= 1, "--steps must be at least 1");
  FIVEFOLD_CHECK(args.integer("batch") >= 1, "--batch must be at least 1");
  FIVEFOLD_CHECK(args.integer("d-model") >= 64 && args.integer("d-model") % 64 == 0,
                 "--d-model must be a positive multiple of 64 (heads of 64)");
  Runtime runtime;
  auto world = runtime.world();
  auto config = bench::bench_model(args.integer("d-model"), args.integer("n-layers"));
  config.max_position_embeddings = std::max<int64_t>(2048, args.integer("seq"));
  config.rope_theta = 10000;
  config.validate();
  const int64_t seq = args.integer("seq"), rows = args.integer("batch");
  ch12::check_context_parallel(config, seq, world->size(), ch12::CpLayout::Zigzag);
  const TokenDataset data(ByteTokenizer::encode(synthetic_corpus(0, Split::Train, 3000)));
  FIVEFOLD_CHECK(data.size() > seq + 1, "--seq ", seq, " is longer than the corpus (", data.size(),
                 " tokens)");
  const auto batch = BatchSampler(data, seq, rows, 0).batch(0);
  if (world->rank() == 0) {
    std::printf("cp %d (zig-zag) x %d thread(s); d_model %lld, %lld layers, batch %lld x %lld\n",
                world->size(), torch::get_num_threads(), static_cast<long long>(config.d_model),
                static_cast<long long>(config.n_layers), static_cast<long long>(rows),
                static_cast<long long>(seq));
  }
  std::vector<std::pair<Variant, const char*>> variants;
  if (world->size() == 1) {
    variants = {{Variant::Chapter03, "chapter 03 attention (T x T scores)"},
                {Variant::Overlapped, "blockwise (the ring over one rank)"}};
  } else {
    variants = {{Variant::Overlapped, "ring, overlapped"},
                {Variant::Waited, "ring, each transfer waited for"},
                {Variant::AllGather, "all-gather KV"}};
  }
  std::vector<Result> results;
  for (const auto& [variant, name] : variants) {
    results.push_back(measure(world, config, variant, batch, args.integer("steps")));
    const auto& r = results.back();
    if (world->rank() == 0) {
      std::printf("%-38s step %9.1f ms  peak %7.1f MiB/rank  ring waits %7.1f ms/step\n", name,
                  r.step_seconds * 1e3, r.peak_bytes / (1 << 20), r.blocked_seconds * 1e3);
    }
  }
  if (world->size() > 1 && world->rank() == 0) {
    const double on = results[0].blocked_seconds, off = results[1].blocked_seconds;
    std::printf(
        "ring traffic hidden behind compute: %.0f%% (waits %.1f ms/step overlapped, "
        "%.1f ms/step not)\n",
        off > 0 ? 100.0 * (1.0 - on / off) : 0.0, on * 1e3, off * 1e3);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fivefold::run_guarded("bench_cp_throughput", [&] { return run(argc, argv); });
}
