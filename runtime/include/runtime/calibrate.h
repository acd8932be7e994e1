#pragma once
/// @file calibrate.h
/// @brief `fivefold calibrate`: this machine as chapter 15's planner describes a cluster,
/// measured on the ranks of a job (one rank a device: under mpirun, each rank gets its share of
/// the cores).
///
/// - The attention kernel's rate, by precision: the kernel the run uses (the fast paths' tiled
///   kernel, or chapter 03's), one block's forward and backward at the run's shape, every rank
///   at once, counted as the planner counts attention FLOPs.
/// - The product rate, by precision, and what a step costs once: every rank trains the given
///   model alone, at once (so that they share the machine as a job's ranks do), at the batch and
///   at half of it; the median step times against the step's FLOPs as the planner counts them
///   (estimate_step on one device), less the attention kernel's time, give the rate (the slope:
///   it folds in what a step does besides its products, norms and the loss, in proportion to
///   them) and the time a step costs
///   whatever its tokens (the intercept: the optimizer's update, per parameter).
/// - The link: each collective the chapters run (all-reduce, all-gather, reduce-scatter,
///   all-to-all, and ring send/receives) at each message size and at each rank count that
///   divides the link's ranks (groups of consecutive ranks, all at once), the slowest rank's
///   median; for each, latency and bandwidth fitted to time = latency x messages + wire bytes /
///   bandwidth (ring messages and wire bytes as the planner counts them), its own line in the
///   cluster file, and one line fitted to them all for anything else. On one host the link over
///   every rank is both the node's and the nodes'; across hosts (the same number of ranks on
///   each), the node's link is timed over the ranks that share a host (shared memory) and the
///   nodes' over one rank of each host (TCP), every group at once, and devices per node is the
///   ranks a host.
/// - Memory: the machine's MemAvailable over the ranks.

#include <cstdint>
#include <vector>

#include <nlohmann/json.hpp>

#include "15_trainer_5d/planner.h"
#include "fivefold/dist.h"
#include "runtime/run.h"

namespace fivefold::runtime {

/// What calibrate measures on.
struct CalibrationOptions {
  RunConfig run;      ///< the model, sequence and batch whose step gives the product rate
  int64_t steps = 10;  ///< timed steps (the first is left out: warm-up)
  std::vector<int64_t> sizes = {4096, 65536, 1 << 20, 4 << 20};  ///< message bytes
  int64_t iterations = 8;                                        ///< timed messages a size
};

/// The description and what each figure came from.
struct Calibration {
  ch15::Cluster cluster;    ///< name "this machine", devices and devices per node the job's ranks
  nlohmann::json measured;  ///< step times, message times, the fit
};

/// Measures on every rank of `world` (collective; at least 2 ranks, to time a link). Throws
/// fivefold::Error for one rank, naming how to run it.
Calibration calibrate(const dist::CommunicatorPtr& world, const CalibrationOptions& options);

}  // namespace fivefold::runtime
