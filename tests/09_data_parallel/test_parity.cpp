// Chapter 09: parity tests that can see a constant scale on the gradient. AdamW's update ignores
// such a scale and clipping that acts on every step removes it, so a parity test built only on
// AdamW + clipping passes with the 1/N of the gradient average removed or doubled. These compare
// what a scale changes:
//   - every parameter's gradient at step 1, before clipping (clipping off), with the single
//     device's on the whole global batch, for naive DP, DDP and ZeRO stages 1, 2, 3;
//   - the global gradient norm before clipping that each step returns, and its loss;
//   - parameters after 3 steps of SGD, whose update is proportional to the gradient (naive, DDP);
//   - the K-step curve (loss, norm, parameters) of every ZeRO stage through DataParallelStep, with
//     AdamW + clipping, against chapter 03's SingleProcessStep;
//   - the optimizer state of a sharded step, consolidated by name, and a resume in another stage.
// Shown to fail on purpose: removing `.div_(ranks)` from pack_padded_gradients (ZeRO, FSDP) fails
// StepOneGradientsAndNormEqualOneDevice and EveryStageFollowsTheSingleProcessCurve for stages 1-3
// at 2 and 4 ranks; removing the division by the world size from pack_gradients (ddp.cpp, shared
// by DDP's buckets and naive DP) fails those two for DDP, NaiveAllReduceGradientsEqualOneDevice
// and ThreeSgdStepsEqualOneDevice at 2 ranks. The parameter-only tests of test_ddp/test_zero/
// test_fsdp pass with either removed.

#include <cmath>
#include <limits>

#include "03_transformer/train.h"
#include "09_data_parallel/ddp.h"
#include "09_data_parallel/step.h"
#include "fivefold/comm_stats.h"
#include "fivefold/memory.h"
#include "fixtures.h"
#include "parity.h"
#include "testing.h"

using namespace fivefold::ch03;
using namespace fivefold::ch09;
using fivefold::ch09::testing::global_batches;
using fivefold::ch09::testing::small_config;
using fivefold::ch09::testing::train_config;
using fivefold::testing::world;
namespace io = fivefold::io;
namespace dist = fivefold::dist;

namespace {
// The single device on the whole global batch of `step`: loss and gradients, nothing applied.
struct Reference {
  double loss = 0, norm = 0;
  io::TensorMap grads;
};
Reference one_device_gradients(const ModelConfig& config, int64_t step = 0) {
  Transformer model(config);
  Reference r;
  auto loss = loss_of(model, global_batches().batch(step));
  loss.backward();
  r.loss = loss.item<double>();
  for (const auto& item : model->named_parameters()) r.grads[item.key()] = item.value().grad();
  r.norm = clip_gradients(model, 0.0);  // 0: measure only
  return r;
}

// This rank's rows of global batch `step`, in `micro` equal micro-batches.
std::vector<Batch> local_micro_batches(int64_t step, int micro) {
  auto comm = world();
  const Batch local = global_batches().batch(step, comm->rank(), comm->size());
  std::vector<Batch> out;
  for (int m = 0; m < micro; ++m)
    out.push_back({local.inputs.chunk(micro)[m], local.targets.chunk(micro)[m]});
  return out;
}

// Gradients are means of per-rank means: fp32 summation order differs from the single device's,
// a few ulps of the largest gradients (observed < 3e-8 absolute).
constexpr double kGradAtol = 1e-6, kGradRtol = 1e-5;

void expect_gradients(const io::TensorMap& got, const Reference& want) {
  for (const auto& [name, grad] : want.grads) {
    SCOPED_TRACE(name);
    ASSERT_TRUE(got.count(name)) << "no gradient for " << name;
    EXPECT_TENSOR_CLOSE(got.at(name), grad, kGradAtol, kGradRtol);
  }
}

TrainConfig without_clipping() {
  TrainConfig t = train_config();
  t.grad_clip = 0;  // the gradients a step keeps are then the ones before clipping
  return t;
}
}  // namespace

TEST(DataParallelParity, StepOneGradientsAndNormEqualOneDevice) {
  for (bool tied : {false, true}) {
    const auto config = small_config(tied);
    const Reference want = one_device_gradients(config);
    for (int stage : {0, 1, 2, 3}) {
      SCOPED_TRACE("ZeRO stage " + std::to_string(stage) + (tied ? ", tied" : ""));
      DataParallelStep step(Transformer(config), world(), stage, without_clipping());
      const StepResult r = step.step(local_micro_batches(0, 1), 0);
      EXPECT_NEAR(r.loss, want.loss, 1e-6 * want.loss);
      // A missing 1/N multiplies the norm by N.
      EXPECT_NEAR(r.grad_norm, want.norm, 1e-5 * want.norm);
      expect_gradients(step.gradients(), want);
    }
  }
}

TEST(DataParallelParity, NaiveAllReduceGradientsEqualOneDevice) {
  const auto config = small_config(true);
  const Reference want = one_device_gradients(config);
  Transformer model(config);
  loss_of(model, local_micro_batches(0, 1)[0]).backward();
  all_reduce_gradients(*world(), *model);
  io::TensorMap got;
  for (const auto& item : model->named_parameters()) got[item.key()] = item.value().grad();
  expect_gradients(got, want);
  EXPECT_NEAR(clip_gradients(model, 0.0), want.norm, 1e-5 * want.norm);
}

namespace {
// 3 steps of plain SGD (update = -lr x gradient: a scale on the gradient scales the step), on one
// device (comm == nullptr) or data-parallel with naive all-reduce or DDP.
Transformer sgd(const ModelConfig& config, fivefold::dist::CommunicatorPtr comm, bool use_ddp) {
  Transformer model(config);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.5));
  std::unique_ptr<DistributedDataParallel> ddp;
  if (comm && use_ddp) ddp = std::make_unique<DistributedDataParallel>(model.ptr(), comm);
  for (int64_t step = 0; step < 3; ++step) {
    optimizer.zero_grad();
    const Batch batch = comm ? local_micro_batches(step, 1)[0] : global_batches().batch(step);
    loss_of(model, batch).backward();
    if (ddp) ddp->finish_gradient_sync();
    if (comm && !use_ddp) all_reduce_gradients(*comm, *model);
    optimizer.step();
  }
  return model;
}
}  // namespace

TEST(DataParallelParity, ThreeSgdStepsEqualOneDevice) {
  const auto config = small_config(false);
  auto want = sgd(config, nullptr, false);
  auto expected = want->named_parameters();
  for (bool use_ddp : {false, true}) {
    SCOPED_TRACE(use_ddp ? "DDP" : "naive");
    auto got = sgd(config, world(), use_ddp);
    for (const auto& item : got->named_parameters()) {
      SCOPED_TRACE(item.key());
      EXPECT_TENSOR_CLOSE(item.value(), expected[item.key()], 1e-6, 1e-5);
    }
  }
}

TEST(DataParallelParity, EveryStageFollowsTheSingleProcessCurve) {
  // AdamW with clipping that acts (0.5), 3 steps, 1 and 2 micro-batches per rank: the loss and
  // the norm before clipping of every step, then every parameter.
  for (int micro : {1, 2}) {
    if (8 / world()->size() < micro) continue;  // needs `micro` rows per rank
    SingleProcessStep single(Transformer(small_config(false)), train_config());
    std::vector<StepResult> want;
    for (int64_t s = 0; s < 3; ++s) want.push_back(single.step({global_batches().batch(s)}, s));
    auto expected = single.model()->named_parameters();
    for (int stage : {0, 1, 2, 3}) {
      SCOPED_TRACE("ZeRO stage " + std::to_string(stage) + ", micro-batches " +
                   std::to_string(micro));
      DataParallelStep step(Transformer(small_config(false)), world(), stage, train_config());
      for (int64_t s = 0; s < 3; ++s) {
        const StepResult r = step.step(local_micro_batches(s, micro), s);
        EXPECT_NEAR(r.loss, want[s].loss, 1e-5 * want[s].loss) << "step " << s;
        EXPECT_NEAR(r.grad_norm, want[s].grad_norm, 1e-4 * want[s].grad_norm) << "step " << s;
        EXPECT_DOUBLE_EQ(r.lr, want[s].lr);
      }
      for (const auto& item : step.full_model()->named_parameters()) {
        SCOPED_TRACE(item.key());
        // As chapter 09's other tests: fp32 averaging order, magnified by Adam near zero.
        EXPECT_TENSOR_CLOSE(item.value(), expected[item.key()], 1e-5, 1e-5);
      }
    }
  }
}

TEST(DataParallelParity, ShardedOptimizerStateConsolidatesAndResumesInAnotherStage) {
  // Two steps in one stage, the state consolidated by name, a third step in another stage
  // resumed from it: the same as three uninterrupted single-process steps.
  SingleProcessStep single(Transformer(small_config(true)), train_config());
  for (int64_t s = 0; s < 2; ++s) single.step({global_batches().batch(s)}, s);
  io::TensorMap want_state = single.optimizer_state();  // AdamW's own tensors: keep a copy
  for (auto& [name, tensor] : want_state) tensor = tensor.clone();
  single.step({global_batches().batch(2)}, 2);
  auto expected = single.model()->named_parameters();
  for (auto [from, to] : {std::pair<int, int>{1, 3}, {3, 2}, {2, 0}, {0, 1}}) {
    SCOPED_TRACE("stage " + std::to_string(from) + " -> " + std::to_string(to));
    DataParallelStep first(Transformer(small_config(true)), world(), from, train_config());
    for (int64_t s = 0; s < 2; ++s) first.step(local_micro_batches(s, 1), s);
    const io::TensorMap state = first.optimizer_state();
    ASSERT_EQ(state.size(), want_state.size());
    for (const auto& [name, tensor] : want_state) {
      SCOPED_TRACE(name);
      EXPECT_TENSOR_CLOSE(state.at(name), tensor, 1e-8, 1e-4);
    }
    Transformer resumed(small_config(true));
    {
      torch::NoGradGuard no_grad;
      auto params = first.full_model()->named_parameters();
      for (auto& item : resumed->named_parameters()) item.value().copy_(params[item.key()]);
    }
    DataParallelStep second(resumed, world(), to, train_config());
    second.load_optimizer_state(state, "test");
    second.step(local_micro_batches(2, 1), 2);
    for (const auto& item : second.full_model()->named_parameters()) {
      SCOPED_TRACE(item.key());
      EXPECT_TENSOR_CLOSE(item.value(), expected[item.key()], 1e-5, 1e-5);
    }
  }
}

// What a checkpoint's writer saves (optimizer_state_for_writer): the whole state on rank 0, the
// single process's; nothing on the others, which send rank 0 their shards and hold nothing more
// (measured: no collective, at most their moments and where each piece lies sent, and less
// allocated than one shard of one moment). Shown to fail with the state summed by all-reduce on
// every rank, as it was (each rank held one moment whole, 4 bytes a parameter, and sent twice).
TEST(DataParallelParity, TheWritersStateGoesToRankZeroAlone) {
  SingleProcessStep single(Transformer(small_config(true)), train_config());
  for (int64_t s = 0; s < 2; ++s) single.step({global_batches().batch(s)}, s);
  const io::TensorMap want_state = single.optimizer_state();
  const int n = world()->size();
  for (int stage : {0, 1, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    DataParallelStep step(Transformer(small_config(true)), world(), stage, train_config());
    for (int64_t s = 0; s < 2; ++s) step.step(local_micro_batches(s, 1), s);
    const int64_t moments = step.state_bytes().optimizer;
    const auto params = static_cast<int64_t>(single.model()->parameters().size());
    int64_t psi = 0;
    for (const auto& p : single.model()->parameters()) psi += p.numel();
    dist::reset_comm_stats();
    fivefold::MemoryTracker memory;
    const io::TensorMap got = step.optimizer_state_for_writer();
    const auto counts = [&](dist::Op op) { return dist::comm_counts(world()->name(), op); };
    if (world()->rank() == 0) {
      fivefold::testing::expect_same_optimizer_state(got, want_state, "the writer's: ");
      continue;
    }
    EXPECT_TRUE(got.empty()) << got.size() << " tensors off the writer";
    if (stage == 0) continue;  // DDP: every rank holds the state anyway, and sends nothing
    EXPECT_EQ(counts(dist::Op::AllReduce).calls, 0);
    EXPECT_EQ(counts(dist::Op::AllGather).calls, 0);
    const int64_t sent = counts(dist::Op::Send).payload_bytes;
    EXPECT_GE(sent, moments);                           // both moments' shards
    EXPECT_LE(sent, moments + 2 * (16 + 32 * params));  // and where their pieces lie
    EXPECT_LT(memory.peak_bytes(), 4 * psi / n) << "more than a shard held off the writer";
  }
}

TEST(DataParallelParity, ANonFiniteNormAppliesNoUpdateInAnyStage) {
  // A micro-batch whose loss weighs infinitely (an overflow) makes every gradient non-finite.
  // The step must return the non-finite norm and leave the parameters and AdamW's state exactly
  // as they were: the norm is global, so every rank skips the update together (only one rank's
  // batch overflows below). Shown to fail with
  // the isfinite checks removed from step.cpp, zero.cpp and fsdp.cpp (NaN parameters after it).
  auto poisoned = [](std::vector<Batch> batches) {
    batches.back().loss_weight = std::numeric_limits<double>::infinity();
    return batches;
  };
  auto snapshot = [](const io::TensorMap& tensors) {
    io::TensorMap copy;
    for (const auto& [name, tensor] : tensors) copy[name] = tensor.clone();
    return copy;
  };
  auto expect_unchanged = [](const io::TensorMap& got, const io::TensorMap& want) {
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [name, tensor] : want) {
      SCOPED_TRACE(name);
      EXPECT_TRUE(torch::equal(got.at(name), tensor));
    }
  };
  auto parameters = [](Transformer model) {
    io::TensorMap out;
    for (const auto& item : model->named_parameters()) out[item.key()] = item.value();
    return out;
  };
  {
    SCOPED_TRACE("one process");
    SingleProcessStep single(Transformer(small_config(false)), train_config());
    single.step({global_batches().batch(0)}, 0);
    const auto params = snapshot(parameters(single.model())), state = snapshot(single.optimizer_state());
    EXPECT_FALSE(std::isfinite(single.step(poisoned({global_batches().batch(1)}), 1).grad_norm));
    expect_unchanged(parameters(single.model()), params);
    expect_unchanged(single.optimizer_state(), state);
  }
  for (int stage : {0, 1, 2, 3}) {
    SCOPED_TRACE("ZeRO stage " + std::to_string(stage));
    DataParallelStep step(Transformer(small_config(false)), world(), stage, train_config());
    step.step(local_micro_batches(0, 1), 0);
    const auto params = snapshot(parameters(step.full_model()));
    const auto state = snapshot(step.optimizer_state());
    // Only the last rank's batch overflows: every rank must still skip.
    const bool last = world()->rank() == world()->size() - 1;
    const StepResult r =
        step.step(last ? poisoned(local_micro_batches(1, 1)) : local_micro_batches(1, 1), 1);
    EXPECT_FALSE(std::isfinite(r.grad_norm));
    expect_unchanged(parameters(step.full_model()), params);
    expect_unchanged(step.optimizer_state(), state);
  }
}

// Mixed precision's master weights (TrainConfig::param_dtype = bf16, chapter 14) in every stage:
// the parameters and gradients in bf16, fp32 masters sharded as AdamW's moments are, gradients
// reduced in fp32. Each rank keeps exactly ZeRO's mixed-precision bytes (2Ψ + 2Ψ + 12Ψ, sharded
// by stage); stages 1-3 gather bf16 parameters (half the fp32 bytes) and reduce-scatter fp32
// gradients; the curve follows one process with master weights within bf16's rounding of the
// gradients (each rank rounds its own before the fp32 mean, one process rounds the whole batch's
// once); the masters the checkpoint reads are fp32.
TEST(DataParallelParity, MixedPrecisionKeepsTheZeroSplitInEveryStage) {
  TrainConfig mixed = train_config();
  mixed.param_dtype = torch::kBFloat16;
  const int64_t n = world()->size();
  int64_t psi = 0;
  for (const auto& p : Transformer(small_config(false))->parameters()) psi += p.numel();
  SingleProcessStep single(Transformer(small_config(false)), mixed);
  std::vector<StepResult> want;
  for (int64_t s = 0; s < 3; ++s) want.push_back(single.step({global_batches().batch(s)}, s));
  auto expected = single.full_model()->named_parameters();
  for (int stage : {0, 1, 2, 3}) {
    SCOPED_TRACE("ZeRO stage " + std::to_string(stage));
    DataParallelStep step(Transformer(small_config(false)), world(), stage, mixed);
    for (const auto& p : step.model()->parameters()) EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
    for (int64_t s = 0; s < 3; ++s) {
      dist::reset_comm_stats();
      const StepResult r = step.step(local_micro_batches(s, 1), s);
      EXPECT_NEAR(r.loss, want[s].loss, 1e-3 * want[s].loss) << "step " << s;
      EXPECT_NEAR(r.grad_norm, want[s].grad_norm, 1e-2 * want[s].grad_norm) << "step " << s;
      // One rank's DDP is the one process's step: the same roundings, the same clip (in fp32, of
      // the masters' gradients), bit for bit.
      if (n == 1 && stage == 0) EXPECT_EQ(r.grad_norm, want[s].grad_norm) << "step " << s;
      if (stage == 0 || n == 1) continue;
      const int64_t padded = stage == 3 ? 0 : (psi + n - 1) / n * n;
      const auto ag = dist::comm_counts(world()->name(), dist::Op::AllGather);
      const auto rs = dist::comm_counts(world()->name(), dist::Op::ReduceScatter);
      if (stage < 3) {  // one of each: bf16 parameters out, fp32 gradients in
        EXPECT_EQ(ag.payload_bytes, 2 * padded) << "step " << s;
        EXPECT_EQ(rs.payload_bytes, 4 * padded) << "step " << s;
      } else {  // per unit: gathered twice (forward, backward) in bf16, reduced once in fp32
        EXPECT_EQ(ag.payload_bytes, rs.payload_bytes) << "step " << s;
      }
    }
    const StateBytes state = step.state_bytes();
    const ZeroMemory formula = zero_memory_formula(psi, n, stage, 2);
    if (stage < 3) {  // FSDP pads each unit on its own: its own test counts unit by unit
      EXPECT_EQ(state.parameters, formula.parameters);
      EXPECT_EQ(state.gradients, formula.gradients);
      EXPECT_EQ(state.optimizer, formula.optimizer);
    } else {
      EXPECT_EQ(state.optimizer, 6 * state.parameters) << "12 bytes against 2 a number";
      EXPECT_EQ(state.gradients, state.parameters);
    }
    // Where a gradient is near zero its sign follows the roundings, and AdamW moves that element
    // by the learning rate (here 15% of a weight's size a step) either way: compare each tensor as
    // a whole (measured: at most 1.0% and 1.2% apart after three steps at 2 and 4 ranks).
    double worst = 0;
    for (const auto& item : step.full_model()->named_parameters()) {
      SCOPED_TRACE(item.key());
      ASSERT_EQ(item.value().scalar_type(), torch::kFloat) << "the masters";
      const auto& want = expected[item.key()];
      if (n == 1 && stage == 0) EXPECT_TRUE(item.value().equal(want)) << "one rank's DDP";
      const double error = ((item.value() - want).norm() / want.norm()).item<double>();
      worst = std::max(worst, error);
      EXPECT_LT(error, 3e-2);
    }
    std::printf("stage %d: worst relative error of a tensor %.2e\n", stage, worst);
  }
}

// Revealing the masters (a checkpoint or an evaluation between steps: full_model) changes nothing
// of the run: the next step rounds the parameters again (ZeRO-3 leaves them gathered, as it leaves
// an fp32 model after gather_full_parameters) and every stage takes, bit for bit, the steps of the
// run that never looked.
TEST(DataParallelParity, MixedPrecisionRevealingTheMastersChangesNothing) {
  TrainConfig mixed = train_config();
  mixed.param_dtype = torch::kBFloat16;
  for (int stage : {0, 1, 2, 3}) {
    SCOPED_TRACE("ZeRO stage " + std::to_string(stage));
    DataParallelStep plain(Transformer(small_config(true)), world(), stage, mixed);
    DataParallelStep looked(Transformer(small_config(true)), world(), stage, mixed);
    for (int64_t s = 0; s < 3; ++s) {
      const int micro = 8 / world()->size() >= 2 ? 2 : 1;  // two micro-batches where rows allow
      const StepResult want = plain.step(local_micro_batches(s, micro), s);
      const StepResult got = looked.step(local_micro_batches(s, micro), s);
      EXPECT_EQ(got.loss, want.loss) << "step " << s;
      EXPECT_EQ(got.grad_norm, want.grad_norm) << "step " << s;
      for (const auto& item : looked.full_model()->named_parameters())
        ASSERT_EQ(item.value().scalar_type(), torch::kFloat) << item.key();
    }
    // ZeRO-3 holds the units it gathered for full_model until the next forward, as in fp32.
    if (stage < 3) EXPECT_EQ(looked.state_bytes().total(), plain.state_bytes().total());
    auto want = plain.full_model()->named_parameters();
    for (const auto& item : looked.full_model()->named_parameters())
      EXPECT_TRUE(item.value().equal(want[item.key()])) << item.key();
  }
}
