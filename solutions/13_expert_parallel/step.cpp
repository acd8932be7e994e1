// Chapter 13: the training step with expert parallelism, around chapter 09's, 10's or 11's step
// made over the expert-data-parallel ranks.

#include <utility>

#include "10_tensor_parallel/step.h"
#include "11_pipeline_parallel/pipeline.h"
#include "13_expert_parallel/expert_parallel.h"
#include "fivefold/consolidate.h"
#include "fivefold/error.h"

namespace fivefold::ch13 {

ExpertParallelStep::ExpertParallelStep(std::unique_ptr<ch03::TrainingStep> inner,
                                       ExpertParallel group)
    : ModelPartStep([](const ch03::ModelConfig& c, const ch03::ModelPart&) {
        return ch07::make_model(c);
      }),
      group_(std::move(group)) {
  inner_ = std::move(inner);
  FIVEFOLD_CHECK(inner_ != nullptr && group_.ep != nullptr && group_.edp != nullptr,
                 "ExpertParallelStep: needs a step and its groups");
  for (const auto& item : inner_->model()->named_parameters()) names_.insert(item.key());
}

ch03::StepResult ExpertParallelStep::step(const std::vector<ch03::Batch>& micro_batches,
                                          int64_t step) {
  const auto ep = static_cast<double>(group_.ep->size());
  auto mine = micro_batches;
  for (auto& b : mine) b.loss_weight /= ep;  // the ep ranks' losses add up to their mean
  auto result = ModelPartStep::step(mine, step);
  auto loss = torch::tensor({result.loss}, torch::kDouble);
  group_.ep->all_reduce(loss);  // the edp mean of each ep rank's share, summed over ep
  result.loss = loss.item<double>();
  return result;
}

io::TensorMap ExpertParallelStep::gather(const io::TensorMap& mine, bool to_rank0) {
  // The inner step's whole part over tp and pp holds this rank's experts: gathered over ep by
  // name, every expert of every layer.
  return gather_named_tensors(mine, *group_.ep, to_rank0 ? 0 : -1);
}

io::TensorMap ExpertParallelStep::select(const io::TensorMap& whole) {
  return select_parameters(whole, names_);
}

ch03::StepFactory expert_parallel_step(ExpertParallel group, int stage) {
  return [group, stage](ch03::Transformer whole, const ch03::TrainConfig& config) {
    auto local = make_model(whole->config(), group);
    // This rank's experts and every shared weight, by name, from the model the run built or
    // loaded.
    ch10::load_slices(local, ch10::named_weights(whole));
    ch09::ModelParallelGroups groups;
    add_expert_parallel_groups(local, group, groups);
    auto inner = std::make_unique<ch09::DataParallelStep>(std::move(local), group.edp, stage,
                                                          config, std::move(groups));
    return std::unique_ptr<ch03::TrainingStep>(new ExpertParallelStep(std::move(inner), group));
  };
}

ch03::StepFactory expert_parallel_step(ExpertParallel group, ch03::StepFactory inner) {
  return [group, inner](ch03::Transformer whole, const ch03::TrainConfig& config) {
    return std::unique_ptr<ch03::TrainingStep>(
        new ExpertParallelStep(inner(std::move(whole), config), group));
  };
}

}  // namespace fivefold::ch13
