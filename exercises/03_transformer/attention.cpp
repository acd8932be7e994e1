// Chapter 03 exercise: causal self-attention. Read chapters/03_transformer/README.md, section
// "The exercise".
// The loop (README, "How to do an exercise"): cmake --build build --target loop_ch03 &&
//   ctest --test-dir build -L loop_ch03 --output-on-failure; once it passes, the whole
//   chapter: ctest --test-dir build -L ch03 --output-on-failure

#include "03_transformer/model.h"
#include "fivefold/error.h"

namespace fivefold::ch03 {

torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, torch::Tensor* lse) {
  // Contract: q [batch, n_heads, seq_q, head_dim], k and v [batch, n_kv_heads, seq_k, head_dim]
  // (n_kv_heads divides n_heads); the queries are the last seq_q of the seq_k positions (seq_q ==
  // seq_k in training; seq_q == 1 when generating with a KV cache). Return the attention output
  // [batch, n_heads, seq_q, head_dim], no query attending a later position; if `lse` is given,
  // store there each query's log-sum-exp of the scores it may see. (README, "The exercise": the
  // questions to settle first.) The tests compare with a by-hand loop, with the KV cache's
  // incremental path, and check that a future token cannot change an earlier output.
  throw NotImplemented(
      "ch03: causal_attention (chapters/03_transformer/README.md, 'The exercise')");
}

}  // namespace fivefold::ch03
