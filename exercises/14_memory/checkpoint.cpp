// Chapter 14 exercise: the checkpoint function's backward.
//
// Forward below keeps a region's inputs and nothing the region computes. Write backward, which
// must give the region's inputs and the parameters it reads the gradients they would have had if
// forward had kept everything, with the state the forward saw (the random generator, the loss
// weight) in force wherever the region depends on it.
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

  // The exercise. `grads` holds one gradient per output of forward (undefined where an output
  // got none). Return one gradient per argument of forward: the region first (it has none), then one
  // for each of the inputs, in order (undefined for an input that needs none). What the forward
  // kept: ctx->get_saved_variables() (the inputs, or the copies kept in their place: the region
  // reads each in its input's own type, SavedRegion::types) and ctx->saved_data["region"] (a
  // SavedRegion: toCapsule(), then c10::static_intrusive_pointer_cast). The parameters the region
  // reads must end with the same .grad as without recomputation.
  // The loop (README, "How to do an exercise"): cmake --build build --target loop_ch14 &&
  //   ctest --test-dir build -L loop_ch14 --output-on-failure; once it passes, the whole
  //   chapter: ctest --test-dir build -L ch14 --output-on-failure
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    (void)ctx;
    (void)grads;
    throw NotImplemented(
        "ch14::checkpoint's backward (chapters/14_memory/README.md, \"The exercise\")");
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
