// Chapter 12, one process: blockwise attention and the merge against chapter 03's attention.
// Shown to fail on purpose: a merge that adds the two outputs unweighted fails every test that
// merges; blockwise backward that drops delta (softmax's row term) fails
// Blockwise.EqualsChapter03 and Blockwise.InTheModelsKernelSlot.

#include "../10_tensor_parallel/fixtures.h"
#include "03_transformer/train.h"
#include "07_moe/moe.h"
#include "12_context_parallel/attention.h"
#include "fivefold/memory.h"
#include "fivefold/seed.h"
#include "testing.h"

using namespace fivefold;
using namespace fivefold::ch12;

namespace {

torch::Tensor draw(std::vector<int64_t> shape, const char* name) {
  return torch::randn(shape, generator_for(12, name));
}

struct Qkv {
  torch::Tensor q, k, v;
};

// Batch 2, 4 query heads over 2 key/value heads (grouped-query), head 6, values 5 wide.
Qkv qkv(int64_t seq) {
  return {draw({2, 4, seq, 6}, "q").requires_grad_(true),
          draw({2, 2, seq, 6}, "k").requires_grad_(true),
          draw({2, 2, seq, 5}, "v").requires_grad_(true)};
}

// Chapter 03's attention (the reference), with scale 1/√6 as causal_attention applies.
ch03::AttentionOutput reference(const Qkv& t) {
  ch03::AttentionOutput r;
  r.output = ch03::causal_attention(t.q, t.k, t.v, &r.lse);
  return r;
}

const double kScale = 1.0 / std::sqrt(6.0);

}  // namespace

TEST(Merge, TwoBlocksMergeIntoTheWhole) {
  const int64_t seq = 11;
  auto t = qkv(seq);
  const auto positions = ch03::position_range(0, seq);
  const auto want = reference(t);
  for (int64_t cut : {1, 4, 10}) {
    SCOPED_TRACE("keys cut at " + std::to_string(cut));
    // The early keys and the late ones: the first queries see none of the late ones (LSE −inf).
    auto a = attend_block(t.q, t.k.narrow(2, 0, cut), t.v.narrow(2, 0, cut), positions,
                          positions.narrow(0, 0, cut), kScale);
    auto b = attend_block(t.q, t.k.narrow(2, cut, seq - cut), t.v.narrow(2, cut, seq - cut),
                          positions, positions.narrow(0, cut, seq - cut), kScale);
    EXPECT_TRUE(torch::isneginf(b.lse).any().item<bool>());
    for (const auto& merged : {merge_attention(a, b), merge_attention(b, a)}) {
      EXPECT_TENSOR_CLOSE(merged.output, want.output, 1e-5, 1e-5);
      EXPECT_TENSOR_CLOSE(merged.lse, want.lse, 1e-5, 1e-5);
    }
  }
}

TEST(Merge, QueriesThatSeeNoKeyStayZero) {
  // Queries at positions 0..2 and keys at 3..5: nobody sees anything, in either part.
  auto t = qkv(3);
  const auto q_positions = ch03::position_range(0, 3), k_positions = ch03::position_range(3, 3);
  auto a = attend_block(t.q, t.k, t.v, q_positions, k_positions, kScale);
  auto merged = merge_attention(a, a);
  EXPECT_FALSE(torch::isnan(merged.output).any().item<bool>());
  EXPECT_EQ(merged.output.abs().max().item<float>(), 0.0f);
  EXPECT_TRUE(torch::isneginf(merged.lse).all().item<bool>());
}

TEST(Blockwise, EqualsChapter03) {
  const int64_t seq = 13;
  auto t = qkv(seq);
  const auto positions = ch03::position_range(0, seq);
  const auto weights = draw({2, 4, seq, 5}, "w");
  const auto want = reference(t);
  (want.output * weights).sum().backward();
  const auto dq = t.q.grad().clone(), dk = t.k.grad().clone(), dv = t.v.grad().clone();
  for (int64_t block : {1, 3, 5, 13, 64}) {
    SCOPED_TRACE("block " + std::to_string(block));
    for (auto* x : {&t.q, &t.k, &t.v}) x->mutable_grad().reset();
    auto got = blockwise_attention(t.q, t.k, t.v, positions, positions, kScale, block);
    EXPECT_TENSOR_CLOSE(got.output, want.output, 1e-5, 1e-5);
    EXPECT_TENSOR_CLOSE(got.lse, want.lse, 1e-5, 1e-5);
    (got.output * weights).sum().backward();
    EXPECT_TENSOR_CLOSE(t.q.grad(), dq, 1e-5, 1e-5);
    EXPECT_TENSOR_CLOSE(t.k.grad(), dk, 1e-5, 1e-5);
    EXPECT_TENSOR_CLOSE(t.v.grad(), dv, 1e-5, 1e-5);
  }
}

TEST(Blockwise, TokensInAnyOrder) {
  // The same attention with the tokens shuffled: masks come from positions, not order.
  const int64_t seq = 12;
  auto t = qkv(seq);
  const auto order = torch::randperm(seq, generator_for(12, "order"));
  auto got = blockwise_attention(t.q.index_select(2, order), t.k.index_select(2, order),
                                 t.v.index_select(2, order), order, order, kScale, 5);
  const auto want = reference(t);
  EXPECT_TENSOR_CLOSE(got.output, want.output.index_select(2, order), 1e-5, 1e-5);
  EXPECT_TENSOR_CLOSE(got.lse, want.lse.index_select(2, order), 1e-5, 1e-5);
}

TEST(Blockwise, KeepsNoScoreMatrix) {
  // What forward leaves for backward: q, k, v, the output and the LSE, and no [seq, seq]
  // probabilities (chapter 03's attention keeps one per head: 2·4·256² floats here, 2 MB).
  const int64_t seq = 256;
  auto t = qkv(seq);
  const auto positions = ch03::position_range(0, seq);
  const auto w = draw({2, 4, seq, 5}, "w");
  std::vector<int64_t> backward_peak;
  for (int64_t block : {16, 64}) {
    MemoryTracker tracker;
    auto got = blockwise_attention(t.q, t.k, t.v, positions, positions, kScale, block);
    const int64_t output_and_lse = (2 * 4 * seq * 5 + 2 * 4 * seq) * 4;
    EXPECT_EQ(tracker.current_bytes(), output_and_lse);  // q, k, v existed; nothing else stays
    tracker.reset_peak();
    (got.output * w).sum().backward();
    backward_peak.push_back(tracker.peak_bytes());
  }
  // Backward's working set is a few [seq, block] tensors per head at a time: it grows with the
  // block, and at block 16 it is below the one [seq, seq] tensor chapter 03 keeps.
  EXPECT_LT(backward_peak[0], 2 * 4 * seq * seq * 4 / 2) << backward_peak[1];
  EXPECT_LT(2 * backward_peak[0], backward_peak[1]);
}

TEST(Blockwise, InTheModelsKernelSlot) {
  // The whole model with the blockwise kernel: the same loss and gradients as chapter 03's, for
  // Llama-style attention (grouped-query) and for MLA (chapter 06, value heads narrower).
  for (const bool mla : {false, true}) {
    SCOPED_TRACE(mla ? "MLA + MoE" : "GQA");
    const auto config =
        mla ? ch10::testing::deepseek_config() : ch10::testing::tp_config(/*tied=*/false);
    auto plain = ch07::make_model(config), blocked = ch07::make_model(config);
    blocked->set_attention_kernel(std::make_shared<BlockwiseAttentionKernel>(4));
    const auto batch = ch10::testing::tp_batches().batch(0);
    auto want = ch03::loss_of(plain, batch), got = ch03::loss_of(blocked, batch);
    EXPECT_NEAR(got.item<double>(), want.item<double>(), 1e-6);
    want.backward();
    got.backward();
    const auto expected = plain->named_parameters();
    for (const auto& item : blocked->named_parameters()) {
      if (!item.value().grad().defined()) continue;
      SCOPED_TRACE(item.key());
      EXPECT_TENSOR_CLOSE(item.value().grad(), expected[item.key()].grad(), 1e-5, 1e-4);
    }
  }
}

TEST(Blockwise, PositionRuns) {
  using Runs = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(position_runs(torch::tensor({0, 1, 2, 3}, torch::kLong), 8), (Runs{{0, 4}}));
  EXPECT_EQ(position_runs(torch::tensor({0, 1, 2, 3, 4}, torch::kLong), 2),
            (Runs{{0, 2}, {2, 2}, {4, 1}}));
  EXPECT_EQ(position_runs(torch::tensor({2, 3, 12, 13}, torch::kLong), 8), (Runs{{0, 2}, {2, 2}}));
  EXPECT_EQ(position_runs(torch::tensor({5, 4}, torch::kLong), 8), (Runs{{0, 1}, {1, 1}}));
  EXPECT_TRUE(position_runs(torch::zeros({0}, torch::kLong), 8).empty());
}
