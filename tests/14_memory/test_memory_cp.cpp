// Chapter 14 under context parallelism (chapter 12): what a block keeps on each rank, measured as
// the growth of the storage alive when the loss is computed as a block is added, against
// block_activation_bytes for that rank's share, with the ring and the all-gather attention, in
// both layouts, without recomputation and with each mode, in fp32 and bf16. And under expert
// parallelism (chapter 13): a MoE block's, with the rows the routing sent the rank's experts.
#include "../10_tensor_parallel/fixtures.h"
#include "03_transformer/train.h"
#include "07_moe/moe.h"
#include "10_tensor_parallel/layers.h"
#include "12_context_parallel/context_parallel.h"
#include "13_expert_parallel/expert_parallel.h"
#include "14_memory/plan.h"
#include "14_memory/precision.h"
#include "14_memory/recompute.h"
#include "fivefold/memory.h"
#include "fivefold/seed.h"
#include "fixtures.h"
#include "testing.h"

using namespace fivefold;
using namespace fivefold::ch14;
using fivefold::ch14::testing::kept_per_block;
using fivefold::testing::world;

TEST(ContextParallelMemory, EachRankKeepsWhatTheFormulaSays) {
  ch14::testing::Fp32Afterwards restore;
  const int64_t n = world()->size(), batch = 2;
  for (Precision precision : {Precision::Fp32, Precision::Bf16}) {
    use_precision(precision, nullptr);
    for (auto attention : {ch12::CpAttention::Ring, ch12::CpAttention::AllGather}) {
      for (auto layout : {ch12::CpLayout::Contiguous, ch12::CpLayout::Zigzag}) {
        for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full}) {
          const int64_t seq = 8 * n;
          SCOPED_TRACE(to_string(precision) + ", " +
                       std::string(attention == ch12::CpAttention::Ring ? "ring" : "allgather") +
                       (layout == ch12::CpLayout::Zigzag ? " zigzag" : " contiguous") + ", cp " +
                       std::to_string(n) + ", " + to_string(mode));
          auto config = ch10::testing::tp_config(false);  // 8 heads, 4 key/value heads, d_ff 70
          auto tokens = torch::randint(0, config.vocab_size, {batch, seq}, generator_for(5, "t"));
          const auto mine = ch12::shard_batch({tokens, tokens}, n, world()->rank(), layout);
          const auto kept = kept_per_block(
              [&, layout = layout](int64_t layers) {
                config.n_layers = layers;
                ch03::Transformer model = ch07::make_model(config);
                model->set_attention_kernel(std::make_shared<ch12::ContextParallelKernel>(
                    ch12::ContextParallel{world(), layout, attention}));
                apply_recompute(model, {mode, 1});
                return model;
              },
              mine);
          EXPECT_EQ(kept[0], block_activation_bytes(config.shape(), batch, seq, mode, {}, precision,
                                                    {n, world()->rank(), layout, attention}));
        }
      }
    }
  }
}

// Tensor and context parallelism together (4 ranks: tp 2 inside cp 2), with and without sequence
// parallelism: each rank keeps chapter 12's block term for its heads, d_ff and tokens, with
// sequence parallelism the residual stream's part only for its 1/tp of them.
TEST(ContextParallelMemory, WithTensorParallelismEachRankKeepsWhatTheFormulaSays) {
  if (world()->size() != 4) GTEST_SKIP() << "tp 2 x cp 2 needs 4 ranks";
  ch14::testing::Fp32Afterwards restore;
  const int64_t batch = 2, t = 2, c = 2;
  const auto groups = ch14::testing::tp2_inside_cp2(world());
  const auto &tp = groups.tp, &cp = groups.cp;
  for (Precision precision : {Precision::Fp32, Precision::Bf16}) {
    use_precision(precision, nullptr);
    for (auto attention : {ch12::CpAttention::Ring, ch12::CpAttention::AllGather}) {
      for (bool sp : {false, true}) {
        // Zigzag's 4 tokens a cp rank split evenly over tp; contiguous 5 (of 10) do not.
        for (const auto& [layout, seq] : {std::pair{ch12::CpLayout::Zigzag, int64_t{8}},
                                          std::pair{ch12::CpLayout::Contiguous, int64_t{10}}}) {
          for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full}) {
            SCOPED_TRACE(to_string(precision) + ", " +
                         std::string(attention == ch12::CpAttention::Ring ? "ring" : "allgather") +
                         (sp ? ", SP" : "") + ", seq " + std::to_string(seq) + ", " +
                         to_string(mode));
            auto config = ch10::testing::tp_config(false);  // 8 heads, 4 kv heads, d_ff 70
            auto tokens = torch::randint(0, config.vocab_size, {batch, seq}, generator_for(5, "t"));
            const auto mine = ch12::shard_batch({tokens, tokens}, c, cp->rank(), layout);
            const auto kept = kept_per_block(
                [&, layout = layout](int64_t layers) {
                  config.n_layers = layers;
                  auto group = std::make_shared<ch10::TensorParallel>(ch10::TensorParallel{tp, sp});
                  auto model = ch10::make_model(config, group);
                  model->set_attention_kernel(std::make_shared<ch12::ContextParallelKernel>(
                      ch12::ContextParallel{cp, layout, attention}));
                  apply_recompute(model, {mode, 1});
                  return model;
                },
                mine);
            EXPECT_EQ(kept[0],
                      block_activation_bytes(config.shape(), batch, seq, mode, {t, tp->rank(), sp},
                                             precision, {c, cp->rank(), layout, attention}));
          }
        }
      }
    }
  }
}

// DeepSeek-V3 in miniature (MLA, a dense block then a MoE block) on each rank of context
// parallelism, ring and all-gather, both layouts, without recomputation and with full: what each
// block keeps against deepseek_block_activation_bytes for the rank's share of the sequence.
TEST(ContextParallelMemory, EachRankKeepsWhatTheDeepSeekFormulaSays) {
  const int64_t n = world()->size(), seq = 8 * n;
  ch14::testing::Fp32Afterwards restore;
  const std::pair<const char*, nlohmann::json> variants[] = {
      {"", nullptr}, {"n_shared_experts", 0}, {"q_lora_rank", nullptr}};
  for (Precision precision : {Precision::Fp32, Precision::Bf16}) {
    for (const auto& [key, value] : variants) {
      for (auto attention : {ch12::CpAttention::Ring, ch12::CpAttention::AllGather}) {
        for (auto layout : {ch12::CpLayout::Contiguous, ch12::CpLayout::Zigzag}) {
          for (int64_t batch : {1, 2}) {
            for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full}) {
              SCOPED_TRACE(to_string(precision) + ", " + key + " " + value.dump() + ", " +
                           (attention == ch12::CpAttention::Ring ? "ring" : "allgather") +
                           (layout == ch12::CpLayout::Zigzag ? " zigzag" : " contiguous") +
                           ", cp " + std::to_string(n) + ", " + std::to_string(batch) + " rows, " +
                           to_string(mode));
              auto config = ch10::testing::deepseek_config();
              config.extensions["first_k_dense_replace"] = 2;  // block 1 dense, block 2 MoE
              if (*key != '\0') config.extensions[key] = value;
              auto tokens =
                  torch::randint(0, config.vocab_size, {batch, seq}, generator_for(5, "t"));
              const auto mine = ch12::shard_batch({tokens, tokens}, n, world()->rank(), layout);
              const auto kept = kept_per_block(
                  [&, layout = layout, attention = attention, mode = mode](int64_t layers) {
                    config.n_layers = layers;
                    ch03::Transformer model = ch07::make_model(config);
                    model->set_attention_kernel(std::make_shared<ch12::ContextParallelKernel>(
                        ch12::ContextParallel{world(), layout, attention}));
                    apply_recompute(model, {mode, 1});
                    use_precision(precision, nullptr);
                    return model;
                  },
                  mine, 3);
              const ContextParallelShare share{n, world()->rank(), layout, attention};
              for (int64_t layer : {1, 2})  // the block added: 1 dense, 2 MoE
                EXPECT_EQ(kept[layer - 1],
                          deepseek_block_activation_bytes(config, layer, batch, seq, mode, {},
                                                          share, precision))
                    << "block " << layer;
            }
          }
        }
      }
    }
  }
}

// MLA and experts under tp 2 inside cp 2 (4 ranks), with and without sequence parallelism, in fp32
// and bf16: the DeepSeek formula with both shares.
TEST(ContextParallelMemory, WithTensorParallelismEachRankKeepsWhatTheDeepSeekFormulaSays) {
  if (world()->size() != 4) GTEST_SKIP() << "tp 2 x cp 2 needs 4 ranks";
  const int64_t batch = 2, t = 2, c = 2;
  const auto groups = ch14::testing::tp2_inside_cp2(world());
  const auto &tp = groups.tp, &cp = groups.cp;
  ch14::testing::Fp32Afterwards restore;
  for (Precision precision : {Precision::Fp32, Precision::Bf16}) {
    for (auto attention : {ch12::CpAttention::Ring, ch12::CpAttention::AllGather}) {
      for (bool sp : {false, true}) {
        for (const auto& [layout, seq] : {std::pair{ch12::CpLayout::Zigzag, int64_t{8}},
                                          std::pair{ch12::CpLayout::Contiguous, int64_t{10}}}) {
          for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full}) {
            SCOPED_TRACE(std::string(attention == ch12::CpAttention::Ring ? "ring" : "allgather") +
                         (sp ? ", SP" : "") + ", seq " + std::to_string(seq) + ", " +
                         to_string(mode));
            auto config = ch10::testing::deepseek_config();
            config.extensions["first_k_dense_replace"] = 2;  // block 1 dense, block 2 MoE
            auto tokens = torch::randint(0, config.vocab_size, {batch, seq}, generator_for(5, "t"));
            const auto mine = ch12::shard_batch({tokens, tokens}, c, cp->rank(), layout);
            const auto kept = kept_per_block(
                [&, layout = layout](int64_t layers) {
                  config.n_layers = layers;
                  auto group = std::make_shared<ch10::TensorParallel>(ch10::TensorParallel{tp, sp});
                  auto model = ch10::make_model(config, group);
                  model->set_attention_kernel(std::make_shared<ch12::ContextParallelKernel>(
                      ch12::ContextParallel{cp, layout, attention}));
                  apply_recompute(model, {mode, 1});
                  use_precision(precision, nullptr);
                  return model;
                },
                mine, 3);
            for (int64_t layer : {1, 2})  // the block added: 1 dense, 2 MoE
              EXPECT_EQ(kept[layer - 1], deepseek_block_activation_bytes(
                                             config, layer, batch, seq, mode, {t, tp->rank(), sp},
                                             {c, cp->rank(), layout, attention}, precision))
                  << "block " << layer;
          }
        }
      }
    }
  }
}

// DeepSeek-V3 in miniature under expert parallelism (chapter 13, ep = the world: each rank its own
// tokens, E/ep experts), every recomputation mode, fp32 and bf16, five variants: what the MoE block
// keeps on each rank against deepseek_block_activation_bytes with the rows the routing sent the
// rank's experts (recorded by a dispatcher around chapter 13's); and, summed over the ranks, the
// balanced expectation (every row sent is received). It failed with the received rows' index left
// out, and with bf16's rounding left on the rank's own assignments.
TEST(ExpertParallelMemory, EachRankKeepsWhatTheDeepSeekFormulaSays) {
  const int64_t n = world()->size();
  const auto group = ch13::make_expert_parallel(world(), n);
  ch14::testing::Fp32Afterwards restore;
  const std::pair<const char*, nlohmann::json> variants[] = {{"", nullptr},
                                                             {"moe_intermediate_size", 30},
                                                             {"n_routed_experts", 16},
                                                             {"num_experts_per_tok", 3},
                                                             {"n_shared_experts", 0}};
  for (Precision precision : {Precision::Fp32, Precision::Bf16})
    for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full})
      for (const auto& [key, value] : variants)
        for (int64_t d : {32, 48})
          for (const auto& [batch, seq] : {std::pair<int64_t, int64_t>{1, 8}, {2, 12}}) {
            SCOPED_TRACE(to_string(precision) + ", " + to_string(mode) + ", " + key + " " +
                         value.dump() + ", d " + std::to_string(d) + ", " + std::to_string(batch) +
                         " x " + std::to_string(seq));
            auto config = ch10::testing::deepseek_config();
            config.extensions["first_k_dense_replace"] = 2;  // blocks 1-2 dense, block 3 MoE
            if (*key != '\0') config.extensions[key] = value;
            config.d_model = d;
            auto tokens = torch::randint(0, config.vocab_size, {batch, seq},
                                         generator_for(5 + world()->rank(), "t"));
            int64_t received = -1;
            const auto kept = kept_per_block(
                [&, mode = mode, precision = precision](int64_t layers) {
                  config.n_layers = layers;
                  ch03::Transformer model = ch13::make_model(config, group);
                  if (layers == 3) ch14::testing::record_received_rows(model, 2, &received);
                  apply_recompute(model, {mode, 1});
                  use_precision(precision, nullptr);
                  return model;
                },
                {tokens, tokens}, 3);
            ASSERT_GE(received, 0);
            EXPECT_EQ(kept[1], deepseek_block_activation_bytes(config, 2, batch, seq, mode, {}, {},
                                                               precision, {n, received}));
            auto sums = torch::tensor(
                {kept[1], deepseek_block_activation_bytes(config, 2, batch, seq, mode, {}, {},
                                                          precision, {n, -1})},
                torch::kLong);
            world()->all_reduce(sums);
            EXPECT_EQ(sums[0].item<int64_t>(), sums[1].item<int64_t>()) << "over the ranks";
          }
}

// The same beside tp 2 (with and without sequence parallelism: the rank routes its own part of
// the sequence, or all of it again) and beside cp 2 (ring and all-gather, zigzag), on 4 ranks with
// ep 2 over the other dimension: the DeepSeek formula with both shares and the received rows.
TEST(ExpertParallelMemory, BesideTensorOrContextParallelismEachRankKeepsWhatTheFormulaSays) {
  if (world()->size() != 4) GTEST_SKIP() << "tp 2 or cp 2 beside ep 2 needs 4 ranks";
  const int rank = world()->rank();
  // rank = 2·i + j: j the rank in its tp or cp group (consecutive ranks), i in its ep group.
  auto inner = world()->split(rank / 2, rank % 2, "inner");
  auto data = world()->split(rank % 2, rank / 2, "data");
  const auto beside_tp = ch13::make_expert_parallel(data, 2);
  const auto beside_cp = ch13::make_expert_parallel(world(), 2);  // ep over dp·cp's first 2
  ch14::testing::Fp32Afterwards restore;
  const int64_t batch = 2, seq = 8;
  enum class Beside { Tp, TpSp, CpRing, CpAllGather };
  for (Beside beside : {Beside::Tp, Beside::TpSp, Beside::CpRing, Beside::CpAllGather})
    for (Precision precision : {Precision::Fp32, Precision::Bf16})
      for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full}) {
        const bool cp = beside == Beside::CpRing || beside == Beside::CpAllGather;
        const auto attention =
            beside == Beside::CpRing ? ch12::CpAttention::Ring : ch12::CpAttention::AllGather;
        SCOPED_TRACE(std::string(cp ? "cp 2 " : "tp 2 ") +
                     (beside == Beside::TpSp          ? "SP"
                      : beside == Beside::CpRing      ? "ring"
                      : beside == Beside::CpAllGather ? "all-gather"
                                                      : "") +
                     ", " + to_string(precision) + ", " + to_string(mode));
        auto config = ch10::testing::deepseek_config();
        config.extensions["first_k_dense_replace"] = 2;  // blocks 1-2 dense, block 3 MoE
        auto tokens = torch::randint(0, config.vocab_size, {batch, seq},
                                     generator_for(5 + rank / 2, "t"));  // a tp group's alike
        const ch03::Batch mine =
            cp ? ch12::shard_batch({tokens, tokens}, 2, inner->rank(), ch12::CpLayout::Zigzag)
               : ch03::Batch{tokens, tokens};
        int64_t received = -1;
        const auto kept = kept_per_block(
            [&, beside = beside, mode = mode, precision = precision](int64_t layers) {
              config.n_layers = layers;
              ch03::Transformer model{nullptr};
              if (cp) {
                model = ch13::make_model(config, beside_cp);
                model->set_attention_kernel(std::make_shared<ch12::ContextParallelKernel>(
                    ch12::ContextParallel{inner, ch12::CpLayout::Zigzag, attention}));
              } else {
                model = ch10::make_model(config,
                                         std::make_shared<ch10::TensorParallel>(
                                             ch10::TensorParallel{inner, beside == Beside::TpSp}));
                ch13::adapt_moe_layers(model, beside_tp);
              }
              if (layers == 3) ch14::testing::record_received_rows(model, 2, &received);
              apply_recompute(model, {mode, 1});
              use_precision(precision, nullptr);
              return model;
            },
            mine, 3);
        ASSERT_GE(received, 0);
        const TensorParallelShare tp =
            cp ? TensorParallelShare{}
               : TensorParallelShare{2, inner->rank(), beside == Beside::TpSp};
        const ContextParallelShare cps =
            cp ? ContextParallelShare{2, inner->rank(), ch12::CpLayout::Zigzag, attention}
               : ContextParallelShare{};
        EXPECT_EQ(kept[1], deepseek_block_activation_bytes(config, 2, batch, seq, mode, tp, cps,
                                                           precision, {2, received}));
      }
}
