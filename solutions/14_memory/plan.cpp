// Chapter 14's plan terms: recomputation's FLOPs, and the activations a block keeps.
#include "14_memory/plan.h"

namespace fivefold::ch14 {

int64_t recomputed_layers(int64_t n_layers, int64_t every) {
  return (n_layers + every - 1) / every;
}

double training_flops_per_token(const ch02::TransformerShape& shape, int64_t context,
                                const RecomputeConfig& config) {
  const ch02::FlopBreakdown forward = ch02::forward_flops_per_token(shape, context);
  double again = 0;  // forward FLOPs run a second time in backward
  if (config.mode == Recompute::Full) {
    const double per_layer = (forward.total() - forward.lm_head) / static_cast<double>(shape.n_layers);
    again = per_layer * static_cast<double>(recomputed_layers(shape.n_layers, config.every));
  } else if (config.mode == Recompute::Selective) {
    again = forward.attention_scores + forward.attention_values;
  }
  return 3 * forward.total() + again;
}

int64_t block_activation_bytes(const ch03::ModelConfig& config, int64_t batch, int64_t seq,
                               Recompute mode) {
  const int64_t d = config.d_model, f = config.d_ff, h = config.n_heads, kv = config.n_kv_heads;
  const int64_t hd = config.resolved_head_dim(), tokens = batch * seq;
  // RoPE's cos and sin, [seq, hd / 2] each: made in every layer's forward, kept by its products.
  const int64_t rotary = 4 * seq * hd;
  switch (mode) {
    case Recompute::Full:
      return 4 * tokens * d;
    case Recompute::Selective:
      return 4 * tokens * (10 * d + 2 * kv * hd + 4 * f + 2) + rotary;
    case Recompute::None:
      break;
  }
  // The probabilities [b, h, s, s] (fp32) and the causal mask [s, s] (bool), and with fewer
  // key/value heads than heads the index repeat_interleave gathers them with ([h] int64, twice).
  const int64_t grouped = kv < h ? 2 * 8 * h : 0;
  return 4 * tokens * (12 * d + 4 * f + 2) + 4 * batch * h * seq * seq + seq * seq + rotary +
         grouped;
}

}  // namespace fivefold::ch14
