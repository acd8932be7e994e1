#pragma once
/// @file trainer_5d.h
/// @brief Chapter 15: the five parallelisms together. A Layout names how many ranks each
/// dimension has and how each runs; resolve_layout checks it against the world, the model and the
/// batch before anything talks to anyone; apply_layout builds the mesh (pp slowest, then dp, cp,
/// tp fastest, with ep folded into dp·cp) and gives this rank's training run (the run loop below
/// the programs, runtime/run.h) the model, the step and this rank's share of the work.
/// compose_step, the exercise, decides which chapter's step runs over which communicator and
/// what wraps what (README, "Composing the steps").
///
/// Every choice a chapter made stays that chapter's; this one only decides which communicator
/// each step gets.

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "03_transformer/model.h"
#include "03_transformer/train.h"
#include "10_tensor_parallel/step.h"
#include "11_pipeline_parallel/pipeline.h"
#include "12_context_parallel/context_parallel.h"
#include "13_expert_parallel/expert_parallel.h"
#include "14_memory/plan.h"
#include "14_memory/recompute.h"
#include "fivefold/dist.h"
#include "fivefold/mesh.h"

namespace fivefold::ch15 {

/// Bytes one block keeps for backward on a rank: the model, the block (from 0), batch (rows), seq,
/// precision, mode, the rank's tp, cp and ep shares (the arguments of chapter 14's formulas).
using BlockActivations = std::function<int64_t(
    const ch03::ModelConfig&, int64_t, int64_t, int64_t, ch14::Precision, ch14::Recompute,
    const ch14::TensorParallelShare&, const ch14::ContextParallelShare&,
    const ch14::ExpertParallelShare&)>;

/// What a layout is checked against and predicted for: the model and each step's batch.
struct Workload {
  ch03::ModelConfig model;    ///< the whole model
  int64_t seq_len = 64;       ///< tokens per row
  int64_t batch = 16;         ///< rows per optimizer step (the global batch)
  int64_t micro_batches = 1;  ///< micro-batches per data-parallel rank
  /// Queries per tile of the attention kernel without cp: the training run's tiled kernel computes
  /// only the tiles a query tile can see (chapter 12's visible_scores); 0: chapter 03's kernel,
  /// the whole square.
  int64_t attention_tile = 128;
  /// Chapter 14's recomputation: what each rank runs forward a second time in backward, with
  /// the collectives inside (predicted_flops, predicted_traffic).
  ch14::RecomputeConfig recompute;
  /// What one block keeps for backward on a rank, as the kernels the run computes with keep it
  /// (predicted_activations and the planner read it): unset, chapter 14's formulas for the
  /// lesson's kernels (ch14::block_activation_bytes, ch14::deepseek_block_activation_bytes);
  /// the training run's fast kernels give theirs (runtime::block_activation_bytes, set by
  /// runtime::workload_of and by `fivefold plan --search`), as chapter 03's slots take a faster
  /// kernel.
  BlockActivations block_activations;
  /// Chapter 14's precision: in bf16 the parameters are kept in bf16 beside fp32 master weights
  /// (predicted_state_bytes) and ZeRO gathers them in bf16 (predicted_traffic).
  ch14::Precision precision = ch14::Precision::Fp32;
};

/// How the ranks of the world are laid out and how each dimension runs.
struct Layout {
  int64_t dp = 0;  ///< data-parallel ranks; 0: the world size / (tp·pp·cp)
  int64_t tp = 1;  ///< tensor-parallel ranks (chapter 10)
  int64_t pp = 1;  ///< pipeline stages (chapter 11)
  int64_t cp = 1;  ///< context-parallel ranks (chapter 12)
  int64_t ep = 1;  ///< expert-parallel ranks, folded into dp·cp (chapter 13)
  int zero = 0;    ///< ZeRO stage 0-3 over the data-parallel replicas (chapter 09)
  bool sequence_parallel = false;  ///< with tp > 1 (chapter 10)
  std::string schedule = "1f1b";   ///< with pp > 1: gpipe, 1f1b, interleaved or zb
  int64_t virtual_stages = 1;      ///< with schedule interleaved: stages per pipeline rank
  ch12::CpLayout cp_layout = ch12::CpLayout::Zigzag;        ///< with cp > 1
  ch12::CpAttention cp_attention = ch12::CpAttention::Ring;  ///< with cp > 1

  /// dp·tp·pp·cp: the processes the layout needs.
  int64_t ranks() const { return dp * tp * pp * cp; }
  /// A world rank's coordinates in the mesh (pp slowest, then dp, cp, tp fastest).
  struct Place {
    int64_t pp = 0;  ///< pipeline stage
    int64_t dp = 0;  ///< data-parallel index
    int64_t cp = 0;  ///< context-parallel index
    int64_t tp = 0;  ///< tensor-parallel index
  };
  /// Where world rank `rank` sits (dp resolved).
  Place place(int64_t rank) const {
    return {rank / (tp * cp * dp), (rank / (tp * cp)) % dp, (rank / tp) % cp, rank % tp};
  }
  /// One line, e.g. "dp 2 x tp 2 x pp 2 (1f1b) x cp 2 (zigzag, ring), ep 2, ZeRO-1".
  std::string describe() const;
};

/// `layout` with dp filled in (when 0) for a world of `world_size` processes, checked against
/// the world and `work`'s model, sequence, batch and micro-batches. Throws fivefold::Error with the
/// reason for the first thing the layout cannot do: a product that is not the world size, ZeRO
/// outside 0-3, sequence parallelism without tp, tp not dividing the heads or key/value heads,
/// more stages than layers, an interleaved schedule whose micro-batches are not a multiple of
/// pp, a sequence zig-zag CP cannot split, experts ep does not divide, ep not dividing dp·cp, a
/// batch that does not split into dp x micro-batches. It communicates with nobody: every rank
/// refuses alike, before any communicator exists.
Layout resolve_layout(Layout layout, int64_t world_size, const Workload& work);

/// The communicators a layout's steps run over, cut from one DeviceMesh.
struct Groups {
  dist::CommunicatorPtr data;            ///< dp x cp: where every dense gradient is averaged
  dist::CommunicatorPtr cp;              ///< the ranks that share each row's tokens
  dist::CommunicatorPtr pp;              ///< the pipeline's stages
  dist::CommunicatorPtr pp_tp;           ///< pp x tp: the model-parallel ranks (norm, checkpoint)
  ch10::TensorParallelPtr tp;            ///< null without tensor parallelism
  ch13::ExpertParallel experts;          ///< ep and edp; null members without experts split
};

/// Cuts `mesh` (dimensions pp, dp, cp, tp) into the groups `layout` uses. Collective over the
/// mesh's world: every rank must call it.
Groups make_groups(const Layout& layout, const dist::DeviceMesh& mesh);

/// The exercise. A StepFactory whose steps, run on every rank of `groups` (make_groups' cut of
/// the mesh for `layout`; `world_size` processes in all), give one process's loss, gradient norm
/// and update. Built only from chapters 09-13's steps and wrappers, each over one of `groups`'
/// communicators; an empty factory means chapter 03's one-process step. Checked by
/// test_ch15_trainer_5d: five 8-rank layouts against one process (the loss, the norm and every
/// gradient at step 1, then three AdamW steps).
ch03::StepFactory compose_step(const Layout& layout, const Groups& groups, int64_t world_size);

/// What a layout gives one rank's training run.
struct RankSetup {
  ch03::ModelBuilder build_model;  ///< the model (the most complete the chapters build)
  ch03::StepFactory make_step;     ///< compose_step's step
  /// After each optimizer step: the balancing update and the expert load, over the ranks that
  /// routed different tokens; its fields join the metrics line.
  std::function<nlohmann::json(ch03::Transformer&)> after_step;
  int64_t data_rank = 0;   ///< this rank's slice of each global batch (its dp coordinate)
  int64_t data_ranks = 1;  ///< the slices: dp
  int64_t processes = 1;   ///< the world's size
  bool writer = true;      ///< world rank 0 writes metrics, checkpoints and logs
};

/// This rank's part in training in `layout` on `world`: the mesh and its groups, the model
/// builder, compose_step's step, the balancing update, and its share of each batch. `layout`
/// must come from resolve_layout. Collective over `world`.
RankSetup apply_layout(const Layout& layout, const dist::CommunicatorPtr& world);

}  // namespace fivefold::ch15
