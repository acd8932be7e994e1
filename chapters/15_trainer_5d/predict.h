#pragma once
/// @file predict.h
/// @brief Chapter 15: what each rank of a layout holds, carries and computes, from the chapters'
/// own formulas: its part of the model counted, the model state chapter 09's ZeRO formulas give,
/// the bytes each group carries (chapters 09-13), and the matmul FLOPs of a step (chapter 02's
/// count). `fivefold train --plan N` prints them before a run, and the trainer prints them beside
/// what the run measured (runtime/report.h).

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "03_transformer/model.h"
#include "03_transformer/train.h"
#include "14_memory/precision.h"
#include "15_trainer_5d/trainer_5d.h"

namespace fivefold::ch15 {

/// The trainable parameters (requires_grad) of a model or model part.
struct TrainableCounts {
  int64_t elements = 0;  ///< numbers
  int64_t tensors = 0;   ///< parameter tensors
  /// The elements by ZeRO-3's units (chapter 09): [0] everything outside the blocks (the root),
  /// then block 0, 1, ... of the whole model, n_layers + 1 entries (0 for a block not held).
  std::vector<int64_t> by_unit;
  /// Of the tensors, the routed experts' (chapter 07: names with ".experts."), which expert
  /// parallelism splits over its ranks and no group of it sums.
  int64_t routed_tensors = 0;
  /// Of by_unit, the routed experts' elements (empty for a model without them).
  std::vector<int64_t> routed_by_unit;
  /// Parameters that take no gradient (requires_grad false: MoE's balancing bias), in numbers:
  /// stored like the others, but no gradient or optimizer state.
  int64_t frozen = 0;
};

/// The ZeRO-3 unit (TrainableCounts::by_unit) a parameter of this name belongs to: 1 + i for
/// model.layers.{i}.*, else 0 (the root).
size_t parameter_unit(const std::string& name);

/// Counts `model`'s trainable parameters.
TrainableCounts count_trainable(ch03::Transformer& model);

/// The matrices of a rank's part by the tokens they multiply (rank_parameters), in elements.
struct MatmulWeights {
  /// Every token the rank computes on passes through them: attention's projections, the MLPs,
  /// shared experts (not the LM head: predicted_flops counts it from the vocabulary).
  int64_t dense = 0;
  /// The routers: the tokens the rank routes.
  int64_t router = 0;
  /// One routed expert's matrices, summed over the MoE layers held: each assignment of a token to
  /// an expert passes through one expert's.
  int64_t per_assignment = 0;
};

/// The trainable parameters a rank's step holds (rank_parameters, or count_trainable of the
/// model a run's step held: runtime::StepMeter::held): what its
/// data-parallel reductions carry. `by_unit` empty: no ZeRO-3 prediction; `elements` 0: no
/// data-parallel prediction at all.
struct HeldParameters : TrainableCounts {
  /// Of by_unit, the elements whose gradient on a tp rank is its share of the sum over tp
  /// (chapter 10's partial_gradient_parameters: MLA's whole projections, and under sequence
  /// parallelism every parameter tp does not split); empty: not known, and no tp prediction.
  std::vector<int64_t> tp_partial_by_unit;
  /// Of by_unit, the key/value projections' elements that tp ranks sharing a key/value head sum
  /// over their replica group `tp.replicas` (grouped-query attention with fewer key/value heads
  /// than tp ranks); all zero otherwise.
  std::vector<int64_t> tp_replica_partial_by_unit;
  /// The matrices, for predicted_flops (all zero: not known).
  MatmulWeights matmul;
  /// Of matmul, those of the blocks Full recomputation runs again (Workload::recompute).
  MatmulWeights recomputed;
};

/// What chapter 09's ZeRO formulas say the rank keeps between steps for its part `held` (fp32):
/// parameters 4(P + frozen), or ZeRO-3 4·Σ_u ⌈P_u/N⌉ (each unit sharded on its own); gradients
/// 4P, ZeRO-2 4⌈P/N⌉, ZeRO-3 4·Σ_u ⌈P_u/N⌉; AdamW's two moments 8P, ZeRO-1 and 2 8⌈P/N⌉, ZeRO-3
/// 8·Σ_u ⌈P_u/N⌉; N = dp·cp (under ep dp·cp/ep, the ranks holding the same experts). In bf16
/// (chapter 14's master weights) 2 bytes a parameter and a gradient, 12 for masters and moments;
/// frozen parameters stay fp32.
ch03::StateBytes predicted_state_bytes(const Layout& layout, const HeldParameters& held,
                                       ch14::Precision precision = ch14::Precision::Fp32);

/// What world rank `world_rank` of `layout` (resolved) holds in a run of `run`, counted from its
/// part of the model built here on one process (chapter 07's model, as apply_layout builds it;
/// chapter 10's over tp, chapter 13's experts over ep, the pipeline stage's layers) over offline
/// communicators (dist::offline_communicator; a replica group of tp ranks sharing key/value heads
/// made here the way TensorParallel::replica_group splits it).
HeldParameters rank_parameters(const Layout& layout, const Workload& run, int64_t world_rank);

/// What the formulas say world rank `world_rank` of `layout` (resolved) hands each communicator
/// in one training step of `run`, in payload bytes as comm_stats counts them:
/// - `pp-activations` and `pp-gradients` (chapter 11): each virtual stage the rank holds sends
///   its activations on unless it is the last stage and receives them unless it is the first
///   (gradients the other way), (B/dp) rows x s/(cp·t) positions (the rank's own count where
///   contiguous CP's or sequence parallelism's slices differ by one) x d x 4 bytes each over
///   the m micro-batches, t = tp under sequence parallelism, else 1 (notes/15_trainer_5d.md
///   §3), and
///   per step `pp` the loss (8 bytes, broadcast from the last stage) and `pp+tp` the norm's
///   squares (8 bytes);
/// - `cp` (chapter 12's context_parallel_traffic): per attention layer the rank holds and
///   micro-batch, the keys and values of its tp share of the heads (MLA: each head's
///   qk_nope + qk_rope key and v_head_dim value).
/// - `dp+cp` (chapter 09), given the parameters the rank's step holds (P elements in T tensors),
///   without expert parallelism and for ZeRO 0-2, over its N = dp·cp ranks: DDP's buckets carry
///   every gradient and one flag per tensor, 4(P + T), and the loss 8 more; ZeRO-1 and 2 the
///   flags (4T), the reduce-scatter's padded input and the all-gather's padded output
///   (4·N·⌈P/N⌉ each), the norm's and the loss's 8 bytes each; ZeRO-3, with each unit padded to
///   S_u = N·⌈P_u/N⌉ and S their sum, for a step that begins with every unit freed: each unit
///   gathered for forward and again for backward and its gradient reduce-scattered, 12·S, each
///   micro-batch after the first 4·(S_root + S_block0 + 3·S_later blocks) more (the root and
///   the first block stay gathered between them), or under pp 8·S (gathered once for the
///   step), plus the flags, the norm and the loss.
/// - `tp` (chapter 10), given which of the rank's parameters are partial sums over tp
///   (held.tp_partial_by_unit): each micro-batch's crossings into and out of the split layers,
///   one all-reduce of (B/(dp·m)) rows x its cp positions x d floats each (under sequence
///   parallelism an all-gather and a reduce-scatter, both counted at that full size): per layer
///   held two for attention (GQA or MLA) and two for the MLP (a MoE layer's shared experts; none
///   without them), one out of the embedding on the first stage, one into the head on the last,
///   which also sums the loss's three numbers per token; per step the partial gradients (4 bytes
///   each; ZeRO-3 sums each unit's as it releases it: blocks 1 .. L-1 every micro-batch) and,
///   without pp (which sums it over pp+tp), the norm's 8 bytes; `tp.replicas` the shared
///   key/value projections' partial gradients (4 bytes each, once a step; ZeRO-3 unit by unit).
/// - under expert parallelism (chapter 13), `edp` takes the place of `dp+cp`: the same formulas
///   over its N = dp·cp/ep ranks and the parameters the rank holds (its E/ep experts); and `ep`
///   carries, per MoE layer the rank holds and micro-batch, the counts' all-to-all (E int64) and
///   four token all-to-alls (dispatch and combine, each again in backward) of T·k rows of d
///   floats sent and, if the router spreads the T·k assignments of every rank evenly, as many
///   received (T: the rank's tokens per micro-batch), plus per step the partial gradients of
///   everything but the routed experts (4·P_shared; ZeRO-3 sums them unit by unit as it releases
///   them), the norm's squares and the loss (8 bytes each). What a rank receives follows the
///   routing, but every row sent is received: the mean over the ranks is exact, each rank's
///   share is the balanced expectation (runtime::measurement_json). Dropless routing only (no
///   capacity).
/// - with chapter 14's recomputation (`run.recompute`), what the second forward hands over again
///   (notes/14_memory.md §4): per micro-batch, on `tp` half of each recomputed block's crossings
///   (forward's), on `cp` chapter 12's forward part (CpTraffic::forward_payload_bytes) of each
///   recomputed block or, selective, of every attention layer, on `ep` chapter 13's forward part
///   (ExpertParallelTraffic::forward_payload_bytes) of each recomputed MoE block; nothing on the
///   others.
std::map<std::string, int64_t> predicted_traffic(const Layout& layout, const Workload& run,
                                                 int64_t world_rank,
                                                 const HeldParameters& held = {});

/// predicted_traffic over a run of `steps` training steps, `after_whole_model` of which began right
/// after an evaluation or checkpoint had gathered the whole model (runtime::StepMeter): totals,
/// not per step. Only ZeRO-3 depends on the latter: such a step's first forward gathers nothing (4·S less).
std::map<std::string, int64_t> predicted_run_traffic(const Layout& layout,
                                                     const Workload& run, int64_t world_rank,
                                                     const HeldParameters& held, int64_t steps,
                                                     int64_t after_whole_model);

/// One training step's matmul FLOPs on a rank (forward and backward, as chapter 02's counter
/// counts them).
struct StepFlops {
  /// The layers' linear maps (dense, routers, routed experts): 6 per weight and token.
  int64_t matrices = 0;
  /// Scores and weighted values, as the rank's attention kernel computes them.
  int64_t attention = 0;
  /// The LM head (last stage): 6·d·(its vocabulary rows) per token.
  int64_t head = 0;
  /// The sum of the three.
  int64_t total() const { return matrices + attention + head; }
};

/// What the formulas say world rank `world_rank` of `layout` (resolved) executes in matmuls in one
/// training step of `run`, for its part `held` (rank_parameters): with T the rank's tokens (B/dp
/// rows x its cp positions) and T_r those it routes (under sequence parallelism its tp part of T),
/// 6·dense·T + 6·router·T_r + 6·per_assignment·k·T_r (k experts per token: exact on each rank
/// without ep; under ep the mean over the ranks, each rank computing what the router sent it),
/// 6·d·V_r·T for the head's V_r vocabulary rows on the last stage, and per attention layer held
/// rows·(H/tp)·scores·c: the scores its kernel computes (chapter 03's lesson kernel the whole
/// s x s square, c = 6·(d_k + d_v); the tiled kernel, ring and all-gather attention only the
/// visible tiles, c = 8·d_k + 6·d_v: backward recomputes the scores). With chapter 14's
/// recomputation, the forward once more: 2 per weight and token of the recomputed blocks'
/// matrices (held.recomputed) and 2·(d_k + d_v) a score of their attention (full) or of every
/// attention layer's (selective). Throws fivefold::Error when the part's matrices are not known
/// (held.matmul all zero) or experts have a capacity.
StepFlops predicted_flops(const Layout& layout, const Workload& run, int64_t world_rank,
                          const HeldParameters& held);

/// What a rank's blocks keep for backward (chapter 14's formulas, the lesson's kernels).
struct ActivationPrediction {
  /// One micro-batch through the rank's blocks (the largest of its virtual stages): chapter 14's
  /// block term for each block, in the mode the run recomputes it.
  int64_t per_micro_batch = 0;
  /// The most micro-batches (each through one virtual stage) the rank holds at once: 1 without a
  /// pipeline, else the schedule's simulated peak on this pipeline rank (chapter 11).
  int64_t in_flight = 1;
  /// per_micro_batch x in_flight: the blocks' part of the rank's peak.
  int64_t peak() const { return per_micro_batch * in_flight; }
};

/// What block `layer` of `run`'s model keeps for backward, for `rows` rows of run.seq_len tokens
/// on a rank with shares `tp`, `cp` and `ep`: the formula of the kernels the run computes with
/// (run.block_activations), or, unset, chapter 14's for the lesson's kernels
/// (block_activation_bytes; DeepSeek-shaped blocks deepseek_block_activation_bytes).
int64_t block_kept(const Workload& run, int64_t layer, int64_t rows, ch14::Precision precision,
                   ch14::Recompute mode, const ch14::TensorParallelShare& tp,
                   const ch14::ContextParallelShare& cp, const ch14::ExpertParallelShare& ep = {});

/// What one micro-batch keeps through blocks [first, last) on a rank at `at` of `layout` in a run
/// of `run` in `precision`: per block block_kept for the rank's tp and cp share, in the mode
/// `run.recompute` gives pipeline stage at.pp and the block. Throws as predicted_activations
/// does.
int64_t blocks_activation_bytes(const Layout& layout, const Workload& run, const Layout::Place& at,
                                int64_t first, int64_t last, ch14::Precision precision);

/// What the blocks of world rank `world_rank` of `layout` (resolved) keep at once in a run of
/// `run` in `precision`: per block chapter 14's block_activation_bytes for the rank's tp and cp
/// share (Llama-shaped blocks; DeepSeek-shaped ones deepseek_block_activation_bytes, in fp32),
/// in the mode `run.recompute` gives the rank's pipeline stage and the block
/// (full every k: the other blocks keep everything), summed over each virtual stage's blocks,
/// times the schedule's micro-batches in flight. The lesson's kernels: the training run's fast
/// kernels keep less (notes/14_memory.md §1). Throws fivefold::Error where chapter 14 derives no
/// formula (another architecture; MLA and MoE blocks with selective recomputation). Under ep a rank's
/// experts compute what the router sends them: the count is the balanced expectation (chapter
/// 14's ep term with as many rows received as the rank routes, exact summed over the ep ranks).
ActivationPrediction predicted_activations(const Layout& layout, const Workload& run,
                                           int64_t world_rank,
                                           ch14::Precision precision = ch14::Precision::Fp32);

}  // namespace fivefold::ch15
