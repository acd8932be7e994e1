// Chapter 14: the checkpoint function. Forward keeps a region's inputs and nothing it computes;
// backward runs the region again with gradients on and back-propagates through that run.
#include <ATen/CPUGeneratorImpl.h>

#include "03_transformer/train.h"
#include "14_memory/recompute.h"
#include "fivefold/error.h"

namespace fivefold::ch14 {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// What the forward saw besides its inputs, for the second run: the region, the random generator
// (a region that draws random numbers draws the same ones again), the micro-batch's loss weight
// (chapter 07's auxiliary loss reads it in forward) and each input's own type (forward may keep a
// narrower copy of an input: checkpoint's `kept`).
struct SavedRegion : torch::CustomClassHolder {
  Region run;
  at::Generator generator;
  double loss_weight = 1;
  std::vector<at::ScalarType> types;
  std::vector<torch::Tensor> kept;  // what forward keeps of each input, until it saves them
};

// The CPU generator set to `state` while alive, then back to where it was.
class GeneratorState {
 public:
  explicit GeneratorState(const at::Generator& state)
      : generator_(at::detail::getDefaultCPUGenerator()) {
    std::lock_guard<std::mutex> lock(generator_.mutex());
    now_ = generator_.clone();
    generator_.set_state(state.get_state());
  }
  ~GeneratorState() {
    std::lock_guard<std::mutex> lock(generator_.mutex());
    generator_.set_state(now_.get_state());
  }
  GeneratorState(const GeneratorState&) = delete;
  GeneratorState& operator=(const GeneratorState&) = delete;

 private:
  at::Generator generator_, now_;
};

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // apply() runs this with autograd off: region's activations are freed as it goes.
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<SavedRegion> region,
                               torch::TensorList inputs) {
    ctx->save_for_backward(std::move(region->kept));
    // An output nobody used gets an undefined gradient, not zeros: nothing to back-propagate
    // (selective recomputation's log-sum-exp, which the attention layers do not read).
    ctx->set_materialize_grads(false);
    auto outputs = region->run(inputs.vec());
    ctx->saved_data["region"] = c10::IValue::make_capsule(std::move(region));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto region = c10::static_intrusive_pointer_cast<SavedRegion>(
        ctx->saved_data["region"].toCapsule());
    // The inputs again, as leaves of a graph of their own, each in its own type.
    variable_list inputs;
    const auto saved = ctx->get_saved_variables();
    for (size_t i = 0; i < saved.size(); ++i)
      inputs.push_back(
          saved[i].detach().to(region->types[i]).requires_grad_(saved[i].requires_grad()));
    // The second forward, with gradients on and the first one's state.
    variable_list outputs;
    {
      GeneratorState same_numbers(region->generator);
      ch03::LossWeightScope same_weight(region->loss_weight);
      torch::AutoGradMode enabled(true);
      outputs = region->run(inputs);
    }
    // Back-propagate the outputs' gradients through it: the parameters it used accumulate into
    // .grad, the inputs' leaves get theirs.
    variable_list roots, root_grads;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grads[i].defined()) {
        roots.push_back(outputs[i]);
        root_grads.push_back(grads[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, root_grads);
    variable_list result{torch::Tensor()};  // the region itself has no gradient
    for (const auto& x : inputs) result.push_back(x.requires_grad() ? x.grad() : torch::Tensor());
    return result;
  }
};

}  // namespace

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
