// Chapter 13 exercise: dispatch and combine over the expert-parallel ranks.
//
// Write ExpertParallelDispatcher::dispatch and ::combine, declared in
// chapters/13_expert_parallel/expert_parallel.h. dispatch: sort this rank's kept assignments by
// expert (chapter 07's LocalDispatcher does it), tell every rank how many rows you send to each
// of its experts (an all-to-all of E counts), send the rows (all_to_all, which autograd can
// differentiate), then regroup what arrived by local expert. Keep in an ExchangePlan (the
// route_back field) what combine needs to undo each step, in reverse order.
// The loop (README, "How to do an exercise"): cmake --build build --target loop_ch13 &&
//   ctest --test-dir build -L loop_ch13 --output-on-failure; once it passes, the whole
//   chapter: ctest --test-dir build -L ch13 --output-on-failure

#include "13_expert_parallel/expert_parallel.h"
#include "fivefold/error.h"

namespace fivefold::ch13 {

ch07::DispatchedTokens ExpertParallelDispatcher::dispatch(const torch::Tensor& x,
                                                          const torch::Tensor& experts,
                                                          const torch::Tensor& kept,
                                                          int64_t n_experts) {
  (void)x;
  (void)experts;
  (void)kept;
  (void)n_experts;
  throw NotImplemented(
      "ch13::ExpertParallelDispatcher::dispatch (chapters/13_expert_parallel/README.md, \"The "
      "exercise\")");
}

torch::Tensor ExpertParallelDispatcher::combine(const torch::Tensor& outputs,
                                                const ch07::DispatchedTokens& dispatched,
                                                const torch::Tensor& gates, int64_t tokens,
                                                int64_t k) {
  (void)outputs;
  (void)dispatched;
  (void)gates;
  (void)tokens;
  (void)k;
  throw NotImplemented(
      "ch13::ExpertParallelDispatcher::combine (chapters/13_expert_parallel/README.md, \"The "
      "exercise\")");
}

}  // namespace fivefold::ch13
