// Chapter 13, the exercise: dispatch and combine over the expert-parallel ranks.
//
// Tokens leave this rank grouped by the rank holding their expert and come back in the same
// order: the two all-to-alls are mirror images, and so are the permutations around them.

#include "13_expert_parallel/expert_parallel.h"

namespace fivefold::ch13 {

ch07::DispatchedTokens ExpertParallelDispatcher::dispatch(const torch::Tensor& x,
                                                          const torch::Tensor& experts,
                                                          const torch::Tensor& kept,
                                                          int64_t n_experts) {
  const int64_t ep = ep_->size(), local_experts = n_experts / ep;
  ExchangePlan plan;
  // 1. Permute: this rank's kept assignments sorted by global expert. Experts are placed in
  //    consecutive ranges, so the rows for rank j are one run: experts j·E/ep .. (j+1)·E/ep − 1.
  plan.local = ch07::LocalDispatcher().dispatch(x, experts, kept, n_experts);
  const auto& count = plan.local.rows_per_expert;  // [E]

  // 2. Exchange the counts: rank j receives, from every source, its counts for j's experts.
  //    received[s·L + l] = rows source s sends for local expert l (L = E/ep).
  const std::vector<int64_t> per_rank(static_cast<size_t>(ep), local_experts);
  const auto received =
      ep_->all_to_all(torch::tensor(count, torch::kLong), per_rank, per_rank);  // [ep·L]
  const auto* in = received.data_ptr<int64_t>();
  plan.send_sizes.assign(static_cast<size_t>(ep), 0);
  plan.recv_sizes.assign(static_cast<size_t>(ep), 0);
  for (int64_t j = 0; j < ep; ++j) {
    for (int64_t l = 0; l < local_experts; ++l) {
      plan.send_sizes[static_cast<size_t>(j)] += count[static_cast<size_t>(j * local_experts + l)];
      plan.recv_sizes[static_cast<size_t>(j)] += in[j * local_experts + l];
    }
  }

  // 3. The tokens travel: [rows received, d], grouped by source rank, then by local expert.
  const auto arrived = all_to_all(plan.local.tokens, plan.send_sizes, plan.recv_sizes, ep_);

  // 4. Regroup by local expert (the sources in rank order within an expert): chunk (s, l) starts
  //    where source s's rows start, after its rows for experts before l.
  std::vector<int64_t> order, rows_per_expert(static_cast<size_t>(local_experts), 0);
  for (int64_t l = 0; l < local_experts; ++l) {
    int64_t source_start = 0;
    for (int64_t s = 0; s < ep; ++s) {
      int64_t start = source_start;
      for (int64_t e = 0; e < l; ++e) start += in[s * local_experts + e];
      const int64_t rows = in[s * local_experts + l];
      for (int64_t i = 0; i < rows; ++i) order.push_back(start + i);
      rows_per_expert[static_cast<size_t>(l)] += rows;
      source_start += plan.recv_sizes[static_cast<size_t>(s)];
    }
  }
  plan.order = torch::tensor(order, torch::kLong);

  ch07::DispatchedTokens d;
  d.tokens = arrived.index_select(0, plan.order);  // [rows, d], expert-major
  d.rows_per_expert = std::move(rows_per_expert);
  d.route_back = std::move(plan);
  return d;
}

torch::Tensor ExpertParallelDispatcher::combine(const torch::Tensor& outputs,
                                                const ch07::DispatchedTokens& dispatched,
                                                const torch::Tensor& gates, int64_t tokens,
                                                int64_t k) {
  const auto& plan = std::any_cast<const ExchangePlan&>(dispatched.route_back);
  // The rows go back in fp32 at least, as the tokens came (a bf16 product's result is widened),
  // so that the gate-weighted sum and the traffic are those of an fp32 step.
  const auto rows = ch03::at_least_fp32(outputs);
  // Undo step 4: row order[i] of the source-major layout is the expert-major row i.
  auto source_major = torch::zeros_like(rows).index_copy(0, plan.order, rows);
  // Undo step 3: each output goes back to the rank its token came from, in the order it was sent.
  const auto back = all_to_all(source_major, plan.recv_sizes, plan.send_sizes, ep_);
  // Undo step 1: chapter 07's gate-weighted sum of each token's outputs.
  return ch07::LocalDispatcher().combine(back, plan.local, gates, tokens, k);
}

}  // namespace fivefold::ch13
