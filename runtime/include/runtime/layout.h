#pragma once
/// @file layout.h
/// @brief A run in chapter 15's layouts: the layout flags, the workload a run's settings
/// describe, the run made to train this rank's part of a layout, the memory check before it
/// starts, and the report after it of what each rank measured beside the chapters' formulas.

#include <cstdint>
#include <nlohmann/json.hpp>

#include "15_trainer_5d/trainer_5d.h"
#include "fivefold/cli.h"
#include "fivefold/dist.h"
#include "runtime/measure.h"
#include "runtime/run.h"

namespace fivefold::runtime {

/// Declares the layout flags: --dp, --zero, --tp, --sequence-parallel, --pp, --schedule,
/// --virtual-stages, --cp, --cp-layout, --cp-attention, --ep. A resume may change every one.
void declare_layout_flags(ArgParser& args);

/// The layout the parsed flags ask for (dp 0 when --dp is not given: ch15::resolve_layout works
/// it out). Refuses a choice of how a dimension runs, other than its default, without the
/// dimension (--schedule without --pp, --cp-layout without --cp).
ch15::Layout layout_from_flags(const ArgParser& args);

/// What chapter 15 checks a layout against and predicts for: `run`'s model, sequence, batch,
/// micro-batches, and the tile of the fast paths' attention kernel (0 without the fast paths).
ch15::Workload workload_of(const RunConfig& run);

/// Bytes of memory the system can still give (MemAvailable in /proc/meminfo); 0 when unknown.
int64_t available_memory();

/// Refuses, before anything is allocated, a run that cannot fit in this machine's available
/// memory (MemAvailable in /proc/meminfo; unknown: no check) for `local_ranks` processes on it:
/// first the model's weights, gradients and AdamW state (chapter 09's ZeRO formula over the
/// layout's dp x cp ranks; in bf16 with chapter 14's master weights), then those plus what the
/// blocks of every rank of `layout` (resolved, `world_size` ranks) keep for backward (chapter
/// 15's predicted_activations: chapter 14's formulas for the kernels `run` computes with, its
/// recomputation and precision; no formula, no activations counted), this machine's share of
/// them being local_ranks / world_size (the mean over machines, which the fullest one reaches
/// at least); under ZeRO-3, the state plus what the last step's evaluation gathers on every rank
/// (the whole model, 4 bytes a parameter) and, with an output folder, a checkpoint (AdamW's
/// moments too, 12). The head, the loss and transient buffers come on top: passing is necessary,
/// not sufficient.
void check_fits_in_memory(const RunConfig& run, const ch15::Layout& layout, int local_ranks,
                          int64_t world_size);

/// What this process reads as the run's inputs, for agree_on_inputs: its settings (a resumed
/// run's own: run_to_json), `layout` (resolved), the kernels, the data file (file_fingerprint;
/// the synthetic corpus is its settings) and, with `resume`, the checkpoint resumed from (its
/// folder and trainer_state.json's fingerprint). A file that cannot be read is said in its place.
nlohmann::json run_inputs(const RunConfig& run, const ch15::Layout& layout, bool resume);

/// Refuses, on every rank alike, a run whose processes read different inputs (`mine`, from
/// run_inputs): on several machines each process reads its own machine's files, and a data file
/// changed on one machine, a preset of another version or a stale `latest` on a network file
/// system would otherwise train something else on some ranks, without an error. Names the first
/// rank whose inputs differ from rank 0's, both hosts, and each difference. Before the first
/// collective of the run (use_layout's); itself one all-gather over `world`.
void agree_on_inputs(const nlohmann::json& mine, dist::Communicator& world);

/// Makes `run` train this rank's part of `layout` (from ch15::resolve_layout) on `world`:
/// ch15::apply_layout's model builder, step, balancing update and placement. Collective over
/// `world`.
void use_layout(const ch15::Layout& layout, const dist::CommunicatorPtr& world, RunConfig& run);

/// After `steps` training steps of `run` in `layout`: every rank's measurement (`meter`'s bytes,
/// state, FLOPs, and its peak memory) beside what chapter 15's predictions say for its part,
/// gathered on `world` (collective); the writer prints the table and writes OUT/measured.json.
/// Nothing is printed for a run of no steps.
void report_measurements(const ch15::Layout& layout, const dist::CommunicatorPtr& world,
                         const RunConfig& run, const StepMeter& meter, int64_t steps);

}  // namespace fivefold::runtime
