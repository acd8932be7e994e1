// The fast paths (the tiled attention, the fused RMSNorm) on a rank of tensor parallelism (with
// and without sequence parallelism), of context parallelism (chapter 12's kernel in the
// attention's place, the fused norms kept) and of expert parallelism: what a block keeps, measured
// as the growth of the storage alive when the loss is computed as a block is added, against
// block_activation_bytes for the rank's share, in every recomputation mode, in fp32 and bf16.
#include <functional>

#include "../10_tensor_parallel/fixtures.h"
#include "../14_memory/fixtures.h"
#include "03_transformer/train.h"
#include "07_moe/moe.h"
#include "10_tensor_parallel/layers.h"
#include "12_context_parallel/context_parallel.h"
#include "13_expert_parallel/expert_parallel.h"
#include "14_memory/precision.h"
#include "14_memory/recompute.h"
#include "fivefold/memory.h"
#include "fivefold/seed.h"
#include "runtime/fast.h"
#include "testing.h"

using namespace fivefold;
using fivefold::ch14::Precision;
using fivefold::ch14::Recompute;
using fivefold::ch14::testing::kept_per_block;
using fivefold::testing::world;

namespace {
struct Fp32Afterwards {
  ~Fp32Afterwards() { ch03::set_matmul_kernel(nullptr); }
};

// The model the trainer builds on these tp ranks (chapter 15's compose.cpp): chapter 10's split
// layers for tp > 1, chapter 03's blocks (through chapter 07's builder) on one rank, whose MLP the
// fast paths put on swiglu.
ch03::Transformer trainer_model(const ch03::ModelConfig& config,
                                const std::shared_ptr<ch10::TensorParallel>& tp) {
  return tp->comm->size() > 1 ? ch10::make_model(config, tp) : ch07::make_model(config);
}
}  // namespace

TEST(FastPathsParallel, EachTensorParallelRankKeepsWhatTheFormulaSays) {
  Fp32Afterwards restore;
  const int64_t t = world()->size(), batch = 2;
  for (Precision precision : {Precision::Fp32, Precision::Bf16}) {
    for (bool sp : {false, true}) {
      for (int64_t seq : {8, 13}) {
        for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full}) {
          SCOPED_TRACE(ch14::to_string(precision) + ", tp " + std::to_string(t) +
                       (sp ? " SP" : "") + ", seq " + std::to_string(seq) + ", " +
                       ch14::to_string(mode));
          auto config = ch10::testing::tp_config(false);  // 8 heads, 4 key/value heads, d_ff 70
          auto tokens = torch::randint(0, config.vocab_size, {batch, seq}, generator_for(5, "t"));
          const auto kept = kept_per_block(
              [&](int64_t layers) {
                config.n_layers = layers;
                auto tp = std::make_shared<ch10::TensorParallel>(ch10::TensorParallel{world(), sp});
                auto model = trainer_model(config, tp);
                ch03::set_matmul_kernel(nullptr);
                runtime::install_fast_paths(model);
                ch14::apply_recompute(model, {mode, 1});
                if (precision == Precision::Bf16) ch14::use_precision(precision, nullptr);
                return model;
              },
              {tokens, tokens});
          const ch14::TensorParallelShare share{t, world()->rank(), sp};
          EXPECT_EQ(kept[0], runtime::block_activation_bytes(config.shape(), batch, seq, precision,
                                                             mode, share));
        }
      }
    }
  }
}

TEST(FastPathsParallel, EachContextParallelRankKeepsWhatTheFormulaSays) {
  if (world()->size() == 1) GTEST_SKIP() << "context parallelism needs 2 ranks or more";
  Fp32Afterwards restore;
  const int64_t n = world()->size(), batch = 2, seq = 8 * n;
  for (Precision precision : {Precision::Fp32, Precision::Bf16}) {
    for (auto attention : {ch12::CpAttention::Ring, ch12::CpAttention::AllGather}) {
      for (auto layout : {ch12::CpLayout::Contiguous, ch12::CpLayout::Zigzag}) {
        for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full}) {
          SCOPED_TRACE(ch14::to_string(precision) + ", " +
                       std::string(attention == ch12::CpAttention::Ring ? "ring" : "allgather") +
                       (layout == ch12::CpLayout::Zigzag ? " zigzag" : " contiguous") + ", cp " +
                       std::to_string(n) + ", " + ch14::to_string(mode));
          auto config = ch10::testing::tp_config(false);  // 8 heads, 4 key/value heads, d_ff 70
          auto tokens = torch::randint(0, config.vocab_size, {batch, seq}, generator_for(5, "t"));
          const auto mine = ch12::shard_batch({tokens, tokens}, n, world()->rank(), layout);
          const auto kept = kept_per_block(
              [&, layout = layout](int64_t layers) {
                config.n_layers = layers;
                ch03::Transformer model = ch07::make_model(config);
                ch03::set_matmul_kernel(nullptr);
                runtime::install_fast_paths(model);
                model->set_attention_kernel(std::make_shared<ch12::ContextParallelKernel>(
                    ch12::ContextParallel{world(), layout, attention}));
                ch14::apply_recompute(model, {mode, 1});
                if (precision == Precision::Bf16) ch14::use_precision(precision, nullptr);
                return model;
              },
              mine);
          const ch14::ContextParallelShare share{n, world()->rank(), layout, attention};
          EXPECT_EQ(kept[0], runtime::block_activation_bytes(config.shape(), batch, seq, precision,
                                                             mode, {}, share));
        }
      }
    }
  }
}

// tp 2 inside cp 2 (4 ranks), with and without sequence parallelism.
TEST(FastPathsParallel, EachRankOfTensorAndContextParallelismKeepsWhatTheFormulaSays) {
  if (world()->size() != 4) GTEST_SKIP() << "tp 2 x cp 2 needs 4 ranks";
  Fp32Afterwards restore;
  const int64_t batch = 2, t = 2, c = 2;
  const auto groups = ch14::testing::tp2_inside_cp2(world());
  const auto &tp = groups.tp, &cp = groups.cp;
  for (Precision precision : {Precision::Fp32, Precision::Bf16}) {
    for (auto attention : {ch12::CpAttention::Ring, ch12::CpAttention::AllGather}) {
      for (bool sp : {false, true}) {
        for (const auto& [layout, seq] : {std::pair{ch12::CpLayout::Zigzag, int64_t{8}},
                                          std::pair{ch12::CpLayout::Contiguous, int64_t{10}}}) {
          for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full}) {
            SCOPED_TRACE(ch14::to_string(precision) + ", " +
                         std::string(attention == ch12::CpAttention::Ring ? "ring" : "allgather") +
                         (sp ? ", SP" : "") + ", seq " + std::to_string(seq) + ", " +
                         ch14::to_string(mode));
            auto config = ch10::testing::tp_config(false);
            auto tokens = torch::randint(0, config.vocab_size, {batch, seq}, generator_for(5, "t"));
            const auto mine = ch12::shard_batch({tokens, tokens}, c, cp->rank(), layout);
            const auto kept = kept_per_block(
                [&, layout = layout](int64_t layers) {
                  config.n_layers = layers;
                  auto group = std::make_shared<ch10::TensorParallel>(ch10::TensorParallel{tp, sp});
                  auto model = ch10::make_model(config, group);
                  ch03::set_matmul_kernel(nullptr);
                  runtime::install_fast_paths(model);
                  model->set_attention_kernel(std::make_shared<ch12::ContextParallelKernel>(
                      ch12::ContextParallel{cp, layout, attention}));
                  ch14::apply_recompute(model, {mode, 1});
                  if (precision == Precision::Bf16) ch14::use_precision(precision, nullptr);
                  return model;
                },
                mine);
            const ch14::TensorParallelShare tp_share{t, tp->rank(), sp};
            const ch14::ContextParallelShare cp_share{c, cp->rank(), layout, attention};
            EXPECT_EQ(kept[0],
                      runtime::block_activation_bytes(config.shape(), batch, seq, precision, mode,
                                                      tp_share, cp_share));
          }
        }
      }
    }
  }
}

namespace {

// What each block of a DeepSeek-V3-shaped model (block 1 dense, block 2 MoE) keeps on this rank
// with the fast paths, `parallel` putting tp's layers and/or cp's kernel in, against the fast
// kernels' formula for the rank's shares, in every mode, in fp32 and bf16.
void expect_deepseek_blocks_keep_the_formula(
    int64_t batch, int64_t seq, const ch03::Batch& mine,
    const std::function<ch03::Transformer(const ch03::ModelConfig&)>& parallel,
    const ch14::TensorParallelShare& tp, const ch14::ContextParallelShare& cp) {
  Fp32Afterwards restore;
  for (Precision precision : {Precision::Fp32, Precision::Bf16}) {
    for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full}) {
      SCOPED_TRACE(ch14::to_string(precision) + ", " + ch14::to_string(mode));
      auto config = ch10::testing::deepseek_config();
      config.extensions["first_k_dense_replace"] = 2;
      const auto kept = kept_per_block(
          [&](int64_t layers) {
            config.n_layers = layers;
            ch03::set_matmul_kernel(nullptr);
            auto model = parallel(config);
            ch14::apply_recompute(model, {mode, 1});
            if (precision == Precision::Bf16) ch14::use_precision(precision, nullptr);
            return model;
          },
          mine, 3);
      for (int64_t layer : {1, 2})
        EXPECT_EQ(kept[layer - 1], runtime::block_activation_bytes(config, layer, batch, seq,
                                                                   precision, mode, tp, cp))
            << "block " << layer;
    }
  }
}

}  // namespace

TEST(FastPathsParallel, EachTensorParallelRankKeepsWhatTheDeepSeekFormulaSays) {
  const int64_t t = world()->size(), seq = 6;  // 3 a rank at tp 2; 2 and 1 at tp 4
  for (bool sp : {false, true}) {
    for (int64_t batch : {1, 2}) {
      SCOPED_TRACE("tp " + std::to_string(t) + (sp ? " SP" : "") + ", batch " +
                   std::to_string(batch));
      auto tokens = torch::randint(0, 259, {batch, seq}, generator_for(5, "t"));
      expect_deepseek_blocks_keep_the_formula(
          batch, seq, {tokens, tokens},
          [&](const ch03::ModelConfig& config) {
            auto tp = std::make_shared<ch10::TensorParallel>(ch10::TensorParallel{world(), sp});
            auto model = trainer_model(config, tp);
            runtime::install_fast_paths(model);
            return model;
          },
          {t, world()->rank(), sp}, {});
    }
  }
}

TEST(FastPathsParallel, EachContextParallelRankKeepsWhatTheDeepSeekFormulaSays) {
  if (world()->size() == 1) GTEST_SKIP() << "context parallelism needs 2 ranks or more";
  const int64_t n = world()->size(), seq = 8 * n;
  for (auto attention : {ch12::CpAttention::Ring, ch12::CpAttention::AllGather}) {
    for (auto layout : {ch12::CpLayout::Contiguous, ch12::CpLayout::Zigzag}) {
      for (int64_t batch : {1, 2}) {
        SCOPED_TRACE(std::string(attention == ch12::CpAttention::Ring ? "ring" : "allgather") +
                     (layout == ch12::CpLayout::Zigzag ? " zigzag" : " contiguous") + ", cp " +
                     std::to_string(n) + ", batch " + std::to_string(batch));
        auto tokens = torch::randint(0, 259, {batch, seq}, generator_for(5, "t"));
        expect_deepseek_blocks_keep_the_formula(
            batch, seq, ch12::shard_batch({tokens, tokens}, n, world()->rank(), layout),
            [&, layout = layout, attention = attention](const ch03::ModelConfig& config) {
              ch03::Transformer model = ch07::make_model(config);
              runtime::install_fast_paths(model);
              model->set_attention_kernel(std::make_shared<ch12::ContextParallelKernel>(
                  ch12::ContextParallel{world(), layout, attention}));
              return model;
            },
            {}, {n, world()->rank(), layout, attention});
      }
    }
  }
}

TEST(FastPathsParallel, EachRankOfTensorAndContextParallelismKeepsWhatTheDeepSeekFormulaSays) {
  if (world()->size() != 4) GTEST_SKIP() << "tp 2 x cp 2 needs 4 ranks";
  const int64_t batch = 2, t = 2, c = 2;
  const auto groups = ch14::testing::tp2_inside_cp2(world());
  const auto &tp = groups.tp, &cp = groups.cp;
  for (auto attention : {ch12::CpAttention::Ring, ch12::CpAttention::AllGather}) {
    for (bool sp : {false, true}) {
      for (const auto& [layout, seq] : {std::pair{ch12::CpLayout::Zigzag, int64_t{8}},
                                        std::pair{ch12::CpLayout::Contiguous, int64_t{10}}}) {
        SCOPED_TRACE(std::string(attention == ch12::CpAttention::Ring ? "ring" : "allgather") +
                     (sp ? ", SP" : "") + ", seq " + std::to_string(seq));
        auto tokens = torch::randint(0, 259, {batch, seq}, generator_for(5, "t"));
        expect_deepseek_blocks_keep_the_formula(
            batch, seq, ch12::shard_batch({tokens, tokens}, c, cp->rank(), layout),
            [&, layout = layout, attention = attention](const ch03::ModelConfig& config) {
              auto group = std::make_shared<ch10::TensorParallel>(ch10::TensorParallel{tp, sp});
              auto model = ch10::make_model(config, group);
              runtime::install_fast_paths(model);
              model->set_attention_kernel(std::make_shared<ch12::ContextParallelKernel>(
                  ch12::ContextParallel{cp, layout, attention}));
              return model;
            },
            {t, tp->rank(), sp}, {c, cp->rank(), layout, attention});
      }
    }
  }
}

// A MoE block on each rank of expert parallelism (ep = the world, each rank its own tokens) with
// the fast paths, every mode, fp32 and bf16: the fast kernels' formula with chapter 14's ep term
// for the rows the routing sent the rank's experts (recorded around chapter 13's dispatcher).
TEST(FastPathsParallel, EachExpertParallelRankKeepsWhatTheDeepSeekFormulaSays) {
  if (world()->size() == 1) GTEST_SKIP() << "expert parallelism needs 2 ranks or more";
  const int64_t n = world()->size();
  const auto group = ch13::make_expert_parallel(world(), n);
  Fp32Afterwards restore;
  for (Precision precision : {Precision::Fp32, Precision::Bf16})
    for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full})
      for (const auto& [batch, seq] : {std::pair<int64_t, int64_t>{1, 8}, {2, 12}}) {
        SCOPED_TRACE(ch14::to_string(precision) + ", " + ch14::to_string(mode) + ", " +
                     std::to_string(batch) + " x " + std::to_string(seq));
        auto config = ch10::testing::deepseek_config();
        config.extensions["first_k_dense_replace"] = 2;  // blocks 1-2 dense, block 3 MoE
        auto tokens = torch::randint(0, 259, {batch, seq}, generator_for(5 + world()->rank(), "t"));
        int64_t received = -1;
        const auto kept = kept_per_block(
            [&, mode = mode, precision = precision](int64_t layers) {
              config.n_layers = layers;
              ch03::set_matmul_kernel(nullptr);
              ch03::Transformer model = ch13::make_model(config, group);
              runtime::install_fast_paths(model);
              if (layers == 3) ch14::testing::record_received_rows(model, 2, &received);
              ch14::apply_recompute(model, {mode, 1});
              if (precision == Precision::Bf16) ch14::use_precision(precision, nullptr);
              return model;
            },
            {tokens, tokens}, 3);
        ASSERT_GE(received, 0);
        EXPECT_EQ(kept[1], runtime::block_activation_bytes(config, 2, batch, seq, precision, mode,
                                                           {}, {}, {n, received}));
      }
}
