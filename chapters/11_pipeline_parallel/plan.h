#pragma once
/// @file plan.h
/// @brief Chapter 11's formulas for a Llama-shaped model (chapter 02's TransformerShape) cut into
/// a pipeline: what each rank holds, how long it idles, how many micro-batches of activations it
/// keeps, and what it sends. The tests count each from the real code (the parameters a stage's
/// model holds, the executor's peak, every send the communicator issues) and compare exactly;
/// `fivefold plan --pp` prints them. Derivations: notes/11_pipeline_parallel.md.

#include <string>
#include <utility>
#include <vector>

#include "02_flops_6np/flops.h"
#include "11_pipeline_parallel/schedule.h"

namespace fivefold::ch11 {

/// One pipeline rank in a plan.
struct RankPlan {
  std::vector<std::pair<int64_t, int64_t>> layers;  ///< [first, last) of each virtual stage held
  int64_t parameters = 0;      ///< its blocks, and the embedding / final norm and head at the ends
  int64_t peak_in_flight = 0;  ///< most micro-batches (one virtual stage each) held at once
  /// stage_activation_bytes of one micro-batch through each virtual stage held (same order as
  /// `layers`)
  std::vector<int64_t> activation_bytes;
  /// peak_in_flight x the largest of activation_bytes: the activations the rank keeps at its
  /// peak (ZB-H1's micro-batches waiting for W keep less, notes §4)
  int64_t peak_activation_bytes = 0;
};

/// The plan of a schedule for a model.
struct PipelinePlan {
  Schedule schedule;            ///< the lists (make_schedule)
  double bubble = 0;            ///< bubble_formula: idle share with F = B = W
  std::vector<RankPlan> ranks;  ///< per pipeline rank
};

/// The bytes of fp32 activations one block keeps for `rows` sequences of `seq` tokens: the
/// per-block term of stage_activation_bytes below (chapter 14 builds on it: recomputation, and a
/// rank's share under tensor parallelism).
int64_t block_activation_bytes(const ch02::TransformerShape& shape, int64_t rows, int64_t seq);

/// The bytes of fp32 activations one micro-batch of `rows` sequences of `seq` tokens leaves alive
/// after its forward through a stage of `layers` blocks of this course's Llama-shaped model
/// (RMSNorm, RoPE, attention written out as in chapter 03, SwiGLU), counting the stage's input
/// (received, or the embedding's output), and with `head` the final norm, the logits' log-softmax
/// and the loss. With n = rows·seq tokens, h = d_model, q = n_heads·head_dim, f = d_ff, H heads:
///   per block  4n(8h + 4q + 4f + 2) + 4·rows·H·seq² + seq² + 4·seq·head_dim
///              (+ 16·H with grouped-query attention: the index that repeats the key/value heads)
///   input      4nh;   head   4n(3h + 1 + vocab) + 8.
/// Term by term in notes/11_pipeline_parallel.md §4; equal to MemoryTracker's count of the real
/// model's forward (PipelineParallel.PlanMatchesTheRealPipeline). Throws for other shapes.
int64_t stage_activation_bytes(const ch02::TransformerShape& shape, int64_t layers, bool head,
                               int64_t rows, int64_t seq);

/// The plan of `schedule` with p ranks, v virtual stages and m micro-batches of `rows` sequences
/// of `seq` tokens for `shape` (the layers split as stage_layers splits them). A tied embedding is
/// counted on the first and the last rank (each holds a copy).
PipelinePlan pipeline_plan(const ch02::TransformerShape& shape, int64_t ranks,
                           int64_t virtual_stages, int64_t micro_batches,
                           const std::string& schedule, int64_t rows, int64_t seq);

/// Point-to-point traffic of one step.
struct PipelineTraffic {
  int64_t sends = 0;          ///< send operations (activations and gradients)
  int64_t payload_bytes = 0;  ///< bytes they carry
};

/// What pipeline rank `rank` sends in one step of m micro-batches holding `rows` sequences of s
/// tokens in all (this data-parallel rank's share of the batch), hidden size h: each virtual
/// stage it holds sends every micro-batch's activation forward unless it is the last stage, and
/// every micro-batch's input gradient back unless it is the first: rows·s·h·element_bytes per
/// stage boundary and direction, whatever m. With v = 1 and 1 < rank < p − 1: 2·m sends,
/// 2·rows·s·h·4 bytes.
PipelineTraffic pipeline_traffic(int64_t ranks, int64_t virtual_stages, int64_t micro_batches,
                                 int64_t rank, int64_t rows, int64_t s, int64_t h,
                                 int64_t element_bytes = 4);

}  // namespace fivefold::ch11
