// Chapter 15 on one process: a layout resolved and refused with its reason, and the reports
// (curves compared and plotted, measurements tabulated).

#include <filesystem>
#include <fstream>

#include "../10_tensor_parallel/fixtures.h"
#include "07_moe/moe.h"
#include "15_trainer_5d/predict.h"
#include "runtime/fast.h"
#include "runtime/measure.h"
#include "runtime/run.h"
#include "fixtures.h"
#include "15_trainer_5d/trainer_5d.h"
#include "testing.h"

using namespace fivefold;
using namespace fivefold::ch15;
using fivefold::ch15::testing::sizes;
using fivefold::testing::throws_error_containing;

namespace {

// The default run of the trainer with `model`: 64 tokens, a batch of 16, `micro` micro-batches.
Workload run_with(const ch03::ModelConfig& model, int64_t micro = 1) {
  Workload run;
  run.model = model;
  run.seq_len = 64;
  run.batch = 16;
  run.micro_batches = micro;
  return run;
}

// What a rank's step holds: `elements` in `tensors`, by ZeRO-3 unit.
HeldParameters held_of(int64_t elements, int64_t tensors, std::vector<int64_t> by_unit = {}) {
  HeldParameters held;
  held.elements = elements;
  held.tensors = tensors;
  held.by_unit = std::move(by_unit);
  return held;
}

}  // namespace

TEST(Layout, FillsDataParallelismAndDescribesItself) {
  const auto moe = ch10::testing::deepseek_config();  // 8 heads, 2 layers, 8 experts
  Layout l = sizes(0, 2, 2, 2, 2);
  l.sequence_parallel = true;
  const Layout resolved = resolve_layout(l, 16, run_with(moe, 2));
  EXPECT_EQ(resolved.dp, 2);
  EXPECT_EQ(resolved.ranks(), 16);
  EXPECT_EQ(resolved.describe(),
            "dp 2 x tp 2 (sequence parallel) x pp 2 (1f1b) x cp 2 (zigzag, ring), ep 2, ZeRO-0");
  // One process: every dimension 1.
  EXPECT_EQ(resolve_layout(Layout{}, 1, run_with(moe)).describe(),
            "dp 1 x tp 1 x pp 1 x cp 1, ZeRO-0");
}

TEST(Layout, RefusesWhatTheMethodsCannotDoWithTheReason) {
  const auto llama = ch10::testing::tp_config(false);  // 8 heads, 4 key/value heads, 2 layers
  const auto moe = ch10::testing::deepseek_config();
  auto refuses = [](Layout l, int64_t world, const Workload& run, const char* reason) {
    return throws_error_containing([&] { resolve_layout(l, world, run); }, reason);
  };
  EXPECT_TRUE(refuses(sizes(0, 2, 1, 1), 3, run_with(llama), "does not divide the 3 processes"));
  EXPECT_TRUE(refuses(sizes(3, 2, 1, 1), 4, run_with(llama), "= 6 must equal the number of processes, 4"));
  EXPECT_TRUE(refuses(sizes(0, 3, 1, 1), 3, run_with(llama), "heads do not split over 3"));
  EXPECT_TRUE(refuses(sizes(0, 1, 4, 1), 4, run_with(llama), "layers"));
  Layout interleaved = sizes(0, 1, 2, 1);
  interleaved.schedule = "interleaved";
  interleaved.virtual_stages = 1;
  EXPECT_TRUE(refuses(interleaved, 2, run_with(llama, 3), "interleaved"));
  auto short_rows = run_with(llama);
  short_rows.seq_len = 6;
  EXPECT_TRUE(refuses(sizes(0, 1, 1, 2), 2, short_rows, "2"));  // 6 % (2 x cp 2) != 0
  EXPECT_TRUE(refuses(sizes(0, 1, 1, 1, 3), 3, run_with(moe), "experts"));
  EXPECT_TRUE(refuses(sizes(2, 1, 1, 1, 4), 2, run_with(moe), "ep"));  // ep 4 of dp 2
  EXPECT_TRUE(refuses(sizes(0, 1, 1, 1, 2), 2, run_with(llama), "experts"));  // a dense model
  EXPECT_TRUE(refuses(sizes(0, 1, 1, 1), 3, run_with(llama), "must split into 3 data-parallel ranks"));
  EXPECT_TRUE(refuses(sizes(0, 1, 1, 1), 2, run_with(llama, 3), "x 3 micro-batches"));
  Layout zero = sizes(0, 1, 1, 1);
  zero.zero = 4;
  EXPECT_TRUE(refuses(zero, 1, run_with(llama), "--zero must be 0, 1, 2 or 3"));
  Layout sp = sizes(0, 1, 1, 1);
  sp.sequence_parallel = true;
  EXPECT_TRUE(refuses(sp, 1, run_with(llama), "needs --tp 2 or more"));
}

TEST(Report, PredictedTrafficFollowsTheStagesARankHolds) {
  auto model = ch10::testing::tp_config(false);
  model.n_layers = 4;
  const auto run = run_with(model, 4);
  const int64_t per_link = 16 * 64 * model.d_model * 4;  // all 16 rows, 64 tokens, fp32
  Layout plain = resolve_layout(sizes(0, 1, 4, 1), 4, run);
  EXPECT_EQ(predicted_traffic(plain, run, 0).at("pp-activations"), per_link);
  EXPECT_EQ(predicted_traffic(plain, run, 1).at("pp-gradients"), 2 * per_link);
  EXPECT_EQ(predicted_traffic(plain, run, 3).at("pp-activations"), per_link);
  Layout interleaved = sizes(0, 1, 2, 1);
  interleaved.schedule = "interleaved";
  interleaved.virtual_stages = 2;
  interleaved = resolve_layout(interleaved, 2, run);
  for (int64_t rank : {0, 1})
    EXPECT_EQ(predicted_traffic(interleaved, run, rank).at("pp-activations"), 3 * per_link);
  const Layout tp2 = resolve_layout(sizes(0, 2, 1, 1), 2, run);
  const auto tp_only = predicted_traffic(tp2, run, 0, rank_parameters(tp2, run, 0));
  EXPECT_EQ(tp_only.size(), 2u);  // tp's (the next tests) and dp+cp's, no pipeline or cp bytes
  EXPECT_EQ(tp_only.count("tp"), 1u);
  EXPECT_TRUE(throws_error_containing([&] { predicted_traffic(sizes(0, 1, 2, 1), run, 0); },
                                      "not resolved"));
}

// The data-parallel group from the parameters the rank holds (P = 1001 in T = 5 tensors): DDP
// 4(P + T) + 8; ZeRO-1 over dp 2: the flags 4T, the scatter's and the gather's padded 4·1002
// each, the norm's and the loss's 8. Not predicted: under ep, for ZeRO-3, or without the counts.
TEST(Report, PredictedDataParallelBytesFollowTheHeldParameters) {
  const auto run = run_with(ch10::testing::tp_config(false));
  const HeldParameters held = held_of(1001, 5);
  auto dp = [&](int zero, int64_t ep, const HeldParameters& h) {
    Layout l = sizes(0, 1, 1, 1, ep);
    l.zero = zero;
    const auto bytes = predicted_traffic(resolve_layout(l, 2, run), run, 0, h);
    return bytes.count("dp+cp") ? bytes.at("dp+cp") : int64_t{-1};
  };
  EXPECT_EQ(dp(0, 1, held), 4 * (1001 + 5) + 8);
  EXPECT_EQ(dp(1, 1, held), 4 * 5 + 4 * 1002 + 8 + 4 * 1002 + 8);
  EXPECT_EQ(dp(2, 1, held), 4 * 5 + 4 * 1002 + 8 + 4 * 1002 + 8);
  EXPECT_EQ(dp(3, 1, held), -1);  // ZeRO-3 needs the units
  EXPECT_EQ(dp(0, 1, {}), -1);
  // ZeRO-3 over dp 2 with units root 101, block 0 300, block 1 600 (padded 102, 300, 600; S =
  // 1002): one micro-batch 12·S; a second adds 4·(102 + 300 + 3·600); plus flags, norm, loss.
  const HeldParameters units = held_of(1001, 5, {101, 300, 600});
  EXPECT_EQ(dp(3, 1, units), 12 * 1002 + 4 * 5 + 16);
  auto two = run;
  two.micro_batches = 2;
  Layout l3 = sizes(0, 1, 1, 1);
  l3.zero = 3;
  l3 = resolve_layout(l3, 2, two);
  EXPECT_EQ(predicted_traffic(l3, two, 0, units).at("dp+cp"),
            12 * 1002 + 4 * (102 + 300 + 3 * 600) + 4 * 5 + 16);
  // Over 5 steps, 2 of them after an evaluation had gathered every unit: 4·S less each.
  EXPECT_EQ(predicted_run_traffic(l3, two, 0, units, 5, 2).at("dp+cp"),
            5 * (12 * 1002 + 4 * (102 + 300 + 3 * 600) + 4 * 5 + 16) - 2 * 4 * 1002);
  // One process: chapter 03's step, no communicator.
  EXPECT_EQ(predicted_traffic(resolve_layout(sizes(0, 1, 1, 1), 1, run), run, 0, held).count("dp+cp"),
            0u);
}

// Experts over ep 2 of dp 2 (deepseek_config: d 32, 2 layers, layer 1 with 8 experts, 2 per
// token), 16 rows of 64 tokens: each rank's 8 rows, 512 tokens, 1024 assignments. Per MoE layer
// and micro-batch the counts' all-to-all (8 int64) and four token all-to-alls of 1024 rows of
// 32 floats each way at balance; then the partial gradients of all but the routed experts, the
// norm and the loss. edp (1 rank here) gets chapter 09's formulas over the held parameters.
TEST(Report, PredictedExpertParallelBytesFollowChapter13) {
  const auto run = run_with(ch10::testing::deepseek_config());
  HeldParameters held = held_of(5000, 20, {1000, 1500, 2500});
  held.routed_tensors = 6;
  held.routed_by_unit = {0, 0, 1200};
  Layout l = resolve_layout(sizes(0, 1, 1, 1, 2), 2, run);
  auto bytes = predicted_traffic(l, run, 1, held);
  EXPECT_EQ(bytes.count("dp+cp"), 0u);  // the experts' ranks take its place
  EXPECT_EQ(bytes.at("edp"), 4 * (5000 + 20) + 8);
  EXPECT_EQ(bytes.at("ep"), (8 * 8 + 4 * 1024 * 32 * 4) + 4 * (5000 - 1200) + 8 + 8);
  // ZeRO-3, 2 micro-batches of 256 tokens: the later block's shared part is summed at each
  // micro-batch's release, the root's and block 0's once.
  auto two = run;
  two.micro_batches = 2;
  l.zero = 3;
  bytes = predicted_traffic(resolve_layout(l, 2, two), two, 0, held);
  EXPECT_EQ(bytes.at("ep"),
            2 * (8 * 8 + 4 * 512 * 32 * 4) + 4 * (1000 + 1500 + 2 * 1300) + 8 + 8);
  EXPECT_EQ(bytes.at("edp"), 12 * 5000 + 4 * (1000 + 1500 + 3 * 2500) + 4 * 20 + 16);
  // Routing with a capacity drops tokens: no formula for what the all-to-alls carry.
  auto capped = run;
  capped.model.extensions["fivefold_capacity_factor"] = 1.25;
  EXPECT_EQ(predicted_traffic(resolve_layout(sizes(0, 1, 1, 1, 2), 2, capped), capped, 0, held)
                .count("ep"),
            0u);
}

// tp 2 on the Llama model (d 32, L 2), 16 rows of 64 tokens, fp32, each rank's part built here
// (rank_parameters): per layer attention's and the MLP's crossings in and out (f and g: four
// all-reduces of [16, 64, 32]), the embedding's and the head's one each, the loss's three of
// one number per token, and the norm's 8 bytes; under sequence parallelism each all-reduce is an
// all-gather and a reduce-scatter (both counted at the full size), each block's two entries
// gather their input again in backward (their products kept the rank's part), and the norms'
// 2L + 1 = 5 partial gradients of 32 numbers are all-reduced once.
TEST(Report, PredictedTensorParallelBytesFollowChapter10) {
  const auto run = run_with(ch10::testing::tp_config(false));
  const int64_t activation = 16 * 64 * 32 * 4, per_token = 16 * 64 * 4;
  auto tp_bytes = [](Layout l, int64_t world, const Workload& r, int64_t rank) {
    l = resolve_layout(l, world, r);
    return predicted_traffic(l, r, rank, rank_parameters(l, r, rank)).at("tp");
  };
  EXPECT_EQ(tp_bytes(sizes(0, 2, 1, 1), 2, run, 0), (4 * 2 + 2) * activation + 3 * per_token + 8);
  Layout sp = sizes(0, 2, 1, 1);
  sp.sequence_parallel = true;
  const int64_t sp_bytes =
      2 * (4 * 2 + 2) * activation + 2 * 2 * activation + 3 * per_token + 8;
  EXPECT_EQ(tp_bytes(sp, 2, run, 1), sp_bytes + 4 * 5 * 32);
  // ZeRO-3 reduces the partial gradients as it releases each unit: blocks 1 .. L-1 every
  // micro-batch (here block 1's 2 norms, twice), block 0's 2 and the final norm at the step.
  Layout sp3 = sp;
  sp3.zero = 3;
  auto two = run;
  two.micro_batches = 2;
  EXPECT_EQ(tp_bytes(sp3, 2, two, 0), sp_bytes + 4 * (2 * 2 + 3) * 32);
  // Across two stages: the first holds the embedding and layer 0 (5 crossings), the second layer
  // 1 and the head (5) and sums the loss; the norm goes over pp+tp.
  EXPECT_EQ(tp_bytes(sizes(0, 2, 2, 1), 4, run, 0), 5 * activation);
  EXPECT_EQ(tp_bytes(sizes(0, 2, 2, 1), 4, run, 3), 5 * activation + 3 * per_token);
  // Over cp 2 each rank's rows are half the sequence.
  EXPECT_EQ(tp_bytes(sizes(0, 2, 1, 2), 4, run, 2),
            (4 * 2 + 2) * activation / 2 + 3 * per_token / 2 + 8);
  // MLA (deepseek_config: d 32, latents 16, rope 4) holds its down-projections and their norms
  // whole on every tp rank, each rank's gradient its heads' share: 32·(16 + 4) + 16 + 32·16 + 16
  // = 1184 elements a layer summed once a step. Layer 1's experts: the shared ones cross twice.
  const auto mla = run_with(ch10::testing::deepseek_config());
  const Layout l = resolve_layout(sizes(0, 2, 1, 1), 2, mla);
  const HeldParameters held = rank_parameters(l, mla, 1);
  EXPECT_EQ(held.tp_partial_by_unit, (std::vector<int64_t>{0, 1184, 1184}));
  EXPECT_EQ(predicted_traffic(l, mla, 1, held).at("tp"),
            (4 * 2 + 2) * activation + 3 * per_token + 8 + 4 * 2 * 1184);
  // Without the partial counts there is no prediction.
  EXPECT_EQ(predicted_traffic(l, mla, 1).count("tp"), 0u);
}

// Chapter 09's formulas on the rank's part: P = 1001 trainable in 5 tensors (units 101, 300, 600)
// and 24 frozen numbers, over N = 2: DDP 4(P + 24) + 4P + 8P; ZeRO-1 the moments' shard
// 8·501; ZeRO-2 the gradients' too; ZeRO-3 every unit sharded on its own: 51 + 150 + 300.
TEST(Report, PredictedStateFollowsTheZeroStage) {
  HeldParameters held = held_of(1001, 5, {101, 300, 600});
  held.frozen = 24;
  Layout l = sizes(2, 1, 1, 1);
  auto total = [&](int zero) {
    l.zero = zero;
    return predicted_state_bytes(l, held).total();
  };
  EXPECT_EQ(total(0), 4 * 1025 + 4 * 1001 + 8 * 1001);
  EXPECT_EQ(total(1), 4 * 1025 + 4 * 1001 + 8 * 501);
  EXPECT_EQ(total(2), 4 * 1025 + 4 * 501 + 8 * 501);
  EXPECT_EQ(total(3), 16 * (51 + 150 + 300));
  Layout experts = sizes(2, 1, 1, 1, 2, 1);  // ep 2 of dp 2: edp has 1 rank, ZeRO-1 shards nothing
  EXPECT_EQ(predicted_state_bytes(experts, held).total(), 4 * 1025 + 4 * 1001 + 8 * 1001);
}

// A rank's part built offline holds its tp slice, its stage's layers and its experts; with
// fewer key/value heads than tp ranks, the ranks sharing a head get their replica group, over
// which the shared heads' projections sum their gradients.
TEST(Report, RankParametersAreCountedFromTheRanksPart) {
  const auto run = run_with(ch10::testing::deepseek_config());
  const HeldParameters whole = rank_parameters(resolve_layout(Layout{}, 1, run), run, 0);
  const HeldParameters experts = rank_parameters(resolve_layout(sizes(0, 1, 1, 1, 2), 2, run), run, 1);
  ASSERT_FALSE(whole.routed_by_unit.empty());
  EXPECT_EQ(experts.routed_by_unit[2] * 2, whole.routed_by_unit[2]);  // 4 of the 8 experts
  EXPECT_EQ(whole.elements - experts.elements, whole.routed_by_unit[2] / 2);
  const HeldParameters stage = rank_parameters(resolve_layout(sizes(0, 1, 2, 1), 2, run), run, 1);
  EXPECT_EQ(stage.by_unit[1], 0);  // layer 0 is the first stage's
  EXPECT_EQ(stage.by_unit[2], whole.by_unit[2]);
  const HeldParameters slice = rank_parameters(resolve_layout(sizes(0, 2, 1, 1), 2, run), run, 0);
  EXPECT_LT(slice.elements, whole.elements);
  // tp_config: 8 heads of 4 numbers, 4 key/value heads; over tp 8 each pair of ranks shares one:
  // k_proj and v_proj of [4, 32] each, a layer.
  const auto gqa = run_with(ch10::testing::tp_config(false));
  const Layout tp8 = resolve_layout(sizes(0, 8, 1, 1), 8, gqa);
  const HeldParameters shared = rank_parameters(tp8, gqa, 5);
  EXPECT_EQ(shared.tp_replica_partial_by_unit, (std::vector<int64_t>{0, 256, 256}));
  EXPECT_EQ(predicted_traffic(tp8, gqa, 5, shared).at("tp.replicas"), 4 * 512);
}

// predicted_flops on one process against what a training step executes (chapter 02's counter in
// run_training): MLA with routed and shared experts (8 experts, 2 a token: every assignment is
// computed here, so the count is exact), grouped-query attention with the tiled kernel and with
// the lesson's, and a 15-token sequence (a shorter last tile would need seq > 128: one tile).
TEST(Report, PredictedFlopsEqualWhatOneProcessExecutes) {
  for (const bool mla : {true, false}) {
    for (const bool fast : {true, false}) {
      SCOPED_TRACE(::testing::Message()
                   << (mla ? "MLA + MoE" : "GQA") << (fast ? ", tiled" : ", lesson kernel"));
      auto work =
          run_with(mla ? ch10::testing::deepseek_config() : ch10::testing::tp_config(false));
      work.seq_len = 15;
      work.batch = 4;
      work.attention_tile = fast ? runtime::TiledCausalAttentionKernel::kDefaultTile : 0;
      const Layout one = resolve_layout(Layout{}, 1, work);
      const HeldParameters held = rank_parameters(one, work, 0);
      const StepFlops predicted = predicted_flops(one, work, 0, held);
      EXPECT_GT(predicted.attention, 0);
      EXPECT_GT(predicted.head, 0);
      runtime::RunConfig run;
      run.model = work.model;
      run.seq_len = work.seq_len;
      run.batch = work.batch;
      run.fast = fast;
      run.steps = 2;
      run.eval_batches = 1;
      run.progress = false;
      run.peak_gflops = 1;  // no peak measured
      run.build_model = ch07::make_model;
      runtime::StepMeter meter;
      run.observers = {&meter};
      runtime::run_training(run);
      EXPECT_EQ(meter.step_flops(), predicted.total());
    }
  }
  // Unknown matrices, or experts with a capacity, are not predicted.
  auto run = run_with(ch10::testing::deepseek_config());
  const Layout one = resolve_layout(Layout{}, 1, run);
  EXPECT_TRUE(throws_error_containing([&] { predicted_flops(one, run, 0, HeldParameters{}); },
                                      "not known"));
  run.model.extensions["fivefold_capacity_factor"] = 1.5;
  EXPECT_TRUE(throws_error_containing(
      [&] { predicted_flops(one, run, 0, rank_parameters(one, run, 0)); }, "capacity"));
}
