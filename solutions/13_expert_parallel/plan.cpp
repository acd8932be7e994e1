// Chapter 13: the per-rank plan of expert parallelism.

#include "13_expert_parallel/plan.h"

#include "fivefold/error.h"

namespace fivefold::ch13 {

ExpertParallelPlan expert_parallel_plan(const ch03::ModelConfig& config, int64_t ep, int64_t tokens,
                                        int64_t element_size) {
  check_expert_parallel(config, ep, ep);
  FIVEFOLD_CHECK(ch07::has_routed_experts(config),
                 "expert_parallel_plan: the model has no routed experts");
  FIVEFOLD_CHECK(tokens >= 0, "expert_parallel_plan: tokens must be >= 0, got ", tokens);
  const auto moe = ch07::MoeConfig::from_json(config.extensions);
  const int64_t e = moe.n_routed_experts, k = moe.num_experts_per_tok, d = config.d_model;
  ExpertParallelPlan p;
  p.ep = ep;
  p.experts_per_rank = e / ep;
  const int64_t total = ch07::count_parameters(config).total;
  int64_t routed = 0;  // every routed expert's numbers
  for (int64_t i = 0; i < config.n_layers; ++i) {
    const ch07::BlockParameters block = ch07::block_parameters(config, i);
    p.moe_layers += block.experts > 0 ? 1 : 0;
    routed += block.experts * block.expert;
  }
  p.expert_parameters = routed / ep;
  p.replicated_parameters = total - routed;
  p.parameters_per_rank = p.expert_parameters + p.replicated_parameters;
  p.memory_bytes = 16 * p.parameters_per_rank;
  // Even routing: each rank sends tokens·k/ep rows to every rank and receives as many. Integer
  // arithmetic is exact when ep divides tokens·k (else the expectation is rounded down).
  const std::vector<int64_t> rows(static_cast<size_t>(ep), tokens * k / ep);
  const auto layer = expert_parallel_traffic(rows, rows, 0, e, d, element_size);
  p.per_micro_batch = {layer.calls * p.moe_layers, layer.payload_bytes * p.moe_layers,
                       layer.wire_bytes * p.moe_layers, layer.forward_payload_bytes * p.moe_layers};
  return p;
}

}  // namespace fivefold::ch13
