// The heart of chapter 06: MLA's training path, latent projection and decoupled RoPE.

#include <tuple>

#include "06_mla/mla.h"

namespace fivefold::ch06 {

torch::Tensor MultiHeadLatentAttentionImpl::forward_naive(const torch::Tensor& x,
                                                          const torch::Tensor& positions) {
  const int64_t batch = x.size(0), seq = x.size(1), heads = n_heads_;
  const int64_t nope = mla_.qk_nope_head_dim, rope = mla_.qk_rope_head_dim, dv = mla_.v_head_dim;
  // Queries, [batch, heads, seq, nope + rope]: a part that sees content, a part that sees
  // positions.
  auto q = queries(x);
  auto q_nope = q.narrow(-1, 0, nope), q_rope = q.narrow(-1, nope, rope);
  // 1. Down: one small latent per position (normalised), and one rotary key for all heads.
  auto down = kv_a_proj_with_mqa(x);                                    // [b, s, d_c + rope]
  auto latent = kv_a_layernorm(down.narrow(-1, 0, mla_.kv_lora_rank));  // [b, s, d_c]
  auto k_rope = down.narrow(-1, mla_.kv_lora_rank, rope).unsqueeze(1);  // [b, 1, s, rope]
  // 2. Positions rotate the decoupled parts only.
  if (encoding) std::tie(q_rope, k_rope) = encoding->encode(q_rope, k_rope, positions);
  // 3. Up: every head's content key and value from the latent.
  auto up = kv_b_proj(latent).view({batch, seq, heads, nope + dv}).transpose(1, 2);
  auto k_nope = up.narrow(-1, 0, nope), v = up.narrow(-1, nope, dv);  // [b, h, s, .]
  // 4. Keys [k_nope | k_rope], the rotary key the same for every head; attention; output.
  auto k = torch::cat({k_nope, k_rope.expand({batch, heads, seq, rope})}, -1);
  auto out = attend(torch::cat({q_nope, q_rope}, -1), k, v, positions, 0);  // [b, h, s, dv]
  return o_proj(out.transpose(1, 2).reshape({batch, seq, heads * dv}));
}

}  // namespace fivefold::ch06
