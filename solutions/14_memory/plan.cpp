// Chapter 14's plan terms: recomputation's FLOPs, and the activations a block keeps.
#include "14_memory/plan.h"

#include <algorithm>

#include "fivefold/error.h"
#include "fivefold/seed.h"

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
                               Recompute mode, const TensorParallelShare& tp) {
  const int64_t t = tp.ranks, r = tp.rank;
  FIVEFOLD_CHECK(t >= 1 && r >= 0 && r < t && config.n_heads % t == 0,
                 "block_activation_bytes: rank ", r, " of ", t, " tensor-parallel ranks for ",
                 config.n_heads, " heads");
  const int64_t d = config.d_model, hd = config.resolved_head_dim();
  // This rank's share: its heads, key/value heads (one, shared, when there are fewer than
  // ranks), MLP width, and the tokens of the norms and the residual stream.
  const int64_t h = config.n_heads / t, kv = std::max<int64_t>(1, config.n_kv_heads / t);
  const int64_t f = split_sizes(config.d_ff, t)[static_cast<size_t>(r)];
  const int64_t own = tp.sequence_parallel ? split_sizes(seq, t)[static_cast<size_t>(r)] : seq;
  // The residual stream's, per token of this rank: each norm keeps x², 1/rms and x/rms (2d + 1),
  // the residual after attention d, the block's output d. Without sequence parallelism each
  // norm's output (d) is kept too, by the products it feeds; with it, the all-gathered output
  // over the whole sequence is (2d a token of the sequence, below).
  const int64_t residual = 4 * batch * own * (6 * d + 2);
  const int64_t gathered = 4 * batch * seq * 2 * d;
  // RoPE's cos and sin, [seq, hd / 2] each: made in every layer's forward, kept by its products.
  const int64_t rotary = 4 * seq * hd;
  switch (mode) {
    case Recompute::Full:
      return 4 * batch * own * d;
    case Recompute::Selective:  // the core's inputs: q and, at h_kv heads, k and v
      return residual + gathered +
             4 * batch * seq * (2 * h * hd + 2 * kv * hd + 4 * f) + rotary;
    case Recompute::None:
      break;
  }
  // q/√hd, k and v repeated to h heads, the heads' output merged; the probabilities [b, h, s, s]
  // (fp32) and the causal mask [s, s] (bool), and with fewer key/value heads than heads the index
  // repeat_interleave gathers them with ([h] int64, twice).
  const int64_t grouped = kv < h ? 2 * 8 * h : 0;
  return residual + gathered + 4 * batch * seq * (4 * h * hd + 4 * f) +
         4 * batch * h * seq * seq + seq * seq + rotary + grouped;
}

}  // namespace fivefold::ch14
