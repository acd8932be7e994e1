#pragma once
/// @file run.h
/// @brief The training run: the loop around a chapter's training step (chapter 03's
/// TrainingStep). Metrics per step (loss, learning rate, gradient norm, tokens/s, MFU from chapter
/// 02's count) to a JSONL file and a progress bar, periodic evaluation, and checkpoints that resume
/// exactly: weights, AdamW state, step (the data position: the sampler is stateless) and the
/// random generator's state. No chapter teaches it; every chapter's demo and `fivefold train` run
/// through it.
///
/// Output folder:
///
///     OUT/metrics.jsonl              one JSON object per step ("kind": "train") or eval ("eval")
///     OUT/settings.toml              the run's settings as `--config` reads them
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
#include "14_memory/recompute.h"
#include "fivefold/dist.h"

namespace fivefold::runtime {

/// This process's place in a job of several (set from a parallel layout: layout.h; the defaults
/// are one process). Not saved: a run may resume in another layout.
struct Placement {
  int64_t data_rank = 0;   ///< which slice of each global batch this process trains on
  int64_t data_ranks = 1;  ///< slices (data-parallel ranks); batch / data_ranks rows each
  int64_t processes = 1;   ///< processes doing the work (MFU divides by their peak)
  bool writer = true;      ///< writes metrics, checkpoints, logs and the progress bar
  int64_t pipeline_stage = 0;  ///< this process's pipeline stage (chapter 11), 0 without one
  /// The job's processes (null: one process). Over them the writer's verdict on the run's
  /// folder becomes every process's before the first step, so that all refuse together, and an
  /// evaluation, where each holds the same whole model, shares its batches and examples out.
  dist::CommunicatorPtr world;
};

/// Watches a run from outside the loop: what a report measures (communication, state, FLOPs)
/// attaches here instead of growing the loop (measure.h). Every hook runs on every process.
class RunObserver {
 public:
  virtual ~RunObserver() = default;
  /// The step is built (and, on resume, loaded); training starts at step `first_step`.
  virtual void started(ch03::TrainingStep& /*step*/, int64_t /*first_step*/) {}
  /// Training step `step` (0-based) is about to run.
  virtual void step_begins(int64_t /*step*/) {}
  /// Training step `step` ran (before any evaluation or checkpoint after it).
  virtual void step_ended(int64_t /*step*/, ch03::TrainingStep& /*step*/,
                          const ch03::StepResult& /*result*/) {}
  /// An evaluation or a checkpoint gathered the whole model (TrainingStep::full_model).
  virtual void gathered_whole_model() {}
};

/// A whole training run.
struct RunConfig {
  ch03::ModelConfig model;           ///< the model (ignored on resume: the checkpoint's is used)
  ch03::TrainConfig train;           ///< optimiser and schedule
  ch03::DataConfig data;             ///< tokens
  int64_t seq_len = 64;              ///< tokens per row
  int64_t batch = 16;                ///< rows per optimizer step (global batch)
  int64_t micro_batches = 1;         ///< gradient accumulation: micro-batches per data rank
  /// Activation recomputation (chapter 14): "none", "full" or "selective" (ch14::Recompute).
  std::string recompute = "none";
  int64_t recompute_every = 1;  ///< with "full": every recompute_every-th block only
  int64_t recompute_stages = 0;  ///< with --pp: only the first K stages recompute; 0: all
  /// What the matrix products compute in (chapter 14): "fp32" or "bf16" (ch14::Precision).
  std::string precision = "fp32";
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
  /// The fast paths (fast.h): FusedAdamW, the tiled attention, the fused RMSNorm and oneDNN's
  /// products, installed in the model the step trains. false: chapter 03's code throughout
  /// (`--lesson-kernels`). Either way the same mathematics; not saved with a run.
  bool fast = true;
  /// Makes the model (default: ch03::build_model). Not saved.
  ch03::ModelBuilder build_model;
  /// Makes the training step (default: ch03::SingleProcessStep; a parallel layout's otherwise).
  /// Not saved.
  ch03::StepFactory make_step;
  Placement placement;  ///< this process's share of the work; not saved
  /// Runs after each optimizer step; the fields it returns join that step's metrics line
  /// (chapter 07: expert load, and the router bias update). Not saved.
  std::function<nlohmann::json(ch03::Transformer&)> after_step;
  /// Told what the run does (not owned; they must outlive the run). Not saved.
  std::vector<RunObserver*> observers;
  /// Throws fivefold::Error naming the first inconsistent setting.
  void validate() const;
};

/// The run's recomputation (chapter 14) as its settings give it: mode, every K-th block, the
/// first S pipeline stages (each rank applies RecomputeConfig::for_stage of its own stage).
ch14::RecomputeConfig recompute_config(const RunConfig& run);

/// The settings as JSON (saved in trainer_state.json) and back.
nlohmann::json run_to_json(const RunConfig& config);
/// Inverse of run_to_json; missing keys keep their defaults.
RunConfig run_from_json(const nlohmann::json& json);

/// The checkpoint folder to read for `path`: `path` itself when it holds config.json, else the
/// folder named by `path`/latest (a training run's output folder, which the run keeps pointing
/// at its last whole checkpoint). Throws fivefold::Error when neither exists.
std::string resolve_checkpoint(const std::string& path);

/// The CPU random generator's state as a tensor, and back: each checkpoint keeps it
/// (rng.safetensors) for an exact resume of anything random.
torch::Tensor rng_state();
/// Restores a state returned by rng_state().
void set_rng_state(const torch::Tensor& state);

/// What a checkpoint's trainer_state.json holds: the next step and the run's settings.
struct RunState {
  int64_t step = 0;  ///< steps done (the next step to run)
  RunConfig run;     ///< the settings it was trained with
};
/// Reads `checkpoint`/trainer_state.json; a missing file, bad JSON, a missing `step` or `run`, or
/// a setting of the wrong type is a fivefold::Error naming the file.
RunState load_run_state(const std::string& checkpoint);

/// What a run did.
struct RunResult {
  int64_t first_step = 0;       ///< 0, or the step it resumed from
  std::vector<double> losses;   ///< training loss of each step run
  ch03::LossReport eval;        ///< the last evaluation
  ch03::ExactMatchReport exact; ///< the last exact-match evaluation (empty if not asked)
  std::string checkpoint;       ///< the last checkpoint folder written ("" if none)
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

}  // namespace fivefold::runtime
