// Chapter 14 under tensor parallelism (chapter 10): what a block keeps on each rank, measured as
// the growth of the storage alive when the loss is computed as a block is added, against
// block_activation_bytes for that rank, in every recomputation mode, with and without sequence
// parallelism, at a sequence that splits evenly over the ranks and one that does not, in fp32
// and in bf16.
#include "../10_tensor_parallel/fixtures.h"
#include "03_transformer/train.h"
#include "10_tensor_parallel/layers.h"
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

// In fp32 and in bf16 (chapter 14's Bf16MatmulKernel: the linear maps keep bf16 copies).
TEST(TensorParallelMemory, EachRankKeepsWhatTheFormulaSays) {
  ch14::testing::Fp32Afterwards restore;
  const int64_t t = world()->size(), batch = 2;
  for (Precision precision : {Precision::Fp32, Precision::Bf16}) {
    use_precision(precision, nullptr);
    for (bool sp : {false, true}) {
      for (int64_t seq : {8, 13}) {
        for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full}) {
          SCOPED_TRACE(to_string(precision) + ", tp " + std::to_string(t) + (sp ? " SP" : "") +
                       ", seq " + std::to_string(seq) + ", " + to_string(mode));
          auto config = ch10::testing::tp_config(false);  // 8 heads, 4 key/value heads, d_ff 70
          auto tokens = torch::randint(0, config.vocab_size, {batch, seq}, generator_for(5, "t"));
          const auto kept = kept_per_block(
              [&](int64_t layers) {
                config.n_layers = layers;
                auto tp = std::make_shared<ch10::TensorParallel>(ch10::TensorParallel{world(), sp});
                auto model = ch10::make_model(config, tp);
                apply_recompute(model, {mode, 1});
                return model;
              },
              {tokens, tokens});
          const TensorParallelShare share{t, world()->rank(), sp};
          EXPECT_EQ(kept[0],
                    block_activation_bytes(config.shape(), batch, seq, mode, share, precision));
        }
      }
    }
  }
}

// DeepSeek-V3 in miniature (MLA, a dense block then a MoE block) on each rank of tensor
// parallelism, with and without sequence parallelism, 1 and 2 rows, without recomputation and with
// full: what each block keeps against deepseek_block_activation_bytes for the rank's share.
TEST(TensorParallelMemory, EachRankKeepsWhatTheDeepSeekFormulaSays) {
  const int64_t t = world()->size();
  ch14::testing::Fp32Afterwards restore;
  const std::pair<const char*, nlohmann::json> variants[] = {
      {"", nullptr}, {"n_shared_experts", 0}, {"q_lora_rank", nullptr}, {"num_experts_per_tok", 3}};
  for (Precision precision : {Precision::Fp32, Precision::Bf16}) {
    for (const auto& [key, value] : variants) {
      for (bool sp : {false, true}) {
        for (int64_t batch : {1, 2}) {
          for (Recompute mode : {Recompute::None, Recompute::Selective, Recompute::Full}) {
            const int64_t seq = 6;  // 3 a rank at tp 2; 2 and 1 at tp 4
            SCOPED_TRACE(to_string(precision) + ", " + key + " " + value.dump() + ", tp " +
                         std::to_string(t) + (sp ? " SP" : "") + ", batch " +
                         std::to_string(batch) + ", " + to_string(mode));
            auto config = ch10::testing::deepseek_config();
            config.extensions["first_k_dense_replace"] = 2;  // block 1 dense, block 2 MoE
            if (*key != '\0') config.extensions[key] = value;
            auto tokens = torch::randint(0, config.vocab_size, {batch, seq}, generator_for(5, "t"));
            const auto kept = kept_per_block(
                [&, mode = mode](int64_t layers) {
                  config.n_layers = layers;
                  auto tp =
                      std::make_shared<ch10::TensorParallel>(ch10::TensorParallel{world(), sp});
                  auto model = ch10::make_model(config, tp);
                  apply_recompute(model, {mode, 1});
                  use_precision(precision, nullptr);
                  return model;
                },
                {tokens, tokens}, 3);
            const TensorParallelShare share{t, world()->rank(), sp};
            for (int64_t layer : {1, 2})  // the block added: 1 dense, 2 MoE
              EXPECT_EQ(kept[layer - 1], deepseek_block_activation_bytes(
                                             config, layer, batch, seq, mode, share, {}, precision))
                  << "block " << layer;
          }
        }
      }
    }
  }
}
