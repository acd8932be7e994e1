// Chapter 07 exercise: top-k routing. Read chapters/07_moe/README.md, section "The exercise",
// then run: ctest --test-dir build -L ch07

#include "07_moe/moe.h"
#include "fivefold/error.h"

namespace fivefold::ch07 {

Routing route(const torch::Tensor& scores, const torch::Tensor& bias, const MoeConfig& c) {
  // scores [tokens, E]; bias [E]; c.num_experts_per_tok = k.
  // 1. choice = scores + bias, both detached: the bias only picks.
  // 2. If c.n_group > 1: view choice as [tokens, groups, E / groups]; a group's score is the sum
  //    of its two best entries (topk); keep each token's c.topk_group best groups and set every
  //    expert outside them to -infinity (masked_fill).
  // 3. experts = indices of the k largest choices per token (topk).
  // 4. gates = the *unbiased* scores of those experts (gather); if c.norm_topk_prob divide by
  //    their sum (+ 1e-20); multiply by c.routed_scaling_factor.
  throw NotImplemented("ch07: route (chapters/07_moe/README.md, 'The exercise')");
}

}  // namespace fivefold::ch07
