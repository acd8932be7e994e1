// Chapter 06 exercise: MLA's training path. Read chapters/06_mla/README.md, section
// "The exercise".
// The loop (README, "How to do an exercise"): cmake --build build --target loop_ch06 &&
//   ctest --test-dir build -L loop_ch06 --output-on-failure; once it passes, the whole
//   chapter: ctest --test-dir build -L ch06 --output-on-failure

#include "06_mla/mla.h"
#include "fivefold/error.h"

namespace fivefold::ch06 {

torch::Tensor MultiHeadLatentAttentionImpl::forward_naive(const torch::Tensor& x,
                                                          const torch::Tensor& positions) {
  // Contract: x [batch, seq, d_model] at `positions` -> [batch, seq, d_model], MLA's attention
  // computed the direct way: queries and keys built in full for every head (n_heads_; the widths
  // nope, rope, d_c, v in mla_), the rotary parts rotated by `encoding` when it is set, causal
  // attention through attend(q, k, v, positions, 0), then o_proj. The module's members hold every
  // weight you need; kv_a_proj_with_mqa's output is two things at once (which?). The tests
  // compare with the absorbed path and the latent cache, and, with nothing compressed, with
  // chapter 03's multi-head attention.
  throw NotImplemented("ch06: forward_naive (chapters/06_mla/README.md, 'The exercise')");
}

}  // namespace fivefold::ch06
