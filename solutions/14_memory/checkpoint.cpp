// Chapter 14: the checkpoint function's forward, and `checkpoint`, which calls it. Forward keeps a
// region's inputs and nothing it computes; backward (checkpoint_backward.cpp) runs the region
// again with gradients on and back-propagates through that run.
#include <ATen/CPUGeneratorImpl.h>

#include "03_transformer/train.h"
#include "14_memory/checkpoint_function.h"
#include "fivefold/error.h"

namespace fivefold::ch14 {

GeneratorState::GeneratorState(const at::Generator& state)
    : generator_(at::detail::getDefaultCPUGenerator()) {
  std::lock_guard<std::mutex> lock(generator_.mutex());
  now_ = generator_.clone();
  generator_.set_state(state.get_state());
}

GeneratorState::~GeneratorState() {
  std::lock_guard<std::mutex> lock(generator_.mutex());
  generator_.set_state(now_.get_state());
}

torch::autograd::variable_list CheckpointFunction::forward(torch::autograd::AutogradContext* ctx,
                                                           c10::intrusive_ptr<SavedRegion> region,
                                                           torch::TensorList inputs) {
  ctx->save_for_backward(std::move(region->kept));
  // An output nobody used gets an undefined gradient, not zeros: nothing to back-propagate
  // (selective recomputation's log-sum-exp, which the attention layers do not read).
  ctx->set_materialize_grads(false);
  auto outputs = region->run(inputs.vec());
  ctx->saved_data["region"] = c10::IValue::make_capsule(std::move(region));
  return outputs;
}

std::vector<torch::Tensor> checkpoint(const Region& region,
                                      const std::vector<torch::Tensor>& inputs,
                                      const std::vector<torch::Tensor>& kept) {
  FIVEFOLD_CHECK(region, "checkpoint: no region");
  FIVEFOLD_CHECK(kept.empty() || kept.size() == inputs.size(), "checkpoint: ", kept.size(),
                 " tensors to keep for ", inputs.size(), " inputs");
  bool needs_grad = false;
  for (const auto& x : inputs) needs_grad = needs_grad || (x.defined() && x.requires_grad());
  if (!needs_grad || !torch::GradMode::is_enabled()) return region(inputs);
  auto saved = c10::make_intrusive<SavedRegion>();
  saved->run = region;
  {
    auto generator = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(generator.mutex());
    saved->generator = generator.clone();
  }
  saved->loss_weight = ch03::LossWeightScope::current();
  for (size_t i = 0; i < inputs.size(); ++i) {
    saved->types.push_back(inputs[i].scalar_type());
    if (kept.empty() || !kept[i].defined()) {
      saved->kept.push_back(inputs[i]);
      continue;
    }
    FIVEFOLD_CHECK(kept[i].sizes() == inputs[i].sizes(), "checkpoint: input ", i, " has shape ",
                   inputs[i].sizes(), ", what is kept of it ", kept[i].sizes());
    // The copy stands for the input: a leaf that needs a gradient if the input does.
    saved->kept.push_back(kept[i].detach().requires_grad_(inputs[i].requires_grad()));
  }
  return CheckpointFunction::apply(std::move(saved), torch::TensorList(inputs));
}

}  // namespace fivefold::ch14
