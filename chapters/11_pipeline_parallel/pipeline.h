#pragma once
/// @file pipeline.h
/// @brief Chapter 11: pipeline parallelism on the real model. The layers are cut into stages, one
/// (or v, interleaved) per rank; activations travel forward and gradients backward between
/// neighbouring ranks; one executor runs any schedule (schedule.h) over the micro-batches; the
/// training step composes it with chapter 09's data parallelism (ZeRO 0-3) and chapter 10's
/// tensor parallelism, on a mesh of pp x dp x tp ranks.

#include <nlohmann/json.hpp>

#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "03_transformer/train.h"
#include "09_data_parallel/step.h"
#include "10_tensor_parallel/layers.h"
#include "10_tensor_parallel/step.h"
#include "11_pipeline_parallel/schedule.h"
#include "fivefold/dist.h"
#include "fivefold/io.h"

namespace fivefold::ch11 {

/// The layers of each of `stages` virtual stages, [first, last), consecutive and as even as
/// fivefold::split_sizes makes them (the first n_layers % stages stages hold one more).
std::vector<std::pair<int64_t, int64_t>> stage_layers(int64_t n_layers, int64_t stages);

/// The part of the model pipeline rank `rank` of `ranks` holds with `virtual_stages` per rank:
/// the layers of its virtual stages rank, rank + p, ...; the embedding on rank 0; the final norm
/// and the head on the rank of the last virtual stage (rank p − 1).
ch03::ModelPart stage_part(int64_t n_layers, int64_t ranks, int64_t virtual_stages, int64_t rank);

/// Refuses, before any communicator exists, what the pipeline cannot run (fivefold::Error with
/// the reason): fewer layers than the p·v virtual stages, or a schedule make_schedule refuses for
/// these p, v and m (m: micro-batches per data-parallel rank).
void check_pipeline(const ch03::ModelConfig& config, int64_t ranks, int64_t virtual_stages,
                    const std::string& schedule, int64_t micro_batches);

/// The point-to-point channels of one pipeline rank. One communicator per direction and
/// neighbour, so that no exchange waits behind another: each communicator runs its operations
/// in order on its own thread, and a channel carries one kind of tensor one way, received in the
/// order it is sent (simulate() checks a schedule for that).
struct PipelineLinks {
  /// Splits the channels off `pp` (collective over it): activations to rank + 1 and from
  /// rank − 1, gradients to rank − 1 and from rank + 1 (neighbours modulo p: the interleaved
  /// schedule's last rank sends to the first), and the group of the first and last ranks (a tied
  /// embedding's two copies).
  explicit PipelineLinks(dist::CommunicatorPtr pp);
  dist::CommunicatorPtr pp;                    ///< the pipeline's ranks
  dist::CommunicatorPtr next_activations;      ///< to rank + 1 (null when p = 1)
  dist::CommunicatorPtr previous_activations;  ///< from rank − 1
  dist::CommunicatorPtr previous_gradients;    ///< to rank − 1
  dist::CommunicatorPtr next_gradients;        ///< from rank + 1
  dist::CommunicatorPtr ends;  ///< ranks 0 and p − 1 (null on the others, and when p = 1)
  /// The other rank of a two-rank channel.
  static int peer(const dist::Communicator& channel) { return 1 - channel.rank(); }
};

/// One action as the executor ran it: seconds since the run began.
struct ExecutedAction {
  Action action;  ///< what
  double start;   ///< when the compute began (after its input arrived)
  double end;     ///< when it ended
};

/// Runs a schedule's list for this rank on its part of the model.
class PipelineExecutor {
 public:
  /// The shape of the activation a stage receives for a micro-batch (default [rows, seq,
  /// d_model]; under sequence parallelism each rank's part of the sequence).
  using ActivationShape = std::function<std::vector<int64_t>(const ch03::Batch&)>;
  /// `model`: this rank's part (stage_part); `links` over the pipeline's ranks.
  PipelineExecutor(ch03::Transformer model, std::shared_ptr<PipelineLinks> links,
                   int64_t virtual_stages, ActivationShape shape = {});
  /// Runs `schedule` (its micro-batch count must be micro_batches.size()) over the micro-batches,
  /// each loss weighted by its share of the rows: the parameters' gradients accumulate, as
  /// ch03::accumulate_gradients would on one device. Every rank of the pipeline gets the mean
  /// loss (broadcast from the last stage). Throws fivefold::Error for a schedule of another shape.
  double run(const Schedule& schedule, const std::vector<ch03::Batch>& micro_batches);
  /// The compute actions of the last run, in order, timed from the run's start on this rank.
  const std::vector<ExecutedAction>& timeline() const { return timeline_; }
  /// When the last run started, in seconds of the monotonic clock (Timer::started: one clock for
  /// every process on one machine, what lines the ranks' timelines up).
  double started() const { return started_; }
  /// The most micro-batches (of one virtual stage each) whose activations this rank held at
  /// once in the last run.
  int64_t peak_in_flight() const { return peak_in_flight_; }

 private:
  struct Slot;  // one (stage, micro-batch) in flight
  void compute(const Action& a, const std::vector<ch03::Batch>& micro_batches, double share_of_row);
  torch::Tensor received(std::map<std::pair<int64_t, int64_t>, dist::Work>& posted,
                         std::map<std::pair<int64_t, int64_t>, torch::Tensor>& local, int64_t stage,
                         int64_t micro_batch);

  ch03::Transformer model_;
  std::shared_ptr<PipelineLinks> links_;
  int64_t virtual_stages_;
  ActivationShape shape_;
  std::vector<std::pair<int64_t, int64_t>> layers_;        // per virtual stage
  std::map<int64_t, std::vector<torch::Tensor>> weights_;  // this rank's stages' parameters
  std::map<std::pair<int64_t, int64_t>, std::shared_ptr<Slot>> slots_;
  // Tensors arriving: posted receives, and those passed between stages on this rank.
  std::map<std::pair<int64_t, int64_t>, dist::Work> activations_in_, gradients_in_;
  std::map<std::pair<int64_t, int64_t>, torch::Tensor> local_activations_, local_gradients_;
  std::vector<std::pair<dist::Work, torch::Tensor>> sends_;
  std::vector<ExecutedAction> timeline_;
  int64_t in_flight_ = 0, peak_in_flight_ = 0;
  double started_ = 0;
  double loss_ = 0;
};

/// Where a pipeline-parallel step runs.
struct PipelineLayout {
  std::shared_ptr<PipelineLinks> links;  ///< the pipeline's ranks (pp)
  dist::CommunicatorPtr dp;              ///< the ranks holding the same part (data parallel)
  dist::CommunicatorPtr model_parallel;  ///< pp x tp: each rank holds a different piece
  ch10::TensorParallelPtr tp;            ///< null without tensor parallelism
  int zero = 0;                          ///< chapter 09's ZeRO stage over dp (0..3)
  std::string schedule = "1f1b";         ///< schedule_names()
  int64_t virtual_stages = 1;            ///< v (interleaved)
  ch09::StepHooks hooks;                 ///< a later chapter's changes to each part (chapter 13)
};

/// The map of groups of a pipeline stage (chapter 09): chapter 10's for its tp slices, the
/// squares summed over pp x tp, and a tied embedding's gradient summed over the first and last
/// ranks and counted on the first only.
ch09::ModelParallelGroups pipeline_groups(ch03::Transformer& model, const PipelineLayout& layout);

/// One optimizer step with the pipeline: chapter 09's DataParallelStep on this rank's part, whose
/// forward and backward are the schedule's run; the parts gathered by name over tp and pp
/// (chapter 10's ModelPartStep).
class PipelineParallelStep : public ch10::ModelPartStep {
 public:
  /// `model`: this rank's part (stage_part, sliced over tp when layout.tp); `whole` builds the
  /// single-device model that full_model() fills.
  PipelineParallelStep(ch03::Transformer model, PipelineLayout layout,
                       const ch03::TrainConfig& config, ch03::ModelBuilder whole);
  /// The executor (its timeline and peak after a step).
  const PipelineExecutor& executor() const { return *executor_; }

 protected:
  io::TensorMap gather(const io::TensorMap& mine, bool to_rank0) override;  // tp, then pp
  io::TensorMap select(const io::TensorMap& whole) override;

 private:
  PipelineLayout layout_;
  std::map<std::string, ch03::TensorShard> shards_;
  std::set<std::string> names_;  // this rank's parameters
  std::unique_ptr<PipelineExecutor> executor_;
  std::map<int64_t, Schedule> schedules_;  // by micro-batch count
};

/// A ch03::StepFactory making PipelineParallelStep: the model the run builds is replaced by this
/// rank's part (sliced over tp), started from the same weights.
ch03::StepFactory pipeline_parallel_step(PipelineLayout layout, ch03::ModelBuilder whole);

/// Chapter 07's after-step metrics of each stage's layers, merged over the pipeline (collective
/// over `pp`): every layer's load in layer order, the largest load, and the dropped share and
/// auxiliary loss averaged over the layers.
nlohmann::json merge_stage_metrics(const nlohmann::json& mine, dist::Communicator& pp);

}  // namespace fivefold::ch11
