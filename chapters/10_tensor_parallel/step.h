#pragma once
/// @file step.h
/// @brief Chapter 10: the training step with tensor parallelism, composed with chapter 09's data
/// parallelism on a mesh of dp x tp ranks. Each rank holds its tp slice of the model; chapter 09's
/// DataParallelStep averages the slices' gradients over the dp ranks that hold the same slice,
/// sums the norms' partial gradients over tp under sequence parallelism, and counts every piece
/// once in the global norm. This step adds what makes the slices look like one model from outside:
/// the whole model, optimizer state and gradients gathered by parameter name (checkpoints stay the
/// single-device Hugging Face folder, and resume in any layout).

#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "03_transformer/train.h"
#include "09_data_parallel/step.h"
#include "10_tensor_parallel/layers.h"
#include "fivefold/io.h"

namespace fivefold::ch10 {

/// `local` (tensors by name, each a slice as `shards` says, or whole) -> the whole tensors,
/// gathered over `tp` (collective: every rank of tp passes the same names). A name ending in
/// ".exp_avg" or ".exp_avg_sq" (optimizer state) is a slice as its parameter is. `to_rank0`:
/// only tp rank 0 keeps them (the others take part, one tensor at a time, and get nothing).
io::TensorMap gather_shards(const io::TensorMap& local,
                            const std::map<std::string, ch03::TensorShard>& shards,
                            dist::Communicator& tp, bool to_rank0 = false);

/// The inverse: this rank's slices of whole tensors (the same naming).
io::TensorMap slice_shards(const io::TensorMap& whole,
                           const std::map<std::string, ch03::TensorShard>& shards);

/// `model`'s parameters, detached, by name.
io::TensorMap named_weights(ch03::Transformer& model);

/// Copies `weights` (whole tensors by name) into `model`'s parameters, each sliced as `model`
/// holds it (its parameter_shards; a part of the model takes only the names it holds). Throws
/// fivefold::Error naming a parameter `weights` lacks.
void load_slices(ch03::Transformer& model, const io::TensorMap& weights);

/// The model-parallel groups of a tensor-parallel model (chapter 09's map): under sequence
/// parallelism the norms' gradients are partial sums over tp; every parameter that is not a
/// slice is replicated over tp and counted in the norm on tp rank 0 only; the squares are summed
/// over tp.
ch09::ModelParallelGroups tensor_parallel_groups(ch03::Transformer& model,
                                                 const TensorParallel& tp);

/// A training step on this rank's part of the model (a tp slice here; a pipeline stage in
/// chapter 11, some experts in chapter 13), around an inner step that trains the part. From
/// outside it looks like one process's step: the whole model, AdamW's state and the gradients by
/// parameter name, through the two maps a chapter gives, gather (this rank's tensors -> the whole
/// model's; collective) and select (the whole model's -> this rank's).
class ModelPartStep : public ch03::TrainingStep {
 public:
  /// The inner step's. The whole model full_model() built goes first: the update makes it stale,
  /// and it would cost every rank the whole model's memory through every step after an
  /// evaluation (a derived step that overrides this calls it, not inner_->step).
  ch03::StepResult step(const std::vector<ch03::Batch>& micro_batches, int64_t step) override {
    full_ = ch03::Transformer(nullptr);
    return inner_->step(micro_batches, step);
  }
  /// This rank's part.
  ch03::Transformer& model() override { return inner_->model(); }
  /// The single-device model with the gathered parameters (collective). Built when asked and
  /// kept until the next step: it costs the whole model's memory on every rank meanwhile.
  ch03::Transformer& full_model() override;
  /// AdamW's state gathered by parameter name: the single process's layout (collective).
  io::TensorMap optimizer_state() override { return gather(inner_->optimizer_state(), false); }
  /// The same on world rank 0 alone: each level gathers to its group's rank 0 what the inner
  /// step kept there (the ranks of a group all kept something or all nothing).
  io::TensorMap optimizer_state_for_writer() override {
    return gather(inner_->optimizer_state_for_writer(), true);
  }
  /// Keeps this rank's part of a state in that layout.
  void load_optimizer_state(const io::TensorMap& state, const std::string& source) override {
    inner_->load_optimizer_state(select(state), source);
  }
  /// The gradients the last step applied (after clipping), whole, by name (collective).
  io::TensorMap gradients() override { return gather(inner_->gradients(), false); }
  /// The inner step's: this rank's part.
  ch03::StateBytes state_bytes() override { return inner_->state_bytes(); }
  /// The step it wraps.
  ch03::TrainingStep& inner() { return *inner_; }

 protected:
  /// `whole` builds the single-device model that full_model() fills; the derived step sets
  /// `inner_`.
  explicit ModelPartStep(ch03::ModelBuilder whole) : whole_(std::move(whole)) {}
  /// This rank's tensors by name -> the whole model's (collective), on every rank of the step's
  /// groups or, with `to_rank0`, on rank 0 of each alone (an empty map elsewhere).
  virtual io::TensorMap gather(const io::TensorMap& mine, bool to_rank0) = 0;
  /// The whole model's tensors by name -> this rank's.
  virtual io::TensorMap select(const io::TensorMap& whole) = 0;

  std::unique_ptr<ch03::TrainingStep> inner_;  ///< trains this rank's part

 private:
  ch03::ModelBuilder whole_;
  ch03::Transformer full_{nullptr};
};

/// One optimizer step of a tp-sliced model over dp x tp ranks: chapter 09's step on this rank's
/// slice, every tp rank running the same micro-batches; the slices gathered and cut by name.
class TensorParallelStep : public ModelPartStep {
 public:
  /// `model`: this rank's slice (make_model over `tp`); `dp`: the ranks holding the same slice;
  /// `stage`: chapter 09's ZeRO stage over dp; `whole`: builds the single-device model that
  /// full_model() fills (ch07::make_model); `hooks.adapt_groups` adds to the map of groups.
  TensorParallelStep(ch03::Transformer model, TensorParallelPtr tp, dist::CommunicatorPtr dp,
                     int stage, const ch03::TrainConfig& config, ch03::ModelBuilder whole,
                     const ch09::StepHooks& hooks = {});

 protected:
  io::TensorMap gather(const io::TensorMap& mine, bool to_rank0) override;
  io::TensorMap select(const io::TensorMap& whole) override;

 private:
  TensorParallelPtr tp_;
  std::map<std::string, ch03::TensorShard> shards_;
};

/// A ch03::StepFactory making TensorParallelStep: the model the run builds is replaced by this
/// rank's slice (make_model over `tp`, then hooks.adapt_model), started from the same weights.
ch03::StepFactory tensor_parallel_step(TensorParallelPtr tp, dist::CommunicatorPtr dp, int stage,
                                       ch03::ModelBuilder whole, ch09::StepHooks hooks = {});

}  // namespace fivefold::ch10
