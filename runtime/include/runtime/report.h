#pragma once
/// @file report.h
/// @brief What a run did, side by side with another run or with the plan: training curves read
/// back from metrics.jsonl and compared step by step (a table, the largest difference, an SVG
/// plot of both), and what each rank measured (bytes per communicator, model state, matmul
/// FLOPs, peak memory) gathered and tabulated beside chapter 15's predictions (predict.h).

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fivefold/comm_stats.h"
#include "fivefold/dist.h"

namespace fivefold::runtime {

/// One run's training rows ("kind": "train" in metrics.jsonl).
struct Curve {
  std::string label;               ///< how tables and plots name it
  std::vector<int64_t> steps;      ///< step numbers, ascending
  std::vector<double> loss;        ///< training loss of each step
  std::vector<double> grad_norm;   ///< gradient norm before clipping of each step
};

/// Reads the training rows of `metrics_path` (a metrics.jsonl, or a run folder holding one).
/// Throws fivefold::Error for a missing file, a malformed line or a run with no training rows.
Curve read_curve(const std::string& metrics_path, const std::string& label);

/// How far a curve is from a reference over the steps both have.
struct CurveDifference {
  int64_t steps = 0;              ///< steps compared (those in both)
  double max_loss_relative = 0;   ///< max |loss - reference| / |reference|
  double max_norm_relative = 0;   ///< the same for the gradient norm
  int64_t worst_step = 0;         ///< where the loss differs most
};

/// Compares `curve` with `reference` step by step. Throws fivefold::Error when they share no step.
CurveDifference compare_curves(const Curve& curve, const Curve& reference);

/// A Markdown table of both curves at about `rows` evenly spaced shared steps (always the first
/// and the last): step, each loss, the relative difference, each gradient norm.
std::string curve_table(const Curve& curve, const Curve& reference, int64_t rows = 10);

/// An SVG line plot (loss against step) of `curves`, one colour each, with axes and a legend.
std::string svg_plot(const std::vector<Curve>& curves, const std::string& title);

/// What one rank measured over a run: the bytes it handed to each communicator in the training
/// steps (comm_stats' payload bytes, summed over ops), and its peak resident memory.
struct RankMeasurement {
  std::map<std::string, int64_t> payload_bytes;  ///< communicator name -> bytes
  int64_t peak_resident_bytes = 0;               ///< the process's peak RSS (getrusage)
  /// communicator name -> the bytes the formulas predict for this rank over the whole run
  /// (predicted_run_traffic); only the communicators they describe.
  std::map<std::string, int64_t> predicted_bytes;
  /// The bytes of parameters, gradients and AdamW moments the rank's step kept after its last
  /// training step (runtime::StepMeter::state); -1: not known.
  int64_t state_bytes = -1;
  /// What predicted_state_bytes says the rank keeps; -1: not known.
  int64_t predicted_state_bytes = -1;
  /// The matmul FLOPs the rank executed in one training step (runtime::StepMeter::step_flops,
  /// chapter 02's counter); -1: not known.
  int64_t matmul_flops = -1;
  /// What predicted_flops says for a step; -1: not predicted.
  int64_t predicted_matmul_flops = -1;
  /// Whether the prediction holds for each rank (else for the mean over the ranks only: routed
  /// experts under expert parallelism compute what the router sent them).
  bool flops_exact_per_rank = true;
};

/// This rank's measurement: the bytes of `stats` (runtime::StepMeter::training_comm: the
/// training steps alone) and its peak memory so far.
RankMeasurement measure_rank(const dist::CommStats& stats);

/// Every rank's measurement (`mine` on this rank), gathered on `world` (collective). Returns them
/// by rank on every rank.
std::vector<RankMeasurement> gather_measurements(const dist::CommunicatorPtr& world,
                                                 const RankMeasurement& mine);

/// A table of the gathered measurements: per communicator the bytes per step, mean and largest
/// over the ranks that used it, beside the prediction's mean and largest where there is one;
/// then the model state and the matmul FLOPs per step per rank (measured and predicted, where
/// known) and the peak memory per rank (smallest, mean, largest).
std::string measurement_table(const std::vector<RankMeasurement>& ranks, int64_t steps);

/// The same as JSON: {"per_step_bytes": {name: {"mean", "max", "ranks", and where predicted
/// "predicted_mean", "predicted_max" and "exact": the statistics the prediction is exact for,
/// ["mean", "max"], or for `ep` ["mean"] (each rank's share follows the routing)}},
/// "peak_resident_bytes": [per rank], and where known "state_bytes", "predicted_state_bytes",
/// "matmul_flops" and "predicted_matmul_flops" (one step's): [per rank], with
/// "matmul_flops_exact": "each" (every rank's) or "mean" (the ranks' sum only)}.
nlohmann::json measurement_json(const std::vector<RankMeasurement>& ranks, int64_t steps);

}  // namespace fivefold::runtime
