#pragma once
/// @file trainer.h
/// @brief Chapter 03 training run: the loop around train_step. Metrics per step (loss, learning
/// rate, gradient norm, tokens/s, MFU from chapter 02's count) to a JSONL file and a progress bar,
/// periodic evaluation, and checkpoints that resume exactly: weights, AdamW state, step (the data
/// position: the sampler is stateless) and the random generator's state.
///
/// Output folder:
///
///     OUT/metrics.jsonl              one JSON object per step ("kind": "train") or eval ("eval")
///     OUT/latest                     the name of the newest complete checkpoint folder
///     OUT/step-00000100/config.json, model.safetensors   Hugging Face layout (checkpoint.h)
///     OUT/step-00000100/optimizer.safetensors            AdamW moments by parameter name
///     OUT/step-00000100/trainer_state.json               next step, run settings
///     OUT/step-00000100/rng.safetensors                  CPU generator state
///
/// A checkpoint folder is written under a temporary name and renamed when complete, and `latest`
/// is replaced atomically after it, so an interrupted save never leaves a half checkpoint behind.

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "03_transformer/data.h"
#include "03_transformer/evaluate.h"
#include "03_transformer/model.h"
#include "03_transformer/train.h"
#include "fivefold/comm_stats.h"

namespace fivefold::ch03 {

/// Where the tokens come from.
struct DataConfig {
  std::string path;                    ///< a text file, or a `.bin`; empty: the synthetic corpus
  uint64_t seed = 0;                   ///< synthetic corpus and batch order
  int64_t synthetic_examples = 50000;  ///< lines in the synthetic training split
  double val_fraction = 0.1;           ///< of a file's tokens, held out at its end
};

/// This process's place in a job of several (set by a parallel program; the defaults are one
/// process). Not saved: a run may resume in another layout.
struct Placement {
  int64_t data_rank = 0;   ///< which slice of each global batch this process trains on
  int64_t data_ranks = 1;  ///< slices (data-parallel ranks); batch / data_ranks rows each
  int64_t processes = 1;   ///< processes doing the work (MFU divides by their peak)
  bool writer = true;      ///< writes metrics, checkpoints, logs and the progress bar
  /// In a job of several processes: takes each process's verdict on the run's folder (the
  /// writer's: "" when all is well, else what is wrong) and returns the first error, on every
  /// process, so that all refuse together before the first step (a collective; chapter 14 sets
  /// it). Unset on one process.
  std::function<std::string(const std::string&)> agree;
};

/// A whole training run.
struct RunConfig {
  ModelConfig model;                 ///< the model (ignored on resume: the checkpoint's is used)
  TrainConfig train;                 ///< optimiser and schedule
  DataConfig data;                   ///< tokens
  int64_t seq_len = 64;              ///< tokens per row
  int64_t batch = 16;                ///< rows per optimizer step (global batch)
  int64_t micro_batches = 1;         ///< gradient accumulation: micro-batches per data rank
  int64_t steps = 300;               ///< train until this many steps are done
  std::string out_dir;               ///< metrics and checkpoints; empty: write nothing
  std::string settings_toml;         ///< written to out_dir/settings.toml as the run starts
  int64_t save_every = 100;          ///< checkpoint interval in steps (0: only at the end)
  int64_t keep_checkpoints = 2;      ///< older checkpoint folders are deleted
  int64_t eval_every = 50;           ///< evaluation interval in steps (0: only at the end)
  int64_t eval_batches = 8;          ///< held-out batches per evaluation
  int64_t exact_match_examples = 0;  ///< held-out synthetic prompts per evaluation (0: none)
  double peak_gflops = 0;            ///< matmul peak for MFU; 0: measured at start
  bool progress = true;              ///< progress bar on stderr
  ModelBuilder build_model;          ///< makes the model (default: ch03::build_model); not saved
  /// Makes the training step (default: SingleProcessStep; chapter 09: data parallelism). Not
  /// saved.
  StepFactory make_step;
  Placement placement;  ///< this process's share of the work; not saved
  /// Runs after each optimizer step; the fields it returns join that step's metrics line
  /// (chapter 07: expert load, and the router bias update). Not saved.
  std::function<nlohmann::json(Transformer&)> after_step;
  /// Throws fivefold::Error naming the first inconsistent setting.
  void validate() const;
};

/// The settings as JSON (saved in trainer_state.json) and back.
nlohmann::json run_to_json(const RunConfig& config);
/// Inverse of run_to_json; missing keys keep their defaults.
RunConfig run_from_json(const nlohmann::json& json);

/// What a checkpoint's trainer_state.json holds: the next step and the run's settings.
struct RunState {
  int64_t step = 0;  ///< steps done (the next step to run)
  RunConfig run;     ///< the settings it was trained with
};
/// Reads `checkpoint`/trainer_state.json; a missing file, bad JSON, a missing `step` or `run`, or
/// a setting of the wrong type is a fivefold::Error naming the file.
RunState load_run_state(const std::string& checkpoint);

/// Train and held-out tokens for `data`: the synthetic corpus's two splits (held-out: a tenth as
/// many lines), or a file's tokens split at 1 - val_fraction. Throws fivefold::Error for a
/// missing, empty or too short file.
std::pair<TokenDataset, TokenDataset> load_datasets(const DataConfig& data, int64_t seq_len);

/// The trainable parameters (requires_grad) of a model or model part.
struct TrainableCounts {
  int64_t elements = 0;  ///< numbers
  int64_t tensors = 0;   ///< parameter tensors
  /// The elements by ZeRO-3's units (chapter 09): [0] everything outside the blocks (the root),
  /// then block 0, 1, ... of the whole model, n_layers + 1 entries (0 for a block not held).
  std::vector<int64_t> by_unit;
  /// Of the tensors, the routed experts' (chapter 07: names with ".experts."), which expert
  /// parallelism splits over its ranks and no group of it sums.
  int64_t routed_tensors = 0;
  /// Of by_unit, the routed experts' elements (empty for a model without them).
  std::vector<int64_t> routed_by_unit;
  /// Parameters that take no gradient (requires_grad false: MoE's balancing bias), in numbers:
  /// stored like the others, but no gradient or optimizer state.
  int64_t frozen = 0;
};

/// The ZeRO-3 unit (TrainableCounts::by_unit) a parameter of this name belongs to: 1 + i for
/// model.layers.{i}.*, else 0 (the root).
size_t parameter_unit(const std::string& name);

/// Counts `model`'s trainable parameters.
TrainableCounts count_trainable(Transformer& model);

/// What a run did.
struct RunResult {
  int64_t first_step = 0;      ///< 0, or the step it resumed from
  std::vector<double> losses;  ///< training loss of each step run
  LossReport eval;             ///< the last evaluation
  ExactMatchReport exact;      ///< the last exact-match evaluation (empty if not asked)
  std::string checkpoint;      ///< the last checkpoint folder written ("" if none)
  /// This rank's communicator counts over the training steps alone: no evaluation, checkpoint
  /// or set-up traffic (what the per-step formulas predict).
  dist::CommStats training_comm;
  /// The trainable parameters this rank's step holds (TrainingStep::model(): a tensor-parallel
  /// slice, a pipeline stage's layers): what the data-parallel reductions carry.
  TrainableCounts held;
  /// Training steps that began right after the whole model was gathered for an evaluation or a
  /// checkpoint (ZeRO-3's first forward then finds every unit already gathered).
  int64_t steps_after_whole_model = 0;
  /// What this rank's step kept right after its last training step (TrainingStep::state_bytes).
  StateBytes state;
  /// The matmul FLOPs this rank executed in this run's first training step, forward, backward
  /// and update (chapter 02's FlopCounter, alive for that step only: it slows every operation a
  /// little); -1 before any step.
  int64_t step_flops = -1;
};

/// Runs training. With `resume`, continues from `out_dir`'s latest checkpoint with its saved
/// settings, bit for bit as if never interrupted; from `config` it takes only what does not change
/// the computation: steps, the evaluation and checkpoint settings, progress, the MFU peak and the
/// layout (placement, micro-batches per rank). Without it, refuses an `out_dir` that already holds
/// a run. An `out_dir` that is a checkpoint folder is refused; the run owns its folder while it
/// runs (io::DirectoryLock: a second run into the same folder is refused). Every input is checked
/// before anything is written. Checkpoint folders replace an existing one of the same step
/// atomically (io::replace_directory).
RunResult run_training(const RunConfig& config, bool resume = false);

/// The checkpoint folder to read for `path`: `path` itself when it holds config.json, else the
/// folder named by `path`/latest. Throws fivefold::Error when neither exists.
std::string resolve_checkpoint(const std::string& path);

}  // namespace fivefold::ch03
