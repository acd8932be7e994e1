// The heart of chapter 02: the matmul FLOPs one token costs, component by component.

#include "02_flops_6np/flops.h"

namespace fivefold::ch02 {

FlopBreakdown forward_flops_per_token(const TransformerShape& s, int64_t context) {
  s.validate();
  const double L = static_cast<double>(s.n_layers);
  const double d = static_cast<double>(s.d_model);
  const double q_width = static_cast<double>(s.n_heads * s.head_dim);      // h · d_head
  const double kv_width = static_cast<double>(s.n_kv_heads * s.head_dim);  // h_kv · d_head
  const double n = static_cast<double>(context);
  FlopBreakdown f;
  // A token's row x [1, d] times W^T [d, out] costs 2·d·out: one multiply and one add per term.
  f.qkv = L * 2 * d * (q_width + 2 * kv_width);
  // Its query row against all `context` keys, and its attention row against all values.
  f.attention_scores = L * 2 * q_width * n;
  f.attention_values = L * 2 * q_width * n;
  f.output_projection = L * 2 * q_width * d;
  f.mlp = L * (s.gated_mlp ? 3 : 2) * 2 * d * static_cast<double>(s.d_ff);
  f.lm_head = 2 * d * static_cast<double>(s.vocab_size);
  return f;
}

double training_flops_per_token(const TransformerShape& s, int64_t context) {
  // y = x W^T has two backward products of the same size: dL/dx = dL/dy W and dL/dW = dL/dy^T x.
  return 3 * forward_flops_per_token(s, context).total();
}

}  // namespace fivefold::ch02
