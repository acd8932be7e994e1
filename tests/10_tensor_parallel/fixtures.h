#pragma once
// What chapter 10's tests share: a model whose sizes exercise every split, and its batches.

#include "03_transformer/data.h"
#include "03_transformer/model.h"

namespace fivefold::ch10::testing {

/// 2 layers, d_model 32, 8 query and 4 key/value heads (grouped-query attention over 1, 2 or 4
/// ranks), RoPE, d_ff 70 (17.5 per rank at tp 4: split unevenly), the byte vocabulary (259 rows:
/// 130 + 129 at tp 2).
inline ch03::ModelConfig tp_config(bool tied) {
  ch03::ModelConfig c;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 8;
  c.n_kv_heads = 4;
  c.d_ff = 70;
  c.rope_theta = 10000;
  c.tied_embeddings = tied;
  return c;
}

/// DeepSeek-V3 in miniature (chapters 06 and 07): MLA with a query latent in every block (8
/// heads), a dense first layer, then 8 routed experts (2 per token, with the balancing bias) and a
/// shared expert of width 24 (uneven over 4 ranks... 6 each), RoPE on the decoupled part.
inline ch03::ModelConfig deepseek_config() {
  ch03::ModelConfig c = tp_config(false);
  c.n_kv_heads = c.n_heads;
  c.extensions = {{"q_lora_rank", 16},
                  {"kv_lora_rank", 16},
                  {"qk_nope_head_dim", 8},
                  {"qk_rope_head_dim", 4},
                  {"v_head_dim", 6},
                  {"n_routed_experts", 8},
                  {"num_experts_per_tok", 2},
                  {"n_shared_experts", 1},
                  {"moe_intermediate_size", 22},
                  {"n_group", 1},
                  {"topk_group", 1},
                  {"first_k_dense_replace", 1},
                  {"fivefold_bias_update_speed", 0.01}};
  return c;
}

/// Batches of 4 rows x 13 tokens (13 positions: uneven parts under sequence parallelism).
inline const ch03::BatchSampler& tp_batches() {
  static const ch03::TokenDataset data(
      ch03::ByteTokenizer::encode(ch03::synthetic_corpus(0, ch03::Split::Train, 400)));
  static const ch03::BatchSampler sampler(data, 13, 4, 1);
  return sampler;
}

}  // namespace fivefold::ch10::testing
