// Chapter 09: ZeRO-3 / FSDP reproduces single-device AdamW training, keeps exactly the bytes of
// the ZeRO-3 formula between steps (and one unit plus the root gathered at most during a step),
// and sends 1.5x what DDP sends. Every rank also runs the single-device reference (chapter 03's
// train_step on the whole global batch) and compares. 1, 2, 4 ranks on MPI; 2 on Gloo.

#include <numeric>

#include "03_transformer/train.h"
#include "07_moe/moe.h"
#include "09_data_parallel/fsdp.h"
#include "09_data_parallel/zero.h"
#include "fivefold/comm_stats.h"
#include "fixtures.h"
#include "testing.h"

using namespace fivefold::ch03;
using namespace fivefold::ch09;
using fivefold::ch09::testing::global_batches;
using fivefold::ch09::testing::small_config;
using fivefold::ch09::testing::train_config;
using fivefold::ch09::testing::train_on_one_device;
using fivefold::testing::world;
namespace dist = fivefold::dist;

namespace {
torch::Tensor loss(torch::Tensor logits, const Batch& batch) {
  return torch::cross_entropy_loss(logits.view({-1, logits.size(-1)}), batch.targets.reshape({-1}));
}

// `steps` steps of FSDP, each over `micro_batches` equal micro-batches of this rank's rows; the
// model's parameters gathered at the end, for comparison.
void train_fsdp(FullyShardedDataParallel& fsdp, int steps, int micro_batches = 1) {
  auto comm = world();
  for (int step = 0; step < steps; ++step) {
    fsdp.zero_grad();
    const auto local = global_batches().batch(step, comm->rank(), comm->size());
    for (int m = 0; m < micro_batches; ++m) {
      const Batch micro{local.inputs.chunk(micro_batches)[m],
                        local.targets.chunk(micro_batches)[m]};
      (loss(fsdp.forward(micro.inputs), micro) / micro_batches).backward();
    }
    fsdp.step(step);
  }
  fsdp.gather_full_parameters();
}

void expect_same_parameters(Transformer& got, Transformer& want, double atol = 1e-5) {
  auto expected = want->named_parameters();
  for (const auto& item : got->named_parameters()) {
    SCOPED_TRACE(item.key());
    // As for DDP and ZeRO-1/2: fp32 averaging order, magnified by Adam where gradients are tiny.
    EXPECT_TENSOR_CLOSE(item.value(), expected[item.key()], atol, 1e-5);
  }
}

int64_t psi_of(Transformer& model) {
  int64_t psi = 0;
  for (const auto& p : model->parameters()) psi += p.numel();
  return psi;
}
}  // namespace

TEST(Fsdp, MatchesOneDeviceAfterThreeSteps) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    auto expected = train_on_one_device(Transformer(small_config(tied)), 3);
    FullyShardedDataParallel fsdp(Transformer(small_config(tied)), world(), train_config());
    train_fsdp(fsdp, 3);
    expect_same_parameters(fsdp.model(), expected);
  }
}

TEST(Fsdp, AccumulatesOverMicroBatches) {
  // Two backwards per step: the blocks are reduce-scattered after each, the first block and the
  // root once, at the step; the shards add up to the whole batch's mean gradient.
  auto expected = train_on_one_device(Transformer(small_config(false)), 3);
  FullyShardedDataParallel fsdp(Transformer(small_config(false)), world(), train_config());
  train_fsdp(fsdp, 3, /*micro_batches=*/2);
  expect_same_parameters(fsdp.model(), expected);
}

TEST(Fsdp, FrozenAndUnusedParametersBehaveAsOnOneDevice) {
  // A frozen norm weight inside a block (backward still reads it, after its block's last trainable
  // gradient) and a parameter no forward uses (never stepped, never decayed).
  auto build = [] {
    Transformer model(small_config(false));
    model->block(1).input_layernorm->weight.requires_grad_(false);
    model->register_parameter("unused", torch::full({4, 2}, 0.5));
    return model;
  };
  auto expected = train_on_one_device(build(), 3);
  FullyShardedDataParallel fsdp(build(), world(), train_config());
  train_fsdp(fsdp, 3);
  expect_same_parameters(fsdp.model(), expected);
  EXPECT_TENSOR_EQ(fsdp.model()->named_parameters()["unused"], torch::full({4, 2}, 0.5));
}

TEST(Fsdp, ForwardWithoutGradientsEqualsTheModelAndLeavesOnlyShards) {
  Transformer whole(small_config(true));
  FullyShardedDataParallel fsdp(Transformer(small_config(true)), world(), train_config());
  const auto tokens = global_batches().batch(0).inputs;
  torch::NoGradGuard no_grad;
  EXPECT_TENSOR_CLOSE(fsdp.forward(tokens), whole(tokens), 1e-6, 1e-6);
  const int64_t n = world()->size();
  EXPECT_EQ(fsdp.memory().parameters, 4 * ((psi_of(whole) + n - 1) / n));
}

TEST(Fsdp, KeepsExactlyTheBytesOfTheFormula) {
  const int64_t n = world()->size();
  Transformer probe(small_config(false));
  const int64_t psi = psi_of(probe);
  // fp32, then mixed precision (chapter 14's master weights: bf16 parameters and gradients, the
  // fp32 shards the masters).
  for (const torch::Dtype dtype : {torch::kFloat, torch::kBFloat16}) {
    SCOPED_TRACE(dtype == torch::kFloat ? "fp32" : "bf16 with master weights");
    TrainConfig config = train_config();
    config.param_dtype = dtype;
    const int64_t bytes = dtype == torch::kFloat ? 4 : 2;
    FullyShardedDataParallel fsdp(Transformer(small_config(false)), world(), config);
    const auto units = fsdp.unit_numels();
    // Each unit is padded to a multiple of N on its own; in this model every unit divides by 1,
    // 2 and 4, so the shards add up to exactly Ψ/N and the formula holds with no padding term.
    for (int64_t numel : units) ASSERT_EQ(numel % n, 0);
    ASSERT_EQ(std::accumulate(units.begin(), units.end(), int64_t{0}), psi);
    fsdp.zero_grad();
    const auto batch = global_batches().batch(0, world()->rank(), world()->size());
    loss(fsdp.forward(batch.inputs), batch).backward();
    fsdp.step(0);
    // Between steps: shards only. fp32 (notes/09_data_parallel.md): 4Ψ/N + 4Ψ/N + 8Ψ/N; mixed
    // precision 2Ψ/N + 2Ψ/N + 12Ψ/N.
    const ZeroMemory measured = fsdp.memory(), formula = zero_memory_formula(psi, n, 3, bytes);
    EXPECT_EQ(measured.parameters, formula.parameters);
    EXPECT_EQ(measured.gradients, formula.gradients);
    EXPECT_EQ(measured.optimizer, formula.optimizer);
    // During the step at most the root and one block were whole at once.
    EXPECT_EQ(fsdp.peak_gathered_bytes(), bytes * (units[0] + units[1]));
    EXPECT_LT(fsdp.peak_gathered_bytes(), bytes * psi);
  }
}

TEST(Fsdp, SendsOneAndAHalfTimesWhatDdpSends) {
  const int64_t n = world()->size();
  const auto batch = global_batches().batch(0, world()->rank(), world()->size());
  auto measure = [&](auto&& one_step) {
    dist::reset_comm_stats();
    one_step();
    const auto rs = dist::comm_counts(world()->name(), dist::Op::ReduceScatter);
    const auto ag = dist::comm_counts(world()->name(), dist::Op::AllGather);
    return std::tuple(rs.calls, ag.calls, rs.modelled_wire_bytes + ag.modelled_wire_bytes,
                      rs.payload_bytes + ag.payload_bytes);
  };
  // ZeRO-2 sends exactly an all-reduce of the gradients, what DDP sends (Zero.SendsWhatDdpSends).
  Transformer zero_model(small_config(false));
  ZeroOptimizer zero(zero_model.ptr(), world(), 2, train_config());
  const auto [zero_rs, zero_ag, zero_bytes, zero_payload] = measure([&] {
    loss(zero_model(batch.inputs), batch).backward();
    zero.step(0);
  });
  FullyShardedDataParallel fsdp(Transformer(small_config(false)), world(), train_config());
  const auto [rs, ag, bytes, payload] = measure([&] {
    loss(fsdp.forward(batch.inputs), batch).backward();
    fsdp.step(0);
  });
  const int64_t units = 1 + small_config(false).n_layers;
  EXPECT_EQ(ag, 2 * units);  // every unit gathered for forward and again for backward
  EXPECT_EQ(rs, units);      // and its gradients reduce-scattered once
  int64_t padded = 0;
  for (int64_t numel : fsdp.unit_numels()) padded += (numel + n - 1) / n * n;
  // Measured: the payloads handed to the collectives, 4Ψ (padded) for each of the two
  // all-gathers and the reduce-scatter, against ZeRO-2's one reduce-scatter and one all-gather.
  EXPECT_EQ(payload, 3 * 4 * padded);
  EXPECT_EQ(zero_payload, 2 * 4 * zero.shard_numel() * n);
  // Modelled wire bytes (ring factor (N − 1)/N on each measured payload): 3 (N − 1)/N · 4Ψ per
  // rank, 1.5x DDP's (and ZeRO-2's) 2 (N − 1)/N · 4Ψ.
  EXPECT_DOUBLE_EQ(bytes, 3.0 * static_cast<double>(n - 1) / n * 4.0 * static_cast<double>(padded));
  EXPECT_DOUBLE_EQ(bytes, 1.5 * zero_bytes);
}

TEST(Fsdp, MatchesOneDeviceWithLatentAttentionAndExperts) {
  // Chapters 06 and 07's DeepSeek-V3 in miniature: MLA in every block, 8 experts (2 per token) and
  // a shared one from layer 1 on. Experts that no token of a rank chose have no gradient there.
  ModelConfig c = small_config(false);
  c.rope_theta = 10000;
  c.n_kv_heads = c.n_heads;
  c.extensions = {{"q_lora_rank", 16},
                  {"kv_lora_rank", 16},
                  {"qk_nope_head_dim", 8},
                  {"qk_rope_head_dim", 8},
                  {"v_head_dim", 8},
                  {"n_routed_experts", 8},
                  {"num_experts_per_tok", 2},
                  {"n_shared_experts", 1},
                  {"moe_intermediate_size", 16},
                  {"n_group", 1},
                  {"topk_group", 1},
                  {"first_k_dense_replace", 1}};
  auto expected = train_on_one_device(fivefold::ch07::make_model(c), 3);
  FullyShardedDataParallel fsdp(fivefold::ch07::make_model(c), world(), train_config());
  train_fsdp(fsdp, 3);
  expect_same_parameters(fsdp.model(), expected);
}
