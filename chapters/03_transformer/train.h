#pragma once
/// @file train.h
/// @brief Chapter 03 training step: AdamW with decoupled weight decay on the matrices only, linear
/// warm-up then cosine decay of the learning rate, global-norm gradient clipping, and gradient
/// accumulation over micro-batches.

#include <torch/torch.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "03_transformer/data.h"
#include "03_transformer/model.h"
#include "fivefold/io.h"

namespace fivefold::ch03 {

/// Optimisation settings (defaults suit the small models of this course).
struct TrainConfig {
  double lr = 3e-3;               ///< peak learning rate
  double min_lr = 3e-4;           ///< floor of the cosine decay
  int64_t warmup_steps = 20;      ///< linear warm-up steps
  int64_t total_steps = 300;      ///< steps over which the cosine decays to min_lr
  double weight_decay = 0.1;      ///< AdamW's decoupled decay, for matrices only
  double beta1 = 0.9;             ///< Adam first-moment decay
  double beta2 = 0.95;            ///< Adam second-moment decay
  double eps = 1e-8;              ///< Adam epsilon
  double grad_clip = 1.0;         ///< maximum global gradient norm (0: no clipping)
  bool decay_embeddings = false;  ///< also decay the token embedding (GPT-2 does not)
  /// The type a training step keeps the model's trainable parameters, and so their gradients,
  /// in. Below fp32 (chapter 14's bf16) AdamW updates fp32 master copies (MasterWeights),
  /// which the step takes from the parameters when it is built, and rounds them into the
  /// parameters after each update: ZeRO's mixed-precision split, 2 + 2 bytes a parameter for
  /// the model's weights and gradients, 4 + 8 for the masters and the moments.
  torch::Dtype param_dtype = torch::kFloat;
  /// Builds the AdamW make_optimizer returns from its two parameter groups and the defaults
  /// (unset: torch::optim::AdamW). The seam for a faster implementation of the same update: the
  /// training run's fast paths give a fused one (runtime/fast.h). Not saved with a run.
  std::function<std::unique_ptr<torch::optim::AdamW>(std::vector<torch::optim::OptimizerParamGroup>,
                                                     const torch::optim::AdamWOptions&)>
      make_adamw;
  /// Throws fivefold::Error for inconsistent settings.
  void validate() const;
};

/// Learning rate at `step` (0-based): lr·(step+1)/warmup during warm-up, then
/// min_lr + ½(lr − min_lr)(1 + cos(π·p)) with p = (step − warmup)/(total − warmup), min_lr after.
double learning_rate(const TrainConfig& config, int64_t step);

/// AdamW over the model's parameters in two groups: group 0 decays (every 2-D weight except the
/// embedding unless decay_embeddings), group 1 does not (norms, and the embedding by default).
/// config.make_adamw, when set, builds it (the same update, computed another way).
std::unique_ptr<torch::optim::AdamW> make_optimizer(Transformer& model, const TrainConfig& config);

/// The same groups over any list of (name, tensor): the names pick the groups, the tensors are
/// what AdamW steps (chapter 14's master weights).
std::unique_ptr<torch::optim::AdamW> make_optimizer(
    const std::vector<std::pair<std::string, torch::Tensor>>& params, const TrainConfig& config);

/// Mixed precision's master weights (chapter 14): fp32 copies of parameters that the model keeps
/// in a narrower type (TrainConfig::param_dtype). AdamW steps the masters; the model computes
/// with, and back-propagates into, the parameters' rounding.
class MasterWeights {
 public:
  /// Copies `model`'s trainable parameters (fp32) as the masters, then rounds each to `dtype` in
  /// place (the same tensors: modules and hooks keep them).
  MasterWeights(Transformer& model, torch::Dtype dtype);
  /// The masters under the parameters' names: what the optimizer steps.
  const std::vector<std::pair<std::string, torch::Tensor>>& masters() const { return masters_; }
  /// Before the clip and the update: each parameter's gradient, widened to fp32, becomes its
  /// master's (the clip then scales it in fp32, not in the parameter's type). A
  /// master with a gradient already (a resumed state, adamw::load_state) and a parameter
  /// without one gets zeros, as AdamW steps a zeroed gradient.
  void load_gradients();
  /// After the update (and before the next forward): every parameter becomes its master's
  /// rounding, and the masters' fp32 gradients are dropped (a parameter whose master had one
  /// keeps a zeroed gradient of its own).
  void store();
  /// Every parameter becomes its master itself (fp32, the same storage) until the next store():
  /// what a checkpoint saves and an evaluation reads, so that a resumed run starts from the
  /// masters, not from their rounding.
  void reveal();
  /// Bytes of the masters (4 a parameter).
  int64_t bytes() const;

 private:
  std::vector<std::pair<std::string, torch::Tensor>> params_, masters_;
  torch::Dtype dtype_;
};

/// What AdamW steps, under the parameters' names: the master weights where there are some
/// (`masters` not null), else `model`'s parameters. A step's optimizer, its saved state and its
/// loaded state all name this list.
std::vector<std::pair<std::string, torch::Tensor>> stepped_parameters(Transformer& model,
                                                                      const MasterWeights* masters);

/// Mean next-token cross-entropy of `batch`.
torch::Tensor loss_of(Transformer& model, const Batch& batch);

/// The weight the loss of the forward now running carries in the step's total: its micro-batch's
/// share of the rows times its loss_weight (1 outside a step). A layer that adds a loss of its own
/// by handing it a gradient in backward, rather than through the model's output (chapter 07's
/// auxiliary loss), weights that gradient alike, so that with gradient accumulation, data,
/// pipeline or expert parallelism it counts as the mean over the micro-batches, as the loss does.
/// The step opens one scope around each micro-batch's forward (thread-local; scopes nest).
class LossWeightScope {
 public:
  /// Sets the weight until this scope closes.
  explicit LossWeightScope(double weight);
  ~LossWeightScope();
  LossWeightScope(const LossWeightScope&) = delete;
  LossWeightScope& operator=(const LossWeightScope&) = delete;
  /// The weight of the innermost open scope; 1 when none is open.
  static double current();

 private:
  double previous_;
};

/// Adds to the parameters' gradients those of the mean loss over `micro_batches` (each micro-batch
/// weighted by its share of the rows), and returns that mean loss. With equal micro-batches this
/// equals the gradient of one batch made of all of them.
double accumulate_gradients(Transformer& model, const std::vector<Batch>& micro_batches);

/// Scales all gradients so that their global L2 norm is at most `max_norm`; returns the norm
/// before scaling (summed in at least fp32, whatever the gradients' type).
double clip_gradients(Transformer& model, double max_norm);
/// The same for any list of parameters (those without a gradient are skipped).
double clip_gradients(const std::vector<torch::Tensor>& params, double max_norm);

/// What one optimizer step did.
struct StepResult {
  double loss;       ///< mean loss over the micro-batches
  /// Global gradient norm before clipping. When it is not finite (an overflow, a NaN) the step
  /// applied no update: every training step checks it before the optimizer runs, and every rank
  /// of a parallel step sees the same norm, so all skip together.
  double grad_norm;
  double lr;  ///< learning rate used
};

/// One optimizer step at `step`: zero the gradients, accumulate over `micro_batches`, clip, set
/// the learning rate of every group, step; no step when the norm is not finite (StepResult).
/// With `masters` (chapter 14), `optimizer` steps them: the gradients are loaded into them
/// (widened to fp32) before the clip, which then reads and scales the masters' gradients, and the
/// parameters are stored from them after the update.
StepResult train_step(Transformer& model, torch::optim::AdamW& optimizer, const TrainConfig& config,
                      const std::vector<Batch>& micro_batches, int64_t step,
                      MasterWeights* masters = nullptr);

/// Bytes a process keeps between steps, by kind: what chapter 09's ZeRO formulas count.
struct StateBytes {
  int64_t parameters = 0;  ///< the parameters' storage (frozen ones too)
  int64_t gradients = 0;   ///< the gradients kept (whole, or a shard)
  int64_t optimizer = 0;   ///< AdamW's moments and any master weights (whole, or a shard)
  /// All three.
  int64_t total() const { return parameters + gradients + optimizer; }
};

/// Measured from the tensors: `model`'s parameters and their gradients, and `optimizer`'s
/// moments (exp_avg, exp_avg_sq) with the `masters`' bytes when there are some.
StateBytes state_bytes(Transformer& model, torch::optim::AdamW& optimizer,
                       const MasterWeights* masters = nullptr);

/// The training step as an object: what the training run (runtime/run.h) calls, so that one loop
/// serves every layout. Chapter 03's SingleProcessStep is train_step on one process; chapter 09
/// implements it with data parallelism (DDP, ZeRO-1/2/3), later chapters with more.
class TrainingStep {
 public:
  virtual ~TrainingStep() = default;
  /// Step `step` on this process's micro-batches (its rows of the global batch, in equal
  /// slices). Returns the loss averaged over the whole global batch, the global gradient norm
  /// before clipping, and the learning rate.
  virtual StepResult step(const std::vector<Batch>& micro_batches, int64_t step) = 0;
  /// The model as this process holds it (a sharded step may hold parameters only in part).
  virtual Transformer& model() = 0;
  /// The whole model with its current parameters, for evaluation and checkpoints. A sharded step
  /// gathers it: collective, every rank calls it.
  virtual Transformer& full_model() = 0;
  /// The optimizer's state under parameter names (fivefold/adamw_state.h), complete on every
  /// rank. Collective.
  virtual io::TensorMap optimizer_state() = 0;
  /// The same state on rank 0 of the world (rank 0 of every group the step gathers over: what
  /// a checkpoint's writer saves); on the other ranks, nothing where a step gathers the state
  /// from parts (they take part in the collectives without keeping the whole of it, which
  /// would cost each of them 8 bytes a parameter). Collective. Here: optimizer_state().
  virtual io::TensorMap optimizer_state_for_writer() { return optimizer_state(); }
  /// Restores a state in that layout (read from `source`, named in errors); each rank keeps its
  /// part.
  virtual void load_optimizer_state(const io::TensorMap& state, const std::string& source) = 0;
  /// The gradients the last step applied, whole, by parameter name, on every rank (parameters no
  /// gradient reached are absent). Collective for a sharded step. With clipping off they are
  /// the gradients before clipping, which is what the parity tests compare across layouts.
  virtual io::TensorMap gradients() = 0;
  /// What this process keeps between steps, measured from its tensors (not collective).
  virtual StateBytes state_bytes() = 0;
};

/// Chapter 03's step: AdamW from make_optimizer and train_step, on one process.
class SingleProcessStep : public TrainingStep {
 public:
  /// The step for `model` with AdamW configured by `config` (over master weights when
  /// config.param_dtype is below fp32: the model's parameters are rounded here).
  SingleProcessStep(Transformer model, const TrainConfig& config);
  StepResult step(const std::vector<Batch>& micro_batches, int64_t step) override;
  Transformer& model() override { return model_; }
  /// The model; with master weights, holding them (fp32) until the next step.
  Transformer& full_model() override;
  io::TensorMap optimizer_state() override;
  void load_optimizer_state(const io::TensorMap& state, const std::string& source) override;
  io::TensorMap gradients() override;
  StateBytes state_bytes() override;

 private:
  Transformer model_;
  TrainConfig config_;
  std::unique_ptr<MasterWeights> masters_;  // when config_.param_dtype is below fp32
  std::unique_ptr<torch::optim::AdamW> optimizer_;
};

/// Makes the training step for a model (the training run calls it once).
using StepFactory =
    std::function<std::unique_ptr<TrainingStep>(Transformer model, const TrainConfig& config)>;

}  // namespace fivefold::ch03
