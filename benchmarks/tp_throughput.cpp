// Chapter 10's benchmark: tokens/s of chapter 03's model trained with tensor parallelism over every
// rank (tp = the world size, dp 1), with and without sequence parallelism, against one process;
// and the share of each step the compute thread spent blocked in tensor-parallel communication
// (the communicator's measured blocked_seconds over the step time).
//
//   OMP_NUM_THREADS=2 build/bin/bench_tp_throughput        (one process: the reference)
//   mpirun -np 2 -x OMP_NUM_THREADS=1 -x OMP_WAIT_POLICY=passive build/bin/bench_tp_throughput
//   benchmarks/run_tp_throughput.sh build                  (both, on the same model and batch)
//
// Step times are medians of --steps steps after 2 warm-up steps, the slowest rank's.

#include <algorithm>
#include <cstdio>
#include <vector>

#include "03_transformer/train.h"
#include "07_moe/moe.h"
#include "10_tensor_parallel/step.h"
#include "bench_model.h"
#include "fivefold/cli.h"
#include "fivefold/comm_stats.h"
#include "fivefold/error.h"
#include "fivefold/runtime.h"
#include "fivefold/timer.h"

using namespace fivefold;
using namespace fivefold::ch03;

namespace {

struct Result {
  double step_seconds;     // median, slowest rank
  double blocked_seconds;  // per step, mean over the timed steps, this rank
};

Result measure(const dist::CommunicatorPtr& world, const ModelConfig& config, bool parallel,
               bool sp, int64_t batch, int64_t seq, int64_t steps) {
  const TokenDataset data(ByteTokenizer::encode(synthetic_corpus(0, Split::Train, 3000)));
  const BatchSampler sampler(data, seq, batch, 0);
  TrainConfig t;
  std::unique_ptr<TrainingStep> step;
  if (!parallel) {
    step = std::make_unique<SingleProcessStep>(ch07::make_model(config), t);
  } else {
    auto tp = std::make_shared<ch10::TensorParallel>(ch10::TensorParallel{world, sp});
    auto dp = world->split(world->rank(), 0, "dp");  // every rank alone: dp 1
    step = ch10::tensor_parallel_step(tp, dp, 0, ch07::make_model)(ch07::make_model(config), t);
  }
  std::vector<double> times;
  double blocked = 0;
  for (int64_t s = 0; s < steps + 2; ++s) {
    world->barrier();
    if (s == 2) dist::reset_comm_stats();
    Timer timer;
    step->step({sampler.batch(s)}, s);
    auto seconds = torch::tensor({timer.seconds()}, torch::kDouble);
    world->all_reduce(seconds, dist::ReduceOp::Max);  // the slowest rank's step
    if (s >= 2) times.push_back(seconds.item<double>());
  }
  const auto stats = dist::comm_stats();  // a copy: iterate over something that lives
  const auto mine = stats.find(world->name());
  for (const auto& [op, counts] :
       mine == stats.end() ? dist::CommStats::mapped_type{} : mine->second) {
    if (op != dist::Op::Barrier) blocked += counts.blocked_seconds;
  }
  // The barrier and the timing all-reduce happen outside the timed step; the all-reduce is still
  // counted (one number a step: microseconds).
  return {median(times), blocked / static_cast<double>(steps)};
}

int run(int argc, char** argv) {
  ArgParser args("bench_tp_throughput",
                 "Tokens/s of tensor-parallel training (tp = the world size) with and without "
                 "sequence parallelism, and the share of the step spent communicating.");
  args.option("steps", "10", "timed steps per variant");
  args.option("d-model", "256", "hidden size").option("n-layers", "4", "blocks");
  args.option("seq", "128", "tokens per row").option("batch", "8", "batch (rows)");
  if (!args.parse(argc, argv)) return 0;
  FIVEFOLD_CHECK(args.integer("steps") >= 1, "--steps must be at least 1");
  Runtime runtime;
  auto world = runtime.world();
  auto config = bench::bench_model(args.integer("d-model"), args.integer("n-layers"));
  config.rope_theta = 10000;
  ch10::check_tensor_parallel(config, world->size());
  const int64_t batch = args.integer("batch"), seq = args.integer("seq");
  const double tokens = static_cast<double>(batch * seq);
  if (world->rank() == 0) {
    std::printf("%d rank(s) x %d thread(s); d_model %lld, %lld layers, batch %lld x %lld\n",
                world->size(), torch::get_num_threads(), static_cast<long long>(config.d_model),
                static_cast<long long>(config.n_layers), static_cast<long long>(batch),
                static_cast<long long>(seq));
  }
  const bool parallel = world->size() > 1;
  for (bool sp : {false, true}) {
    const auto r = measure(world, config, parallel, sp, batch, seq, args.integer("steps"));
    if (world->rank() == 0) {
      const char* name = !parallel ? "one process (no communication)"
                         : sp      ? "tensor parallel, sequence parallel"
                                   : "tensor parallel";
      std::printf("%-36s step %8.2f ms  %9.0f tokens/s  communicating %5.1f%% of the step\n", name,
                  r.step_seconds * 1e3, tokens / r.step_seconds,
                  100.0 * r.blocked_seconds / r.step_seconds);
    }
    if (!parallel) break;  // one process: sequence parallelism does not apply
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return fivefold::run_guarded("bench_tp_throughput", [&] { return run(argc, argv); });
}
