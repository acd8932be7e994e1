// Chapter 09's benchmark: tokens/s of chapter 03's model trained with data parallelism, per
// variant (naive all-reduce per parameter, DDP buckets after backward, DDP overlapped, ZeRO-1,
// ZeRO-2, ZeRO-3 / FSDP), the bytes of state each rank keeps between steps, the peak bytes it
// allocates during a step (activations included), and how much of the all-reduce time the
// overlap hides behind backward.
//
//   build/bin/bench_ddp_throughput                       (one process: the reference)
//   mpirun -np 2 -x OMP_WAIT_POLICY=passive build/bin/bench_ddp_throughput
//   benchmarks/run_ddp_throughput.sh build               (both, on the same model and batch)
//
// The global batch is the same whatever the ranks (each takes its rows); step times are medians
// of --steps steps after 3 warm-up steps, the slowest rank's.

#include <algorithm>
#include <cstdio>
#include <vector>

#include "03_transformer/train.h"
#include "09_data_parallel/ddp.h"
#include "09_data_parallel/fsdp.h"
#include "09_data_parallel/zero.h"
#include "bench_model.h"
#include "fivefold/cli.h"
#include "fivefold/memory.h"
#include "fivefold/runtime.h"
#include "fivefold/timer.h"

using namespace fivefold;
using namespace fivefold::ch03;

namespace {
enum class Variant { Naive, AfterBackward, Overlapped, Zero1, Zero2, Zero3 };

struct Result {
  double step_seconds;  // median, slowest rank
  double wait_seconds;  // median time finish_gradient_sync waited (DDP variants)
  int64_t state_bytes;  // weights + gradients + optimizer state kept by this rank
  int64_t peak_bytes;   // most bytes this rank's variant had allocated at once
};

Result measure(const dist::CommunicatorPtr& world, const ModelConfig& config, Variant variant,
               int64_t batch, int64_t seq, int64_t steps, int64_t bucket_bytes) {
  const TokenDataset data(ByteTokenizer::encode(synthetic_corpus(0, Split::Train, 3000)));
  const BatchSampler sampler(data, seq, batch, 0);
  MemoryTracker tracker;  // everything below: model, gradients, optimizer state, activations
  Transformer model(config);
  TrainConfig t;
  std::unique_ptr<torch::optim::AdamW> optimizer;
  if (variant != Variant::Zero3) optimizer = make_optimizer(model, t);
  std::unique_ptr<ch09::DistributedDataParallel> ddp;
  const bool parallel = world->size() > 1;
  if (parallel && variant != Variant::Naive) {
    ch09::DdpOptions options;
    options.bucket_bytes = bucket_bytes;
    options.overlap = variant == Variant::Overlapped;
    ddp = std::make_unique<ch09::DistributedDataParallel>(model.ptr(), world, options);
  }
  std::unique_ptr<ch09::ZeroOptimizer> zero;
  if (variant == Variant::Zero1 || variant == Variant::Zero2)
    zero = std::make_unique<ch09::ZeroOptimizer>(model.ptr(), world,
                                                 variant == Variant::Zero1 ? 1 : 2, t);
  std::unique_ptr<ch09::FullyShardedDataParallel> fsdp;
  if (variant == Variant::Zero3)
    fsdp = std::make_unique<ch09::FullyShardedDataParallel>(model, world, t);
  std::vector<double> times, waits;
  for (int64_t step = 0; step < steps + 3; ++step) {
    world->barrier();
    Timer timer;
    if (fsdp) {
      fsdp->zero_grad();
      const auto b = sampler.batch(step, world->rank(), world->size());
      auto logits = fsdp->forward(b.inputs);
      torch::cross_entropy_loss(logits.view({-1, logits.size(-1)}), b.targets.reshape({-1}))
          .backward();
      fsdp->step(step);
    } else if (zero) {
      zero->zero_grad();
      loss_of(model, sampler.batch(step, world->rank(), world->size())).backward();
      zero->step(step);
    } else {
      optimizer->zero_grad();
      loss_of(model, sampler.batch(step, world->rank(), world->size())).backward();
      if (ddp) ddp->finish_gradient_sync();
      if (parallel && variant == Variant::Naive) ch09::all_reduce_gradients(*world, *model);
      clip_gradients(model, t.grad_clip);
      optimizer->step();
    }
    auto seconds = torch::tensor({timer.seconds()}, torch::kDouble);
    world->all_reduce(seconds, dist::ReduceOp::Max);
    if (step >= 3) {
      times.push_back(seconds.item<double>());
      waits.push_back(ddp ? ddp->stats().wait_seconds : 0.0);
    }
  }
  int64_t bytes = 0;
  if (zero || fsdp) {
    const auto m = zero ? zero->memory() : fsdp->memory();
    bytes = m.parameters + m.gradients + m.optimizer;
  } else {  // weights, gradients, and AdamW's two moments for every parameter
    for (const auto& p : model->parameters()) bytes += 4 * p.numel() * 4;
  }
  return {median(times), median(waits), bytes, tracker.peak_bytes()};
}
}  // namespace

namespace {
int run(int argc, char** argv) {
  ArgParser args("bench_ddp_throughput",
                 "Tokens/s of data-parallel training per variant, and the all-reduce time DDP's "
                 "overlap hides.");
  args.option("steps", "10", "timed steps per variant");
  args.option("d-model", "256", "hidden size").option("n-layers", "4", "blocks");
  args.option("seq", "128", "tokens per row").option("batch", "8", "global batch (rows)");
  args.option("bucket-kib", "1024", "DDP bucket size in KiB");
  if (!args.parse(argc, argv)) return 0;
  Runtime runtime;
  auto world = runtime.world();
  auto config = bench::bench_model(args.integer("d-model"), args.integer("n-layers"));
  const int64_t batch = args.integer("batch"), seq = args.integer("seq");
  const double tokens = static_cast<double>(batch * seq);
  if (world->rank() == 0) {
    std::printf("%d rank(s) x %d thread(s); d_model %lld, %lld layers, global batch %lld x %lld\n",
                world->size(), torch::get_num_threads(), static_cast<long long>(config.d_model),
                static_cast<long long>(config.n_layers), static_cast<long long>(batch),
                static_cast<long long>(seq));
  }
  const char* names[] = {"naive (one all-reduce per parameter)",
                         "DDP, buckets after backward",
                         "DDP, buckets overlapped with backward",
                         "ZeRO-1",
                         "ZeRO-2",
                         "ZeRO-3 / FSDP"};
  double wait_after = 0;
  for (auto variant : {Variant::Naive, Variant::AfterBackward, Variant::Overlapped, Variant::Zero1,
                       Variant::Zero2, Variant::Zero3}) {
    const auto r = measure(world, config, variant, batch, seq, args.integer("steps"),
                           args.integer("bucket-kib") << 10);
    if (variant == Variant::AfterBackward) wait_after = r.wait_seconds;
    if (world->rank() != 0) continue;
    std::printf(
        "%-40s step %8.2f ms  %9.0f tokens/s  state %6.2f MB/rank  peak %6.2f MB/rank",
        world->size() == 1 ? "one process (no communication)" : names[static_cast<int>(variant)],
        r.step_seconds * 1e3, tokens / r.step_seconds, static_cast<double>(r.state_bytes) / 1e6,
        static_cast<double>(r.peak_bytes) / 1e6);
    if (world->size() > 1 && (variant == Variant::AfterBackward || variant == Variant::Overlapped))
      std::printf("  waiting for all-reduce %6.2f ms", r.wait_seconds * 1e3);
    if (world->size() > 1 && variant == Variant::Overlapped && wait_after > 0)
      std::printf("  (%.0f%% hidden)", 100.0 * (1.0 - r.wait_seconds / wait_after));
    std::printf("\n");
    if (world->size() == 1) break;  // one process: the variants are the same computation
  }
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  return fivefold::run_guarded("bench_ddp_throughput", [&] { return run(argc, argv); });
}
