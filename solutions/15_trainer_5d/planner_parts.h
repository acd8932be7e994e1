#pragma once
// Chapter 15's planner, between its two files: the step-time model (planner.cpp) gives the search
// (search.cpp) a layout's estimate before and after the pipeline's timeline.
#include <cstdint>

#include "11_pipeline_parallel/schedule.h"
#include "15_trainer_5d/planner.h"

namespace fivefold::ch15 {

// The estimate with the pipeline's timeline left out: a step of m·v micro-batches back to back
// (exact without pp, a lower bound with it), for a rank that keeps `in_flight` micro-batches at
// once. `costs` receives the pipeline simulator's costs of one micro-batch through one stage.
StepEstimate estimate_before_pipeline(const Workload& work, const Layout& layout,
                                      const Cluster& cluster, ch14::Precision precision,
                                      int64_t in_flight, ch11::UnitCosts& costs);

// The pipeline's idle time (chapter 11's simulator run on the modelled costs) added to `e`.
void add_pipeline(StepEstimate& e, const ch11::Simulation& timeline);

// The layout's schedule of m micro-batches per data-parallel rank.
ch11::Schedule schedule_of(const Layout& layout, int64_t m);

// The most micro-batches any rank keeps at once in `timeline`.
int64_t most_in_flight(const ch11::Simulation& timeline);

}  // namespace fivefold::ch15
