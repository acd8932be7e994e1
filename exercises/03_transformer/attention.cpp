// Chapter 03 exercise: causal self-attention. Read chapters/03_transformer/README.md, section
// "The exercise", then run: ctest --test-dir build -L ch03

#include "03_transformer/model.h"
#include "fivefold/error.h"

namespace fivefold::ch03 {

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, torch::Tensor* lse) {
  // q [batch, n_heads, seq_q, head_dim], k and v [batch, n_kv_heads, seq_k, head_dim], and the
  // queries are the last seq_q of the seq_k positions (seq_q == seq_k in training; seq_q == 1
  // when generating with a KV cache).
  // 1. Grouped-query attention: give each query head its key/value head.
  // 2. Scores: q·k^T, scaled by 1/sqrt(head_dim). Shape?
  // 3. Mask the future (key j after query i's position) so that softmax gives it zero weight.
  // 4. If `lse` is given, store each query's log-sum-exp of its masked scores there.
  // 5. Softmax over the keys, then the weighted sum of the values.
  throw NotImplemented(
      "ch03: causal_attention (chapters/03_transformer/README.md, 'The exercise')");
}

}  // namespace fivefold::ch03
