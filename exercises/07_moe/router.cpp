// Chapter 07 exercise: top-k routing. Read chapters/07_moe/README.md, section "The exercise".
// The loop (README, "How to do an exercise"): cmake --build build --target loop_ch07 &&
//   ctest --test-dir build -L loop_ch07 --output-on-failure; once it passes, the whole
//   chapter: ctest --test-dir build -L ch07 --output-on-failure

#include "07_moe/moe.h"
#include "fivefold/error.h"

namespace fivefold::ch07 {

Routing route(const torch::Tensor& scores, const torch::Tensor& bias, const MoeConfig& c) {
  // Contract: scores [tokens, E] (the router's, differentiable), bias [E] (the balancing bias),
  // k = c.num_experts_per_tok. Return each token's k experts [tokens, k] and their gates
  // [tokens, k]. The bias may change which experts are chosen but never a gate's value, and no
  // gradient may reach it; with c.n_group > 1 a token chooses only within its c.topk_group best
  // groups; c.norm_topk_prob and c.routed_scaling_factor shape the gates as DeepSeek-V3 does
  // (README, "Walk-through": how a group is scored, what the gates are made of). The tests: a
  // hand-worked routing, the gradient by central differences, and DeepSeek-V3's own forward.
  throw NotImplemented("ch07: route (chapters/07_moe/README.md, 'The exercise')");
}

}  // namespace fivefold::ch07
