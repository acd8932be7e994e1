#pragma once
/// @file pipeline_trace.h
/// @brief Pictures of chapter 11's schedules, a report the lesson does not need (the benchmark
/// bench_pp_schedules draws them): a timeline per rank (the simulator's, or the executor's from a
/// real run, gathered over the pipeline) as Chrome trace JSON (opens in Perfetto or
/// chrome://tracing) and as an SVG: ranks down, time across, forward / input gradient / weight
/// gradient / whole backward coloured, idle time left blank.

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "11_pipeline_parallel/pipeline.h"
#include "11_pipeline_parallel/schedule.h"

namespace fivefold::runtime {

using ch11::ExecutedAction;

/// One timeline per rank; times in seconds (or simulator units) from a common origin.
using Timelines = std::vector<std::vector<ExecutedAction>>;

/// The simulator's timeline in that form (one unit = one second).
Timelines simulated_timelines(const ch11::Simulation& simulation);

/// Every rank's timeline of the executor's last run, on every rank of `pp` (collective), shifted
/// so that the earliest start is 0.
Timelines gather_timelines(const ch11::PipelineExecutor& executor, dist::Communicator& pp);

/// Per rank, the share of the span (first start to last end over all ranks) spent not
/// computing.
std::vector<double> idle_shares(const Timelines& timelines);

/// Chrome trace JSON: one complete event ("ph": "X", microseconds) per action, thread = rank.
nlohmann::json chrome_trace(const Timelines& timelines);

/// The timelines drawn as an SVG picture titled `title`.
std::string timeline_svg(const Timelines& timelines, const std::string& title);

}  // namespace fivefold::runtime
