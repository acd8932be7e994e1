#pragma once
/// @file checkpoint_function.h
/// @brief Chapter 14: the autograd function behind `checkpoint` (recompute.h), in two halves.
/// Forward (solutions/14_memory/checkpoint.cpp) runs the region with autograd off and keeps its
/// inputs and what it needs to run it again; backward (checkpoint_backward.cpp, the chapter's
/// exercise) runs it again with gradients on and back-propagates through that second run.

#include <ATen/core/Generator.h>
#include <torch/torch.h>

#include <vector>

#include "14_memory/recompute.h"

namespace fivefold::ch14 {

/// What the forward saw besides its inputs, for the second run: the region, the CPU random
/// generator (a region that draws random numbers draws the same ones again), the micro-batch's
/// loss weight (chapter 07's auxiliary loss reads it in forward) and each input's own type
/// (forward may keep a narrower copy of an input: checkpoint's `kept`).
struct SavedRegion : torch::CustomClassHolder {
  Region run;                         ///< what the region computes
  at::Generator generator;            ///< a clone of the CPU generator as forward found it
  double loss_weight = 1;             ///< ch03::LossWeightScope::current() in forward
  std::vector<at::ScalarType> types;  ///< each input's own type
  std::vector<torch::Tensor> kept;    ///< what forward keeps of each input, until it saves them
};

/// The CPU random generator set to `state` while alive, then back to where it was.
class GeneratorState {
 public:
  /// Sets the CPU generator to `state`, keeping where it was.
  explicit GeneratorState(const at::Generator& state);
  /// Puts the CPU generator back where it was.
  ~GeneratorState();
  GeneratorState(const GeneratorState&) = delete;
  GeneratorState& operator=(const GeneratorState&) = delete;

 private:
  at::Generator generator_, now_;
};

/// checkpoint()'s function: apply(region, inputs) -> the region's outputs.
class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  /// Runs `region` on `inputs` (apply() calls it with autograd off, so the region's activations
  /// are freed as it goes). Keeps `region->kept` (save_for_backward: the inputs, or the copies
  /// kept in their place) and the region (ctx->saved_data["region"], a capsule); nothing else.
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                c10::intrusive_ptr<SavedRegion> region,
                                                torch::TensorList inputs);
  /// `grads`: one gradient per output of forward (undefined where an output got none). Returns
  /// one per argument of forward: the region's first (it has none), then each input's, in order
  /// (undefined for an input that needs none), as if forward had kept everything; the parameters
  /// the region reads end with the .grad they would have had.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads);
};

}  // namespace fivefold::ch14
