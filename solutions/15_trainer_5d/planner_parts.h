#pragma once
// Chapter 15's planner, between its two files: the step-time model (planner.cpp) gives the search
// (search.cpp) a layout's estimate before and after the pipeline's timeline.
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "07_moe/moe.h"
#include "10_tensor_parallel/plan.h"

#include "11_pipeline_parallel/schedule.h"
#include "15_trainer_5d/planner.h"

namespace fivefold::ch15 {

// What the step-time model needs of the model alone, block by block: the same for every layout
// of a workload, so the search computes it once.
struct ModelTerms {
  std::vector<ch07::BlockParameters> block;  // chapter 07's counts
  // A token's forward products, its causal attention's forward FLOPs (half the square) and the
  // attention's training FLOPs (chapter 12's blockwise kernel), block by block.
  std::vector<double> products, attention, attention_training;
  int64_t experts = 0, per_token = 0;  // E and k of the MoE blocks (0 without experts)
  // The blocks under tp (chapter 10's rank_block for tp rank 0): a dense block's and a MoE
  // block's share, by t (every divisor of the heads) and sequence parallelism. MLA's are priced
  // by it; every model's matrices by their shapes (a product's latency and bytes).
  std::map<std::pair<int64_t, bool>, std::pair<ch10::RankBlock, ch10::RankBlock>> split;
};
ModelTerms model_terms(const Workload& work);

// The estimate with the pipeline's timeline left out: a step of m·v micro-batches back to back
// (exact without pp, a lower bound with it), for a rank that keeps `in_flight` micro-batches at
// once. `costs` receives the pipeline simulator's costs of one micro-batch through one stage.
// `terms` is model_terms(work).
StepEstimate estimate_before_pipeline(const Workload& work, const ModelTerms& terms,
                                      const Layout& layout, const Cluster& cluster,
                                      ch14::Precision precision, int64_t in_flight,
                                      ch11::UnitCosts& costs);

// The pipeline's idle time (chapter 11's simulator run on the modelled costs) added to `e`.
void add_pipeline(StepEstimate& e, const ch11::Simulation& timeline);

// The layout's schedule of m micro-batches per data-parallel rank.
ch11::Schedule schedule_of(const Layout& layout, int64_t m);

// The most micro-batches any rank keeps at once in `timeline`.
int64_t most_in_flight(const ch11::Simulation& timeline);

}  // namespace fivefold::ch15
