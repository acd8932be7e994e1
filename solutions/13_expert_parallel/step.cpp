// Chapter 13: the training step with expert parallelism, chapter 09's step over the
// expert-data-parallel ranks.

#include <utility>

#include "10_tensor_parallel/step.h"
#include "13_expert_parallel/expert_parallel.h"
#include "fivefold/consolidate.h"
#include "fivefold/error.h"

namespace fivefold::ch13 {

ExpertParallelStep::ExpertParallelStep(ch03::Transformer whole, ExpertParallel group, int stage,
                                       const ch03::TrainConfig& config)
    : group_(std::move(group)) {
  FIVEFOLD_CHECK(stage >= 0 && stage <= 2, "--ep with --zero ", stage,
                 ": expert parallelism runs with ZeRO 0, 1 or 2 (ZeRO-3 does not shard "
                 "Mixture-of-Experts layers yet)");
  auto local = make_model(whole->config(), group_);
  // This rank's experts and every shared weight, by name, from the model the run built or loaded.
  ch10::load_slices(local, ch10::named_weights(whole));
  for (const auto& item : local->named_parameters()) names_.insert(item.key());
  auto groups = expert_parallel_groups(local, group_);
  inner_ = std::make_unique<ch09::DataParallelStep>(std::move(local), group_.edp, stage, config,
                                                    std::move(groups));
}

ch03::StepResult ExpertParallelStep::step(const std::vector<ch03::Batch>& micro_batches,
                                          int64_t step) {
  const auto ep = static_cast<double>(group_.ep->size());
  auto mine = micro_batches;
  for (auto& b : mine) b.loss_weight /= ep;  // the ep ranks' losses add up to their mean
  auto result = inner_->step(mine, step);
  auto loss = torch::tensor({result.loss}, torch::kDouble);
  group_.ep->all_reduce(loss);  // the edp mean of each ep rank's share, summed over ep
  result.loss = loss.item<double>();
  return result;
}

ch03::Transformer& ExpertParallelStep::full_model() {
  const auto whole = gather_named_tensors(ch10::named_weights(inner_->full_model()), *group_.ep);
  if (!full_) full_ = ch07::make_model(inner_->model()->config());
  ch10::load_slices(full_, whole);
  return full_;
}

io::TensorMap ExpertParallelStep::optimizer_state() {
  return gather_named_tensors(inner_->optimizer_state(), *group_.ep);
}

void ExpertParallelStep::load_optimizer_state(const io::TensorMap& state,
                                              const std::string& source) {
  inner_->load_optimizer_state(select_parameters(state, names_), source);
}

io::TensorMap ExpertParallelStep::gradients() {
  return gather_named_tensors(inner_->gradients(), *group_.ep);
}

ch03::StepFactory expert_parallel_step(ExpertParallel group, int stage) {
  return [group, stage](ch03::Transformer model, const ch03::TrainConfig& config) {
    return std::unique_ptr<ch03::TrainingStep>(
        new ExpertParallelStep(std::move(model), group, stage, config));
  };
}

}  // namespace fivefold::ch13
