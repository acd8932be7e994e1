// Chapter 09: data parallelism reproduces single-device training. Every rank also computes the
// single-device run on the whole global batch (same initial weights), so each rank can compare its
// data-parallel parameters with it after K optimizer steps. Real processes: 1, 2 and 4 ranks on
// MPI, 2 on Gloo.

#include "03_transformer/train.h"
#include "09_data_parallel/ddp.h"
#include "fivefold/comm_stats.h"
#include "fivefold/seed.h"
#include "fixtures.h"
#include "testing.h"

using namespace fivefold::ch03;
using namespace fivefold::ch09;
using fivefold::ch09::testing::global_batches;
using fivefold::ch09::testing::small_config;
using fivefold::testing::world;
namespace dist = fivefold::dist;

namespace {
enum class Variant { Naive, Overlapped, AfterBackward };

// K steps of AdamW on the global batch of 8 rows x 16 tokens; `micro` micro-batches per step on
// each rank (gradient accumulation). world == nullptr: the single-device reference.
Transformer run(const ModelConfig& config, dist::CommunicatorPtr comm, Variant variant, int micro,
                int steps, DdpStats* stats = nullptr) {
  auto model = Transformer(config);
  TrainConfig t;
  t.warmup_steps = 1;
  t.total_steps = 10;
  auto optimizer = make_optimizer(model, t);
  const BatchSampler& sampler = global_batches();
  const int rank = comm ? comm->rank() : 0, size = comm ? comm->size() : 1;
  std::unique_ptr<DistributedDataParallel> ddp;
  if (comm && variant != Variant::Naive) {
    DdpOptions options;
    options.bucket_bytes = 16 << 10;  // several buckets even for this small model
    options.overlap = variant == Variant::Overlapped;
    ddp = std::make_unique<DistributedDataParallel>(model.ptr(), comm, options);
  }
  for (int step = 0; step < steps; ++step) {
    optimizer->zero_grad();
    const Batch local = sampler.batch(step, rank, size);
    const auto inputs = local.inputs.chunk(micro), targets = local.targets.chunk(micro);
    for (int m = 0; m < micro; ++m) {
      auto loss = loss_of(model, {inputs[m], targets[m]}) / static_cast<double>(micro);
      if (ddp && m + 1 < micro) {
        auto guard = ddp->no_sync();  // accumulate locally; sync on the last micro-batch only
        loss.backward();
      } else {
        loss.backward();
      }
    }
    if (comm && variant == Variant::Naive) all_reduce_gradients(*comm, *model);
    if (ddp) ddp->finish_gradient_sync();
    clip_gradients(model, t.grad_clip);
    for (auto& group : optimizer->param_groups())
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(learning_rate(t, step));
    optimizer->step();
  }
  if (stats && ddp) *stats = ddp->stats();
  return model;
}

void expect_same_parameters(Transformer& a, Transformer& b) {
  auto pa = a->named_parameters(), pb = b->named_parameters();
  for (const auto& item : pa) {
    SCOPED_TRACE(item.key());
    // fp32: averaging per-rank means instead of one mean changes the last bits of the gradients,
    // and Adam's g / (sqrt(v) + eps) magnifies them where a gradient is near zero (rare tokens'
    // rows of a tied embedding): 1.6e-6 observed after 3 steps, so 1e-5.
    EXPECT_TENSOR_CLOSE(item.value(), pb[item.key()], 1e-5, 1e-5);
  }
}
}  // namespace

TEST(DataParallel, EveryVariantMatchesOneDeviceAfterThreeSteps) {
  for (bool tied : {false, true}) {
    const auto config = small_config(tied);
    auto reference = run(config, nullptr, Variant::Naive, 1, 3);
    for (auto variant : {Variant::Naive, Variant::Overlapped, Variant::AfterBackward}) {
      SCOPED_TRACE("variant " + std::to_string(static_cast<int>(variant)) + (tied ? " tied" : ""));
      auto parallel = run(config, world(), variant, 1, 3);
      expect_same_parameters(parallel, reference);
    }
  }
}

TEST(DataParallel, AveragedGradientsEqualTheWholeBatchGradient) {
  const auto config = small_config(true);
  const BatchSampler& sampler = global_batches();
  auto reference = Transformer(config);
  loss_of(reference, sampler.batch(0)).backward();
  auto model = Transformer(config);
  DdpOptions options;
  options.bucket_bytes = 16 << 10;
  DistributedDataParallel ddp(model.ptr(), world(), options);
  loss_of(model, sampler.batch(0, world()->rank(), world()->size())).backward();
  ddp.finish_gradient_sync();
  auto expected = reference->named_parameters();
  for (const auto& item : model->named_parameters()) {
    SCOPED_TRACE(item.key());
    EXPECT_TENSOR_CLOSE(item.value().grad(), expected[item.key()].grad(), 1e-7, 1e-5);
  }
}

TEST(DataParallel, NoSyncAccumulationMatchesOneDevice) {
  const auto config = small_config(false);
  auto reference = run(config, nullptr, Variant::Naive, 1, 3);
  if (8 / world()->size() < 2) GTEST_SKIP() << "needs 2 rows per rank";
  auto parallel = run(config, world(), Variant::Overlapped, 2, 3);
  expect_same_parameters(parallel, reference);
}

TEST(DataParallel, BucketsOverlapBackwardAndSendEachGradientOnce) {
  const auto config = small_config(false);
  DdpStats overlapped, after;
  dist::reset_comm_stats();
  run(config, world(), Variant::Overlapped, 1, 1, &overlapped);
  const auto counts = dist::comm_counts(world()->name(), dist::Op::AllReduce);
  run(config, world(), Variant::AfterBackward, 1, 1, &after);
  Transformer model(config);
  int64_t elements = 0, params = 0;
  for (const auto& p : model->parameters()) {
    elements += p.numel();
    ++params;
  }
  // One all-reduce per bucket, carrying each gradient once plus one flag per parameter.
  EXPECT_EQ(counts.calls, overlapped.buckets);
  EXPECT_EQ(counts.payload_bytes, 4 * (elements + params));
  EXPECT_GT(overlapped.buckets, 3);
  // With overlap, every bucket starts while backward is still running; without, none does.
  EXPECT_EQ(overlapped.launched_in_backward, overlapped.buckets);
  EXPECT_EQ(after.launched_in_backward, 0);
}

namespace {
// A model with a frozen parameter and one that never receives a gradient.
struct OddNetImpl : torch::nn::Module {
  OddNetImpl() {
    a = register_module("a", torch::nn::Linear(6, 5));
    b = register_module("b", torch::nn::Linear(5, 3));
    frozen = register_parameter("frozen", torch::ones({3}), /*requires_grad=*/false);
    unused = register_parameter("unused", torch::ones({4}));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::tanh(a(x))) * frozen; }
  torch::nn::Linear a{nullptr}, b{nullptr};
  torch::Tensor frozen, unused;
};
TORCH_MODULE(OddNet);

OddNet train_odd(dist::CommunicatorPtr comm, bool use_ddp) {
  torch::manual_seed(3);
  OddNet net;
  torch::optim::AdamW optimizer(net->parameters(), torch::optim::AdamWOptions(1e-2));
  std::unique_ptr<DistributedDataParallel> ddp;
  if (comm && use_ddp) ddp = std::make_unique<DistributedDataParallel>(net.ptr(), comm);
  auto generator = fivefold::generator_for(1, "odd");
  for (int step = 0; step < 3; ++step) {
    auto x = torch::randn({8, 6}, generator);
    const int rank = comm ? comm->rank() : 0, size = comm ? comm->size() : 1;
    auto local = x.chunk(size)[rank];
    optimizer.zero_grad();
    net(local).pow(2).mean().backward();
    if (ddp) ddp->finish_gradient_sync();
    if (comm && !use_ddp) all_reduce_gradients(*comm, *net);
    optimizer.step();
  }
  return net;
}
}  // namespace

TEST(DataParallel, FrozenAndUnusedParametersBehaveAsOnOneDevice) {
  auto reference = train_odd(nullptr, false);
  for (bool use_ddp : {false, true}) {
    auto parallel = train_odd(world(), use_ddp);
    EXPECT_FALSE(parallel->unused.grad().defined()) << "an unused parameter got a gradient";
    EXPECT_TENSOR_EQ(parallel->unused, reference->unused);  // AdamW skipped it, as on one device
    EXPECT_TENSOR_EQ(parallel->frozen, reference->frozen);
    EXPECT_TENSOR_CLOSE(parallel->a->weight, reference->a->weight, 1e-6, 1e-5);
    EXPECT_TENSOR_CLOSE(parallel->b->bias, reference->b->bias, 1e-6, 1e-5);
  }
}
