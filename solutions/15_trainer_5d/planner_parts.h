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

// One micro-batch on the rank the estimate prices (tp rank 0, the one that holds the most, of the
// busiest pipeline rank).
struct MicroBatchShare {
  int64_t rows = 0;     // its rows on one data-parallel rank
  double tokens = 0;    // their tokens on this rank (its share of the sequence under cp)
  double routes = 1;    // the share of those tokens the rank routes (its own part under sp)
  int64_t element = 4;  // bytes a number on the wire (chapter 14's precision)
};

// The pipeline's (virtual) stage with the most work in its blocks, as chapter 11 splits them.
struct BusiestStage {
  std::vector<std::pair<int64_t, int64_t>> stages;  // every virtual stage's blocks [first, last)
  std::vector<double> work;     // a token's training FLOPs in each stage's blocks
  size_t largest = 0;           // the busiest stage
  int64_t first = 0, last = 0;  // its blocks
  double products = 0, attention = 0, attention_training = 0;  // a token's FLOPs in its blocks
  double moe_layers = 0;  // MoE blocks a stage, over the stages of the rank that holds it
  int64_t partial = 0;    // that rank's partial gradients, which tp sums once a step
};

// Chapter 11's split of the blocks over the p·v virtual stages, and the one with the most work:
// `rank_products` is a token's forward FLOPs of each block's products on this rank, `rank_blocks`
// chapter 10's split of each block (MLA's; empty for Llama's).
BusiestStage busiest_stage(const Layout& layout, const ModelTerms& terms,
                           const std::vector<double>& rank_products,
                           const std::vector<ch10::RankBlock>& rank_blocks);

// The link a group of `size` ranks `stride` apart crosses (communication.cpp).
const Link& group_link(const Cluster& cluster, int64_t stride, int64_t size);
// Ring collectives over n ranks: the wire bytes one rank sends for an all-reduce of `bytes`, and
// for an all-gather or reduce-scatter whose whole tensor is `bytes` (notes/08).
double all_reduce_wire(double bytes, int64_t n);
double gather_wire(double bytes, int64_t n);

// Each parallelism's communication for one micro-batch through `stage` on `cluster`, in seconds
// (communication.cpp). Tensor parallelism's in forward (backward has as many):
double tp_forward_seconds(const Workload& work, const Layout& layout, const Cluster& cluster,
                          const MicroBatchShare& share, const BusiestStage& stage,
                          const std::vector<ch10::RankBlock>& rank_blocks);
// Context parallelism's left exposed, forward and backward, beside the stage's attention
// forward of `attention` seconds (backward: twice that).
std::pair<double, double> cp_seconds(const Workload& work, const ModelTerms& terms,
                                     const Layout& layout, const Cluster& cluster,
                                     const MicroBatchShare& share, const BusiestStage& stage,
                                     double attention);
// Expert parallelism's all-to-alls, forward and backward.
std::pair<double, double> ep_seconds(const Workload& work, const ModelTerms& terms,
                                     const Layout& layout, const Cluster& cluster,
                                     const MicroBatchShare& share, const BusiestStage& stage);
// One pipeline send of the stage's output (or of its input's gradient).
double pp_send_seconds(const Workload& work, const Layout& layout, const Cluster& cluster,
                       const MicroBatchShare& share);
// A step's gradient reduction over the data-parallel ranks that hold the same parameters, for a
// rank that trains `held` replicated and `experts` expert parameters, beside a backward of
// `backward` seconds; ZeRO-3 gathers for each of the `micro_batches`.
double dp_seconds(const Layout& layout, const Cluster& cluster, int64_t held, int64_t experts,
                  int64_t element, int64_t micro_batches, double backward);
// tp's sum of `partial` gradients once a step.
double tp_partial_seconds(const Layout& layout, const Cluster& cluster, int64_t partial);

// The layout's schedule of m micro-batches per data-parallel rank.
ch11::Schedule schedule_of(const Layout& layout, int64_t m);

// The most micro-batches any rank keeps at once in `timeline`.
int64_t most_in_flight(const ch11::Simulation& timeline);

}  // namespace fivefold::ch15
