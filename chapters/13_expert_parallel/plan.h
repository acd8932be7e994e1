#pragma once
/// @file plan.h
/// @brief Chapter 13's formulas for `fivefold plan --ep N`: the parameters each expert-parallel
/// rank holds, their fp32 training memory, and what its all-to-alls move per micro-batch when the
/// router spreads the assignments evenly. Derivations: notes/13_expert_parallel.md.

#include <cstdint>

#include "03_transformer/model.h"
#include "13_expert_parallel/expert_parallel.h"

namespace fivefold::ch13 {

/// One expert-parallel rank's share of a Mixture-of-Experts model.
struct ExpertParallelPlan {
  int64_t ep = 1;                     ///< expert-parallel ranks
  int64_t moe_layers = 0;             ///< layers with routed experts
  int64_t experts_per_rank = 0;       ///< routed experts held per MoE layer: E/ep
  int64_t expert_parameters = 0;      ///< numbers of the routed experts held (all MoE layers)
  int64_t replicated_parameters = 0;  ///< everything else: attention, dense MLPs, routers, shared
  /// expert_parameters + replicated_parameters: the numel of the rank's model.
  int64_t parameters_per_rank = 0;
  int64_t memory_bytes = 0;  ///< 16 bytes per parameter (fp32 weight, gradient, AdamW's two)
  /// One micro-batch's all-to-alls over every MoE layer, forward and backward, when each of
  /// `tokens`·k assignments goes to a rank with probability 1/ep (so tokens·k/ep rows to each).
  ExpertParallelTraffic per_micro_batch;
};

/// The plan for `config` (a model with routed experts) at `ep` ranks, for micro-batches of
/// `tokens` tokens on each rank, fp32 (element_size 4). Throws fivefold::Error as
/// check_expert_parallel does (ep not dividing E).
ExpertParallelPlan expert_parallel_plan(const ch03::ModelConfig& config, int64_t ep,
                                        int64_t tokens, int64_t element_size = 4);

}  // namespace fivefold::ch13
