// Chapter 11: the pipeline's formulas.

#include "11_pipeline_parallel/plan.h"

#include <algorithm>

#include "11_pipeline_parallel/pipeline.h"
#include "fivefold/error.h"

namespace fivefold::ch11 {

int64_t block_activation_bytes(const ch02::TransformerShape& shape, int64_t rows, int64_t seq) {
  FIVEFOLD_CHECK(
      shape.gated_mlp && !shape.layer_norm && !shape.biases && shape.learned_positions == 0,
      "activation memory: the formula is for Llama-shaped models (RMSNorm, SwiGLU, "
      "RoPE, no biases), the model this course trains");
  const int64_t n = rows * seq, h = shape.d_model, heads = shape.n_heads, d = shape.head_dim;
  const int64_t q = heads * d, f = shape.d_ff;
  // Per token, in floats: each RMSNorm keeps x², 1/rms, x/rms and its output (3h + 1, twice);
  // attention keeps q/√d, the keys (transposed copy) and values at the query heads' width, and
  // the heads' output reshaped for o_proj (4q); the residual sum after attention and the block's
  // output (2h); SwiGLU keeps gate, silu(gate), up and their product (4f).
  int64_t block = 4 * n * (8 * h + 4 * q + 4 * f + 2);
  block += 4 * rows * heads * seq * seq;                 // softmax's probabilities
  block += seq * seq;                                    // the causal mask (bool)
  block += 4 * seq * d;                                  // RoPE's cos and sin rows, [seq, d/2] each
  if (shape.n_kv_heads < heads) block += 8 * 2 * heads;  // repeat_interleave's index, for k and v
  return block;
}

int64_t stage_activation_bytes(const ch02::TransformerShape& shape, int64_t layers, bool head,
                               int64_t rows, int64_t seq) {
  const int64_t n = rows * seq, h = shape.d_model;
  const int64_t block = block_activation_bytes(shape, rows, seq);
  int64_t bytes = 4 * n * h + layers * block;
  // The final norm (3h + 1) and log-softmax of the logits; the loss and nll's total weight.
  if (head) bytes += 4 * n * (3 * h + 1 + shape.vocab_size) + 8;
  return bytes;
}

PipelinePlan pipeline_plan(const ch02::TransformerShape& shape, int64_t ranks,
                           int64_t virtual_stages, int64_t micro_batches,
                           const std::string& schedule, int64_t rows, int64_t seq) {
  PipelinePlan plan;
  plan.schedule = make_schedule(schedule, ranks, virtual_stages, micro_batches);
  plan.bubble = bubble_formula(plan.schedule);
  const auto sim = simulate(plan.schedule);
  const auto count = ch02::count_parameters(shape);
  const int64_t h = shape.d_model;
  const int64_t final_norm = shape.layer_norm ? 2 * h : h;
  // A block: its attention, its MLP and its two norms.
  const int64_t per_layer =
      (count.attention + count.mlp + count.norms - final_norm) / shape.n_layers;
  const int64_t table = shape.vocab_size * h;
  for (int64_t r = 0; r < ranks; ++r) {
    RankPlan rank;
    const auto part = stage_part(shape.n_layers, ranks, virtual_stages, r);
    rank.layers.emplace_back(part.first_layer, part.last_layer);
    for (const auto& range : part.more_layers) rank.layers.push_back(range);
    for (const auto& [first, last] : rank.layers) rank.parameters += (last - first) * per_layer;
    if (part.embedding) rank.parameters += count.embedding;
    if (part.head) {
      rank.parameters += final_norm + (shape.tied_embeddings ? table : count.lm_head);
      if (shape.tied_embeddings && part.embedding) rank.parameters -= table;  // one copy (p = 1)
    }
    rank.peak_in_flight = sim.peak_in_flight[static_cast<size_t>(r)];
    for (size_t c = 0; c < rank.layers.size(); ++c) {
      const auto [first, last] = rank.layers[c];
      const bool head = static_cast<int64_t>(c) == virtual_stages - 1 && r == ranks - 1;
      rank.activation_bytes.push_back(stage_activation_bytes(shape, last - first, head, rows, seq));
    }
    rank.peak_activation_bytes =
        rank.peak_in_flight *
        *std::max_element(rank.activation_bytes.begin(), rank.activation_bytes.end());
    plan.ranks.push_back(rank);
  }
  return plan;
}

PipelineTraffic pipeline_traffic(int64_t ranks, int64_t virtual_stages, int64_t micro_batches,
                                 int64_t rank, int64_t rows, int64_t s, int64_t h,
                                 int64_t element_bytes) {
  PipelineTraffic t;
  const int64_t last = ranks * virtual_stages - 1;
  for (int64_t c = 0; c < virtual_stages; ++c) {
    const int64_t stage = c * ranks + rank;
    // Forward to the next stage, backward to the previous one, when it is on another rank.
    const int directions = (stage < last && ranks > 1 ? 1 : 0) + (stage > 0 && ranks > 1 ? 1 : 0);
    t.sends += directions * micro_batches;
    t.payload_bytes += directions * rows * s * h * element_bytes;
  }
  return t;
}

}  // namespace fivefold::ch11
