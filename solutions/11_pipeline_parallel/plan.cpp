// Chapter 11: the pipeline's formulas.

#include "11_pipeline_parallel/plan.h"

#include "11_pipeline_parallel/pipeline.h"

namespace fivefold::ch11 {

PipelinePlan pipeline_plan(const ch02::TransformerShape& shape, int64_t ranks,
                           int64_t virtual_stages, int64_t micro_batches,
                           const std::string& schedule) {
  PipelinePlan plan;
  plan.schedule = make_schedule(schedule, ranks, virtual_stages, micro_batches);
  plan.bubble = bubble_formula(plan.schedule);
  const auto sim = simulate(plan.schedule);
  const auto count = ch02::count_parameters(shape);
  const int64_t h = shape.d_model;
  const int64_t final_norm = shape.layer_norm ? 2 * h : h;
  // A block: its attention, its MLP and its two norms.
  const int64_t per_layer =
      (count.attention + count.mlp + count.norms - final_norm) / shape.n_layers;
  const int64_t table = shape.vocab_size * h;
  for (int64_t r = 0; r < ranks; ++r) {
    RankPlan rank;
    const auto part = stage_part(shape.n_layers, ranks, virtual_stages, r);
    rank.layers.emplace_back(part.first_layer, part.last_layer);
    for (const auto& range : part.more_layers) rank.layers.push_back(range);
    for (const auto& [first, last] : rank.layers) rank.parameters += (last - first) * per_layer;
    if (part.embedding) rank.parameters += count.embedding;
    if (part.head) {
      rank.parameters += final_norm + (shape.tied_embeddings ? table : count.lm_head);
      if (shape.tied_embeddings && part.embedding) rank.parameters -= table;  // one copy (p = 1)
    }
    rank.peak_in_flight = sim.peak_in_flight[static_cast<size_t>(r)];
    plan.ranks.push_back(rank);
  }
  return plan;
}

PipelineTraffic pipeline_traffic(int64_t ranks, int64_t virtual_stages, int64_t micro_batches,
                                 int64_t rank, int64_t rows, int64_t s, int64_t h,
                                 int64_t element_bytes) {
  PipelineTraffic t;
  const int64_t last = ranks * virtual_stages - 1;
  for (int64_t c = 0; c < virtual_stages; ++c) {
    const int64_t stage = c * ranks + rank;
    // Forward to the next stage, backward to the previous one, when it is on another rank.
    const int directions = (stage < last && ranks > 1 ? 1 : 0) + (stage > 0 && ranks > 1 ? 1 : 0);
    t.sends += directions * micro_batches;
    t.payload_bytes += directions * rows * s * h * element_bytes;
  }
  return t;
}

}  // namespace fivefold::ch11
