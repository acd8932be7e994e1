// The fast paths (the tiled attention, the fused RMSNorm) on a rank of tensor parallelism (with
// and without sequence parallelism) and of context parallelism (chapter 12's kernel in the
// attention's place, the fused norms kept): what a block keeps, measured as the growth of the
// storage alive when the loss is computed as a block is added, against block_activation_bytes for
// the rank's share, in every recomputation mode, in fp32 and bf16.
#include "../10_tensor_parallel/fixtures.h"
#include "../14_memory/fixtures.h"
#include "03_transformer/train.h"
#include "07_moe/moe.h"
#include "10_tensor_parallel/layers.h"
#include "12_context_parallel/context_parallel.h"
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
                auto model = ch10::make_model(config, tp);
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
  const int64_t batch = 2, t = 2, c = 2, rank = world()->rank();
  const auto tp = world()->split(static_cast<int>(rank / t), static_cast<int>(rank % t), "tp");
  const auto cp = world()->split(static_cast<int>(rank % t), static_cast<int>(rank / t), "cp");
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
