// Chapter 14: the checkpoint function's backward (the chapter's exercise). Forward
// (checkpoint.cpp) kept the region's inputs, or a copy in an input's place, and the region.
#include "03_transformer/train.h"
#include "14_memory/checkpoint_function.h"

namespace fivefold::ch14 {

torch::autograd::variable_list CheckpointFunction::backward(torch::autograd::AutogradContext* ctx,
                                                            torch::autograd::variable_list grads) {
  auto region =
      c10::static_intrusive_pointer_cast<SavedRegion>(ctx->saved_data["region"].toCapsule());
  // The inputs again, as leaves of a graph of their own, each in its own type.
  torch::autograd::variable_list inputs;
  const auto saved = ctx->get_saved_variables();
  for (size_t i = 0; i < saved.size(); ++i)
    inputs.push_back(
        saved[i].detach().to(region->types[i]).requires_grad_(saved[i].requires_grad()));
  // The second forward, with gradients on and the first one's state.
  torch::autograd::variable_list outputs;
  {
    GeneratorState same_numbers(region->generator);
    ch03::LossWeightScope same_weight(region->loss_weight);
    torch::AutoGradMode enabled(true);
    outputs = region->run(inputs);
  }
  // Back-propagate the outputs' gradients through it: the parameters it used accumulate into
  // .grad, the inputs' leaves get theirs.
  torch::autograd::variable_list roots, root_grads;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].requires_grad() && grads[i].defined()) {
      roots.push_back(outputs[i]);
      root_grads.push_back(grads[i]);
    }
  }
  if (!roots.empty()) torch::autograd::backward(roots, root_grads);
  torch::autograd::variable_list result{torch::Tensor()};  // the region itself has no gradient
  for (const auto& x : inputs) result.push_back(x.requires_grad() ? x.grad() : torch::Tensor());
  return result;
}

}  // namespace fivefold::ch14
