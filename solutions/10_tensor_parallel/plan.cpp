// Chapter 10: tensor parallelism's memory and communication formulas.

#include "10_tensor_parallel/plan.h"

#include "06_mla/mla.h"
#include "07_moe/moe.h"

#include "fivefold/error.h"
#include "fivefold/seed.h"

namespace fivefold::ch10 {

int64_t parameters_per_rank(const ch02::TransformerShape& s, int t, int rank) {
  s.validate();
  FIVEFOLD_CHECK(t >= 1 && rank >= 0 && rank < t, "parameters_per_rank: rank ", rank, " of ", t);
  FIVEFOLD_CHECK(!s.biases && !s.layer_norm && s.learned_positions == 0,
                 "parameters_per_rank: a Llama-shaped model (RMSNorm, no biases)");
  const int64_t h = s.d_model;
  const auto mine = [&](int64_t n) { return split_sizes(n, t)[static_cast<size_t>(rank)]; };
  const int64_t q = s.n_heads * s.head_dim, kv = s.n_kv_heads * s.head_dim;
  const int64_t matrices = s.gated_mlp ? 3 : 2;
  // Split: q, k, v by output rows, o by input columns; the MLP by its hidden features.
  // Key/value rows: this rank's share, or, with fewer key/value heads than ranks, the one head
  // it shares with t / n_kv others.
  const int64_t kv_rows = s.n_kv_heads % t == 0 ? mine(kv) : s.head_dim;
  const int64_t layer = (mine(q) + 2 * kv_rows) * h + h * mine(q) + matrices * h * mine(s.d_ff);
  const int64_t rows = mine(s.vocab_size) * h;  // this rank's vocabulary rows
  return s.n_layers * layer + (2 * s.n_layers + 1) * h + rows + (s.tied_embeddings ? 0 : rows);
}

RankBlock rank_block(const ch03::ModelConfig& config, int64_t layer, int t, int rank,
                     bool sequence_parallel) {
  FIVEFOLD_CHECK(t >= 1 && rank >= 0 && rank < t && config.n_heads % t == 0, "rank_block: rank ",
                 rank, " of ", t, " for ", config.n_heads, " heads");
  const auto mine = [&](int64_t n) { return split_sizes(n, t)[static_cast<size_t>(rank)]; };
  const int64_t d = config.d_model, h = config.n_heads / t;
  RankBlock b;
  b.vectors = 2 * d;  // the two norms
  using Rows = RankMatrix::Rows;
  const auto multiplies = [&](int64_t in, int64_t out, Rows rows = Rows::Every) {
    b.matrices.push_back({in, out, rows});
  };
  int64_t whole = 0;  // matrices kept whole that every token multiplies
  if (config.extensions.is_null() || !config.extensions.contains("kv_lora_rank")) {
    const ch02::TransformerShape s = rank_shape(config.shape(), t, rank);
    const int64_t kv = (config.n_kv_heads % t == 0 ? s.n_kv_heads : 1) * s.head_dim;
    const int64_t q = s.n_heads * s.head_dim;
    for (int64_t out : {q, kv, kv}) multiplies(d, out);  // q, k, v
    multiplies(q, d);                                    // o
  } else {  // chapter 06's MLA: the heads split, the down-projections whole
    const auto m = ch06::MlaConfig::from_json(config.extensions);
    const int64_t qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
    whole = d * (m.kv_lora_rank + m.qk_rope_head_dim) + d * m.q_lora_rank;
    if (m.q_lora_rank > 0) multiplies(d, m.q_lora_rank);              // q_a_proj
    multiplies(m.q_lora_rank > 0 ? m.q_lora_rank : d, h * qk);        // q_b_proj, or q_proj
    multiplies(d, m.kv_lora_rank + m.qk_rope_head_dim);               // kv_a_proj_with_mqa
    multiplies(m.kv_lora_rank, h * (m.qk_nope_head_dim + m.v_head_dim));  // kv_b_proj
    multiplies(h * m.v_head_dim, d);                                  // o_proj
    b.vectors += m.q_lora_rank + m.kv_lora_rank;  // the latents' norms
    b.partial = whole + m.q_lora_rank + m.kv_lora_rank;
  }
  const auto moe = ch07::has_routed_experts(config) ? ch07::MoeConfig::from_json(config.extensions)
                                                    : ch07::MoeConfig{};
  const auto mlp = [&](int64_t features, Rows rows) {  // gate and up, then down
    if (features == 0) return;
    multiplies(d, features, rows);
    multiplies(d, features, rows);
    multiplies(features, d, rows);
  };
  b.crossings = 4;
  if (ch07::has_routed_experts(config) && moe.is_moe_layer(layer)) {
    const int64_t f = moe.moe_intermediate_size;
    mlp(mine(f * moe.n_shared_experts), Rows::Every);
    multiplies(d, moe.n_routed_experts, Rows::Routed);
    mlp(f, Rows::Expert);
    b.routed = moe.n_routed_experts * 3 * d * f;
    b.vectors += moe.n_routed_experts;
    b.frozen = moe.n_routed_experts;
    if (moe.n_shared_experts == 0) b.crossings = 2;  // the experts alone are not split
  } else {
    mlp(mine(config.d_ff), Rows::Every);
  }
  for (const RankMatrix& w : b.matrices)
    (w.rows == Rows::Every ? b.products : w.rows == Rows::Routed ? b.router : b.per_assignment) +=
        w.in * w.out;
  // Under sequence parallelism every whole parameter has seen only this rank's part of the
  // sequence; the bias has no gradient.
  if (sequence_parallel) b.partial = whole + b.router + b.routed + b.vectors - b.frozen;
  if (t == 1) b.partial = 0;  // one rank's gradient is the whole
  return b;
}

double TensorParallelTraffic::wire_bytes() const {
  return all_reduce.wire_bytes + all_gather.wire_bytes + reduce_scatter.wire_bytes;
}

ch02::TransformerShape rank_shape(const ch02::TransformerShape& shape, int t, int rank) {
  ch02::TransformerShape mine = shape;
  mine.n_heads = shape.n_heads / t;
  mine.n_kv_heads = std::max<int64_t>(1, shape.n_kv_heads / t);
  mine.d_ff = split_sizes(shape.d_ff, t)[static_cast<size_t>(rank)];
  return mine;
}

TensorParallelTraffic tensor_parallel_traffic(const ch02::TransformerShape& shape, int t, int64_t b,
                                              int64_t s, bool sequence_parallel,
                                              int64_t element_bytes) {
  return tensor_parallel_traffic(4 * shape.n_layers + 2, shape.d_model, t, b, s, sequence_parallel,
                                 element_bytes);
}

TensorParallelTraffic tensor_parallel_traffic(int64_t crossings, int64_t d_model, int t, int64_t b,
                                              int64_t s, bool sequence_parallel,
                                              int64_t element_bytes) {
  FIVEFOLD_CHECK(t >= 1 && b >= 1 && s >= 1, "tensor_parallel_traffic: t, b and s must be >= 1");
  const int64_t activation = b * s * d_model * element_bytes;  // one [b, s, h] tensor
  const int64_t per_token = b * s * element_bytes;                   // one number per token
  const double ring = static_cast<double>(t - 1) / static_cast<double>(t);
  TensorParallelTraffic traffic;
  auto add = [](Traffic& k, int64_t calls, int64_t bytes, double wire_factor) {
    k.calls += calls;
    k.payload_bytes += calls * bytes;
    k.wire_bytes += static_cast<double>(calls * bytes) * wire_factor;
  };
  add(traffic.all_reduce, 3, per_token, 2 * ring);  // the loss: max, Σ exp, target logit
  if (!sequence_parallel) {
    // g after attention and the MLP, f before them (backward); the embedding's g, the head's f.
    add(traffic.all_reduce, crossings, activation, 2 * ring);
  } else {
    // Each all-reduce becomes an all-gather and a reduce-scatter: entering a split layer
    // gathers (backward: reduce-scatters), leaving it reduce-scatters (backward: gathers).
    // + the head's gather (forward) and the embedding's reduce-scatter's gather (backward).
    // Each block's entry gathers once more in backward: its products kept the rank's part of
    // the norm's output (GatheredSequence), half of the blocks' crossings.
    add(traffic.all_gather, crossings + (crossings - 2) / 2, activation, ring);
    // + the embedding's reduce-scatter (forward) and the head's gather's (backward).
    add(traffic.reduce_scatter, crossings, activation, ring);
  }
  return traffic;
}

int64_t sequence_parallel_activation_savings(const ch02::TransformerShape& shape, int t, int rank,
                                             int64_t b, int64_t s, int64_t element_bytes) {
  FIVEFOLD_CHECK(t >= 1 && rank >= 0 && rank < t, "sequence_parallel_activation_savings: rank ",
                 rank, " of ", t);
  const int64_t h = shape.d_model;
  const int64_t tokens = b * s, held = b * split_sizes(s, t)[static_cast<size_t>(rank)];
  // Kept per token outside the split layers, per norm: its input, x² (the mean keeps it), x·rms⁻¹
  // and rms⁻¹: 3h + 1. Two norms a layer (the second's input is the residual after attention),
  // and the final one. And the two block norms' outputs (h each), which the split products keep
  // as the rank's part and gather again in backward (the head keeps the final norm's gathered).
  const int64_t per_token = (2 * shape.n_layers + 1) * (3 * h + 1) + 2 * shape.n_layers * h;
  return (tokens - held) * per_token * element_bytes;
}

}  // namespace fivefold::ch10
