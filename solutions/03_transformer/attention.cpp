// The heart of chapter 03: causal self-attention, written out step by step.

#include <cmath>

#include "03_transformer/model.h"

namespace fivefold::ch03 {

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, torch::Tensor* lse) {
  const int64_t n_heads = q.size(1), n_kv_heads = k.size(1), head_dim = q.size(3);
  const int64_t seq_q = q.size(2), seq_k = k.size(2);
  torch::Tensor keys = k, values = v;
  if (n_kv_heads != n_heads) {  // grouped-query: kv head j serves query heads j·g .. j·g + g - 1
    keys = k.repeat_interleave(n_heads / n_kv_heads, 1);  // [batch, n_heads, seq_k, head_dim]
    values = v.repeat_interleave(n_heads / n_kv_heads, 1);
  }
  // Every query against every key, scaled so the scores' variance does not grow with head_dim
  // (scaling q rather than the scores touches head_dim instead of seq_k numbers per query).
  auto scores = torch::matmul(q / std::sqrt(static_cast<double>(head_dim)), keys.transpose(-2, -1));
  // [batch, n_heads, seq_q, seq_k]. The queries are the last seq_q positions: query i sits at
  // position p = seq_k - seq_q + i and may look at keys j <= p only.
  auto future = torch::ones({seq_q, seq_k}, torch::kBool).triu(seq_k - seq_q + 1);
  scores.masked_fill_(future, -INFINITY);  // in place: one pass, no new [.., seq_q, seq_k]
  // Each query's log Σ exp(score) over the keys it sees, [batch, n_heads, seq_q], on request.
  if (lse != nullptr) *lse = torch::logsumexp(scores, -1);
  auto probs = torch::softmax(scores, -1);  // rows sum to 1
  return torch::matmul(probs, values);      // [batch, n_heads, seq_q, head_dim]
}

}  // namespace fivefold::ch03
