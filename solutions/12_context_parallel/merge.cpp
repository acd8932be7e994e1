// The heart of chapter 12: merging two partial attention results (the online softmax).

#include "12_context_parallel/attention.h"

namespace fivefold::ch12 {

ch03::AttentionOutput merge_attention(const ch03::AttentionOutput& a,
                                      const ch03::AttentionOutput& b) {
  // Over the union of the keys, Σ exp(s) = exp(lse_a) + exp(lse_b): the new LSE.
  auto lse = torch::logaddexp(a.lse, b.lse);  // [batch, heads, seq_q]
  // Each part's output was divided by its own Σ exp(s); reweight it by its share of the total,
  // exp(lse_part − lse). A query that sees nothing at all (lse −inf) would give −inf − (−inf):
  // subtract 0 instead, so both weights are exp(−inf) = 0 and its output stays 0.
  auto safe = lse.masked_fill(lse == -INFINITY, 0.0);
  auto weight_a = (a.lse - safe).exp().unsqueeze(-1), weight_b = (b.lse - safe).exp().unsqueeze(-1);
  return {weight_a * a.output + weight_b * b.output, lse};
}

}  // namespace fivefold::ch12
