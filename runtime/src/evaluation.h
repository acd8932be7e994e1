#pragma once
// The run's evaluation with its work shared out over the job's processes (run.cpp's): every one
// holds the same whole model (TrainingStep::full_model), and process p of P takes the batches
// (examples) p, p + P, ...; one all-reduce hands every process what each found, and the batches'
// sums are added in batch order, so every process reports the one process's figures
// (ch03::evaluate_loss, ch03::exact_match) bit for bit, in 1/P of the work. Without a world of
// several processes, chapter 03's functions themselves.

#include <cstdint>

#include "03_transformer/data.h"
#include "03_transformer/evaluate.h"
#include "03_transformer/model.h"
#include "fivefold/dist.h"

namespace fivefold::runtime {

/// The held-out loss over batches 0 .. batches - 1 of `sampler`, shared out over `world`.
ch03::LossReport shared_loss(ch03::Transformer& model, const ch03::BatchSampler& sampler,
                             int64_t batches, const dist::CommunicatorPtr& world);

/// Exact match over held-out synthetic examples 0 .. count - 1, shared out over `world`.
ch03::ExactMatchReport shared_exact_match(ch03::Transformer& model, uint64_t data_seed,
                                          int64_t count, const dist::CommunicatorPtr& world);

}  // namespace fivefold::runtime
