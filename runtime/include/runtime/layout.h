#pragma once
/// @file layout.h
/// @brief A run in chapter 14's layouts: the workload a run's settings describe, and the run made
/// to train this rank's part of a layout.

#include "14_trainer_5d/trainer_5d.h"
#include "fivefold/dist.h"
#include "runtime/run.h"

namespace fivefold::runtime {

/// What chapter 14 checks a layout against and predicts for: `run`'s model, sequence, batch,
/// micro-batches, and the tile of the fast paths' attention kernel (0 without the fast paths).
ch14::Workload workload_of(const RunConfig& run);

/// Makes `run` train this rank's part of `layout` (from ch14::resolve_layout) on `world`:
/// ch14::apply_layout's model builder, step, balancing update and placement. Collective over
/// `world`.
void use_layout(const ch14::Layout& layout, const dist::CommunicatorPtr& world, RunConfig& run);

}  // namespace fivefold::runtime
