#pragma once
/// @file step.h
/// @brief Chapter 09: the training step of chapter 03 (ch03::TrainingStep) with data parallelism,
/// so that the training run, `fivefold train` and the trainers of later chapters share one loop
/// for every ZeRO stage: 0 (DDP: every rank keeps everything, gradients all-reduced in buckets),
/// 1 and 2 (ZeroOptimizer: optimizer state, and in stage 2 gradients, sharded) and 3
/// (FullyShardedDataParallel: parameters sharded too).

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "03_transformer/train.h"
#include "09_data_parallel/ddp.h"
#include "09_data_parallel/fsdp.h"
#include "09_data_parallel/zero.h"
#include "fivefold/dist.h"

namespace fivefold::ch09 {

/// One optimizer step over the data-parallel ranks of `comm`: each rank runs forward and backward
/// on its rows of the global batch (its micro-batches, each weighted by its share of the rows),
/// then the stage's reduction and update. The result is the single-device train_step on the
/// whole batch: the same gradient (the mean over ranks), the same global norm, the same update.
class DataParallelStep : public ch03::TrainingStep {
 public:
  /// Runs forward and backward over this rank's micro-batches, each loss weighted by its share
  /// of the rows (the gradients accumulate), and returns this rank's mean loss.
  using ForwardBackward = std::function<double(const std::vector<ch03::Batch>&)>;
  /// Wraps `model` (rank 0's parameters are broadcast) with ZeRO `stage` 0..3 over `comm`.
  /// `groups`: where the model's other pieces are (chapter 10 onwards; empty: `comm`'s ranks each
  /// hold the whole model): partial gradients are summed over their groups before the update, and
  /// the global norm counts every piece once. `forward_backward`: who runs the micro-batches
  /// (default: chapter 03's loop; chapter 11 runs a pipeline schedule); with one given, DDP
  /// reduces every bucket after it, and ZeRO-3 gathers the whole part for the step. With
  /// config.param_dtype below fp32 (chapter 14) every stage keeps the parameters and gradients
  /// in that type and fp32 master weights beside AdamW's moments (sharded as those are), reduces
  /// the gradients in fp32 and gathers the parameters in their own type. Throws
  /// fivefold::Error, before any communication, for a stage outside 0..3.
  DataParallelStep(ch03::Transformer model, dist::CommunicatorPtr comm, int stage,
                   const ch03::TrainConfig& config, ModelParallelGroups groups = {},
                   ForwardBackward forward_backward = {});
  /// As ch03::TrainingStep::step; the loss is averaged over the ranks (one all-reduce of a number).
  ch03::StepResult step(const std::vector<ch03::Batch>& micro_batches, int64_t step) override;
  ch03::Transformer& model() override { return model_; }
  /// Stage 3 gathers every unit (until the next step); with master weights the model holds
  /// them (fp32, gathered by stages 1-3) until the next step.
  ch03::Transformer& full_model() override;
  io::TensorMap optimizer_state() override;
  /// On this group's rank 0 alone (an empty map elsewhere): ZeRO's ranks take part in the
  /// gathers and keep nothing.
  io::TensorMap optimizer_state_for_writer() override;
  void load_optimizer_state(const io::TensorMap& state, const std::string& source) override;
  /// DDP: the model's parameters, gradients and AdamW moments; ZeRO and FSDP: their memory().
  ch03::StateBytes state_bytes() override;
  /// The gradients the last step applied (the mean over the ranks, after clipping), whole, by
  /// parameter name, on every rank (collective for stages 1-3, which hold them in shards).
  io::TensorMap gradients() override;

 private:
  ch03::Transformer model_;
  dist::CommunicatorPtr comm_;
  int stage_;
  ch03::TrainConfig config_;
  ModelParallelGroups groups_;
  ForwardBackward forward_backward_;
  std::unique_ptr<torch::optim::AdamW> adam_;     // stage 0
  std::unique_ptr<ch03::MasterWeights> masters_;  // stage 0 with config.param_dtype below fp32
  std::unique_ptr<DistributedDataParallel> ddp_;
  std::unique_ptr<ZeroOptimizer> zero_;             // stages 1 and 2
  std::unique_ptr<FullyShardedDataParallel> fsdp_;  // stage 3
};

/// How a later chapter adapts a model-parallel step it runs inside (chapter 13: experts split
/// over expert-parallel ranks, inside chapter 10's or 11's step): a change to the model part the
/// step builds, before its weights are loaded, and additions to that part's map of groups.
struct StepHooks {
  /// Called on each model part the step builds; may be empty.
  std::function<void(ch03::Transformer&)> adapt_model;
  /// Called on the part's map of groups before chapter 09's step is made; may be empty.
  std::function<void(ch03::Transformer&, ModelParallelGroups&)> adapt_groups;
};

/// A ch03::StepFactory making DataParallelStep over `comm` with ZeRO `stage`.
ch03::StepFactory data_parallel_step(dist::CommunicatorPtr comm, int stage);

/// Clips whole gradients (every rank of the data-parallel group holds the same ones, as after
/// DDP's all-reduce) by the global norm over `groups`: this rank's squares, leaving out the
/// parameters counted elsewhere, summed over groups.norm. Returns the norm before clipping.
double clip_gradients(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                      double max_norm, const ModelParallelGroups& groups);

}  // namespace fivefold::ch09
