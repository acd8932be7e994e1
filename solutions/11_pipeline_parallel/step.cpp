// Chapter 11: the training step with a pipeline, over pp x dp x tp ranks.

#include <algorithm>
#include <map>
#include <utility>

#include "10_tensor_parallel/step.h"
#include "11_pipeline_parallel/pipeline.h"
#include "fivefold/consolidate.h"
#include "fivefold/error.h"

namespace fivefold::ch11 {

namespace {

const char* const kEmbedding = "model.embed_tokens.weight";

}  // namespace

ch09::ModelParallelGroups pipeline_groups(ch03::Transformer& model, const PipelineLayout& layout) {
  ch09::ModelParallelGroups groups;
  if (layout.tp) groups = ch10::tensor_parallel_groups(model, *layout.tp);
  groups.norm = {layout.model_parallel};  // each stage (and tp slice) adds its own squares
  const auto& pp = *layout.links->pp;
  if (model->config().tied_embeddings && pp.size() > 1 && layout.links->ends) {
    // The first stage embeds with the table, the last one's head reads it: each holds a copy
    // whose gradient is a part of the whole; summed over the two, counted once (on the first).
    FIVEFOLD_CHECK(groups.partial.count(kEmbedding) == 0,
                   "pipeline: the tied embedding is already a partial gradient");
    groups.partial.emplace(kEmbedding, layout.links->ends);
    if (pp.rank() == pp.size() - 1) groups.counted_elsewhere.insert(kEmbedding);
  }
  return groups;
}

PipelineParallelStep::PipelineParallelStep(ch03::Transformer model, PipelineLayout layout,
                                           const ch03::TrainConfig& config,
                                           ch03::ModelBuilder whole)
    : ModelPartStep(std::move(whole)),
      layout_(std::move(layout)),
      shards_(model->parameter_shards()) {
  for (const auto& item : model->named_parameters()) names_.insert(item.key());
  PipelineExecutor::ActivationShape shape;
  if (layout_.tp && layout_.tp->sequence_parallel) {
    // Under sequence parallelism a stage sends each tp rank's part of the sequence.
    shape = [tp = layout_.tp, d = model->config().d_model](const ch03::Batch& b) {
      const auto part = ch10::sequence_part(b.inputs.size(1), tp->rank(), tp->size());
      return std::vector<int64_t>{b.inputs.size(0), part.length, d};
    };
  }
  executor_ = std::make_unique<PipelineExecutor>(model, layout_.links, layout_.virtual_stages,
                                                 std::move(shape));
  auto groups = pipeline_groups(model, layout_);
  if (layout_.hooks.adapt_groups) layout_.hooks.adapt_groups(model, groups);
  inner_ = std::make_unique<ch09::DataParallelStep>(
      std::move(model), layout_.dp, layout_.zero, config, std::move(groups),
      [this](const std::vector<ch03::Batch>& micro_batches) {
        const auto m = static_cast<int64_t>(micro_batches.size());
        auto found = schedules_.find(m);
        if (found == schedules_.end())
          found = schedules_
                      .emplace(m, make_schedule(layout_.schedule, layout_.links->pp->size(),
                                                layout_.virtual_stages, m))
                      .first;
        return executor_->run(found->second, micro_batches);
      });
}

io::TensorMap PipelineParallelStep::gather(const io::TensorMap& mine, bool to_rank0) {
  const auto sliced =
      layout_.tp ? ch10::gather_shards(mine, shards_, *layout_.tp->comm, to_rank0) : mine;
  return gather_named_tensors(sliced, *layout_.links->pp, to_rank0 ? 0 : -1);
}

io::TensorMap PipelineParallelStep::select(const io::TensorMap& whole) {
  const auto mine = select_parameters(whole, names_);
  return layout_.tp ? ch10::slice_shards(mine, shards_) : mine;
}

ch03::StepFactory pipeline_parallel_step(PipelineLayout layout, ch03::ModelBuilder whole) {
  return [layout, whole](ch03::Transformer model, const ch03::TrainConfig& config) {
    const auto& c = model->config();
    const auto part = stage_part(c.n_layers, layout.links->pp->size(), layout.virtual_stages,
                                 layout.links->pp->rank());
    auto local = layout.tp ? ch10::make_model(c, layout.tp, part) : whole(c, part);
    if (layout.hooks.adapt_model) layout.hooks.adapt_model(local);
    // This rank's part (and slices) of the weights of the model the run built or loaded.
    ch10::load_slices(local, ch10::named_weights(model));
    return std::unique_ptr<ch03::TrainingStep>(
        new PipelineParallelStep(local, layout, config, whole));
  };
}

nlohmann::json merge_stage_metrics(const nlohmann::json& mine, dist::Communicator& pp) {
  std::map<int64_t, nlohmann::json> by_layer;  // in layer order: interleaved ranks hold layers
  double max_load = 0, dropped = 0, aux = 0;   // that are not consecutive
  for (const auto& stage : all_gather_json(mine, pp)) {
    if (!stage.contains("moe_load")) continue;  // a stage without MoE layers
    const auto layers = static_cast<double>(stage["moe_load"].size());
    for (size_t i = 0; i < stage["moe_load"].size(); ++i)
      by_layer[stage["moe_layers"][i].get<int64_t>()] = stage["moe_load"][i];
    max_load = std::max(max_load, stage["moe_max_load"].get<double>());
    // Every MoE layer routes the same tokens: averages over layers weight each stage by its count.
    dropped += stage["moe_dropped"].get<double>() * layers;
    aux += stage["moe_aux_loss"].get<double>() * layers;
  }
  if (by_layer.empty()) return nlohmann::json::object();
  nlohmann::json loads = nlohmann::json::array(), layer_indices = nlohmann::json::array();
  for (const auto& [layer, load] : by_layer) {
    layer_indices.push_back(layer);
    loads.push_back(load);
  }
  const auto n = static_cast<double>(loads.size());
  return {{"moe_load", loads},
          {"moe_layers", layer_indices},
          {"moe_max_load", max_load},
          {"moe_dropped", dropped / n},
          {"moe_aux_loss", aux / n}};
}

}  // namespace fivefold::ch11
