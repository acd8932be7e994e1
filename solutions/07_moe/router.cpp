// The heart of chapter 07: top-k routing with group limits and renormalised gates.

#include <algorithm>
#include <cmath>

#include "07_moe/moe.h"

namespace fivefold::ch07 {

Routing route(const torch::Tensor& scores, const torch::Tensor& bias, const MoeConfig& c) {
  const int64_t tokens = scores.size(0), experts = scores.size(1);
  // The bias decides who is chosen, never how much a chosen expert weighs.
  auto choice = scores.detach() + bias.detach();  // [tokens, E]
  if (c.n_group > 1) {
    // A group's score: the sum of its two best experts. Keep each token's topk_group best groups
    // and rule the others out entirely.
    const int64_t per_group = experts / c.n_group;
    auto group_scores =
        std::get<0>(
            choice.view({tokens, c.n_group, per_group}).topk(std::min<int64_t>(2, per_group), -1))
            .sum(-1);  // [tokens, groups]
    auto kept_groups = std::get<1>(group_scores.topk(c.topk_group, -1));
    auto allowed = torch::zeros({tokens, c.n_group}, torch::kBool).scatter_(1, kept_groups, true);
    allowed = allowed.unsqueeze(-1).expand({tokens, c.n_group, per_group}).reshape({tokens, -1});
    choice = choice.masked_fill(allowed.logical_not(), -INFINITY);
  }
  Routing r;
  r.experts = std::get<1>(choice.topk(c.num_experts_per_tok, -1));  // [tokens, k]
  r.gates = scores.gather(1, r.experts);                            // unbiased, differentiable
  if (c.norm_topk_prob) r.gates = r.gates / (r.gates.sum(-1, /*keepdim=*/true) + 1e-20);
  r.gates = r.gates * c.routed_scaling_factor;
  return r;
}

}  // namespace fivefold::ch07
