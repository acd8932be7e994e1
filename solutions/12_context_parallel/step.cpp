// Chapter 12: the training step with context parallelism.

#include "03_transformer/data.h"
#include "12_context_parallel/context_parallel.h"
#include "fivefold/error.h"

namespace fivefold::ch12 {

ContextParallelStep::ContextParallelStep(std::unique_ptr<ch03::TrainingStep> inner,
                                         ContextParallel group)
    : inner_(std::move(inner)), group_(std::move(group)) {
  FIVEFOLD_CHECK(inner_ != nullptr && group_.cp != nullptr,
                 "ContextParallelStep: needs a step and a communicator");
  // Attention over the group's tokens, in the model the inner step trains (which it may have
  // built anew: a pipeline stage, a ZeRO-3 part).
  model()->set_attention_kernel(std::make_shared<ContextParallelKernel>(group_));
}

namespace {
// The kernel the model's attention layers run now (they all hold the same one).
std::shared_ptr<const ch03::AttentionKernel> installed_kernel(ch03::Transformer& model) {
  const auto layers = model->layer_indices();
  return layers.empty() ? nullptr : model->block(layers.front()).self_attn->kernel;
}
}  // namespace

ch03::StepResult ContextParallelStep::step(const std::vector<ch03::Batch>& micro_batches,
                                           int64_t step) {
  // Attention over the group's tokens again, if full_model() put chapter 03's kernel in.
  if (training_kernel_) {
    model()->set_attention_kernel(training_kernel_);
    training_kernel_ = nullptr;
  }
  std::vector<ch03::Batch> mine;
  for (const auto& b : micro_batches) {
    mine.push_back(shard_batch(b, group_.cp->size(), group_.cp->rank(), group_.layout));
  }
  return inner_->step(mine, step);
}

ch03::Transformer& ContextParallelStep::full_model() {
  if (!training_kernel_) training_kernel_ = installed_kernel(model());
  auto& whole = inner_->full_model();
  // The whole model evaluates whole sequences on each rank: chapter 03's attention.
  whole->set_attention_kernel(std::make_shared<ch03::CausalAttentionKernel>());
  return whole;
}

ch03::StepFactory context_parallel_step(ch03::StepFactory inner, ContextParallel group) {
  return
      [inner = std::move(inner), group](ch03::Transformer model, const ch03::TrainConfig& config) {
        return std::unique_ptr<ch03::TrainingStep>(
            new ContextParallelStep(inner(std::move(model), config), group));
      };
}

}  // namespace fivefold::ch12
