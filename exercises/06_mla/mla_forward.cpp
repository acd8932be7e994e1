// Chapter 06 exercise: MLA's training path. Read chapters/06_mla/README.md, section
// "The exercise", then run: ctest --test-dir build -L ch06

#include "06_mla/mla.h"
#include "fivefold/error.h"

namespace fivefold::ch06 {

torch::Tensor MultiHeadLatentAttentionImpl::forward_naive(const torch::Tensor& x,
                                                          const torch::Tensor& positions) {
  // x [batch, seq, d_model]; n_heads_ heads; mla_ has the widths (nope, rope, d_c, v).
  // 1. q = queries(x) [b, h, s, nope + rope]; split it into q_nope and q_rope (narrow).
  // 2. kv_a_proj_with_mqa(x) is [b, s, d_c + rope]: the first d_c are the latent (apply
  //    kv_a_layernorm), the last rope are the shared rotary key (make it [b, 1, s, rope]).
  // 3. If `encoding` is set, rotate q_rope and the rotary key together at `positions`:
  //    encoding->encode(q_rope, k_rope, positions).
  // 4. kv_b_proj(latent) viewed as [b, s, h, nope + v] and transposed to [b, h, s, .]: split into
  //    k_nope and v.
  // 5. Keys: [k_nope | rotary key expanded to every head]; queries: [q_nope | q_rope].
  // 6. attend(q, k, v, positions, 0) (causal, this layer's scale) -> [b, h, s, v]; [b, s, h·v];
  //    o_proj.
  throw NotImplemented("ch06: forward_naive (chapters/06_mla/README.md, 'The exercise')");
}

}  // namespace fivefold::ch06
