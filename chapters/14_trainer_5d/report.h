#pragma once
/// @file report.h
/// @brief Chapter 14: what a run did, side by side with another run or with the plan. Training
/// curves read back from metrics.jsonl and compared step by step (a table, the largest
/// difference, an SVG plot of both), and what each group of a layout carried and how much memory
/// each rank held at its peak, measured in the run.

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "fivefold/dist.h"

namespace fivefold::ch14 {

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

/// What one rank measured over a run: the bytes it handed to each communicator (comm_stats'
/// payload bytes, summed over ops), and its peak resident memory.
struct RankMeasurement {
  std::map<std::string, int64_t> payload_bytes;  ///< communicator name -> bytes
  int64_t peak_resident_bytes = 0;               ///< the process's peak RSS (getrusage)
};

/// This rank's measurement so far.
RankMeasurement measure_rank();

/// Every rank's measurement, gathered on `world` (collective; the gather itself is not counted).
/// Returns them by rank on every rank.
std::vector<RankMeasurement> gather_measurements(const dist::CommunicatorPtr& world);

/// A table of the gathered measurements: per communicator the bytes per step, mean and largest
/// over the ranks that used it; then the peak memory per rank (smallest, mean, largest).
std::string measurement_table(const std::vector<RankMeasurement>& ranks, int64_t steps);

/// The same as JSON: {"per_step_bytes": {name: {"mean", "max", "ranks"}}, "peak_resident_bytes":
/// [per rank]}.
nlohmann::json measurement_json(const std::vector<RankMeasurement>& ranks, int64_t steps);

}  // namespace fivefold::ch14
