#pragma once
/// @file plan.h
/// @brief Chapter 10's formulas for a Llama-shaped model (chapter 02's TransformerShape) split over
/// t tensor-parallel ranks: what one rank holds and what one micro-batch makes it communicate.
/// The tests count both from the real code (the parameters a rank's model holds; every
/// operation the communicator issues) and compare exactly; `fivefold plan --tp` prints them.
/// See notes/10_tensor_parallel.md for the derivations and Llama-2-7B at tp 8.

#include <cstdint>
#include <vector>

#include "02_flops_6np/flops.h"
#include "03_transformer/model.h"

namespace fivefold::ch10 {

/// Parameters on rank `rank` of `t`: every matrix split (attention and MLP by heads and hidden
/// features, embedding and head by vocabulary rows, the first V mod t ranks holding one more), the
/// norms whole on every rank.
int64_t parameters_per_rank(const ch02::TransformerShape& shape, int t, int rank = 0);

/// Rank `rank` of `t`'s part of every block as a shape of its own: its query heads, its key/value
/// heads (one, shared, when there are fewer than ranks) and its MLP features (the first d_ff mod t
/// ranks one more). The residual width, the vocabulary and the layers stay whole.
ch02::TransformerShape rank_shape(const ch02::TransformerShape& shape, int t, int rank = 0);

/// One weight matrix a rank multiplies, [in, out], and whose rows it multiplies.
struct RankMatrix {
  /// Whose rows a matrix multiplies.
  enum class Rows {
    Every,   ///< every token of the rank (sequence parallelism: after the gather)
    Routed,  ///< the tokens the rank routes (the router)
    Expert,  ///< the tokens routed to one expert (each routed expert's matrices)
  };
  int64_t in = 0;           ///< the features it reads
  int64_t out = 0;          ///< the features it writes
  Rows rows = Rows::Every;  ///< whose rows it multiplies
};

/// What rank `rank` of `t` holds and multiplies of one block, in parameters.
struct RankBlock {
  /// Its matrices one by one (the shapes chapter 15's planner prices): products, router and
  /// per_assignment are their sums by kind of rows.
  std::vector<RankMatrix> matrices;
  int64_t products = 0;        ///< matrices every token of the rank multiplies (split and whole)
  int64_t router = 0;          ///< the router's matrix: multiplies the tokens the rank routes
  int64_t per_assignment = 0;  ///< one routed expert's matrices (k of them a routed token)
  int64_t routed = 0;          ///< the routed experts' parameters (all E: whole on every rank)
  int64_t vectors = 0;         ///< the norms and the router's bias
  int64_t frozen = 0;          ///< of vectors, the router's bias (no gradient)
  /// Parameters each rank computes only its share of the gradient of, summed over the group
  /// every step (the layers' partial_gradients): MLA's down-projections and their norms; under
  /// sequence parallelism every whole parameter, each rank having seen its part of the sequence.
  int64_t partial = 0;
  int64_t crossings = 0;  ///< f and g a micro-batch, forward and backward: 4, or 2 for experts alone
  /// Every parameter the rank holds of the block.
  int64_t held() const { return products + router + routed + vectors; }
};

/// Rank `rank` of `t`'s part of block `layer` (from 0) of `config` under chapter 10's layers:
/// Llama's as rank_shape splits it; chapter 06's MLA with its heads split (q_b_proj, or q_proj,
/// kv_b_proj, o_proj) and its down-projections (q_a_proj, kv_a_proj_with_mqa) and their norms
/// whole; a dense MLP's and the shared experts' features split (split_sizes); the router and the
/// routed experts whole. Checked against the parameters and FLOPs of the built layers.
RankBlock rank_block(const ch03::ModelConfig& config, int64_t layer, int t, int rank,
                     bool sequence_parallel);

/// Operations and bytes of one kind, as the communicator counts them (comm_stats.h).
struct Traffic {
  int64_t calls = 0;          ///< operations
  int64_t payload_bytes = 0;  ///< bytes handed to them (the gathered result of an all-gather)
  double wire_bytes = 0;      ///< the ring model's bytes sent by one rank
};

/// What one micro-batch's forward and backward (loss through the vocabulary-parallel head) makes
/// one rank of the tensor-parallel group do, per operation, for b sequences of s tokens in
/// `element_bytes`-byte activations (4: fp32, as this course trains).
struct TensorParallelTraffic {
  Traffic all_reduce;      ///< f and g, and the loss's three per-token sums
  /// sequence parallelism: entering a split layer (forward), leaving it (backward), and each
  /// block's entry again in backward (its products kept the rank's part)
  Traffic all_gather;
  Traffic reduce_scatter;  ///< sequence parallelism: leaving a split layer (forward)
  /// Wire bytes of all three. Sequence parallelism moves what the all-reduces move (a
  /// reduce-scatter and an all-gather move what one all-reduce moves) and the blocks' second
  /// gathers: 2L more all-gathers, about 1.25 times the wire bytes.
  double wire_bytes() const;
};

/// Without sequence parallelism: per layer, g's all-reduce of the [b, s, h] activation after
/// attention and after the MLP (forward) and f's two (backward): 4L; plus the embedding's g, the
/// head's f and the loss's three all-reduces of one number per token (max, Σ exp, target
/// logit). With it: per layer 4 all-gathers and 4 reduce-scatters of [b, s, h] (each all-reduce
/// becomes a pair) and 2 all-gathers more in backward (attention's and the MLP's inputs, which
/// their products kept as the rank's part of the sequence); the embedding reduce-scatters forward
/// and all-gathers backward, the head all-gathers forward and reduce-scatters backward; the loss
/// is unchanged.
TensorParallelTraffic tensor_parallel_traffic(const ch02::TransformerShape& shape, int t, int64_t b,
                                              int64_t s, bool sequence_parallel,
                                              int64_t element_bytes = 4);

/// The same for blocks that cross into and out of split layers `crossings` times in all (forward
/// and backward; RankBlock::crossings each), the embedding's and the head's 2 included, with a
/// residual stream of `d_model`; under sequence parallelism each block's entries, half its
/// crossings, gather again in backward.
TensorParallelTraffic tensor_parallel_traffic(int64_t crossings, int64_t d_model, int t, int64_t b,
                                              int64_t s, bool sequence_parallel,
                                              int64_t element_bytes = 4);

/// The activation bytes sequence parallelism saves on rank `rank` of `t` for one micro-batch of b
/// sequences of s tokens: what a forward pass keeps for backward outside the split layers
/// scales with the tokens the rank holds, n_r = b·(its part of s) under SP against b·s without.
/// Per norm and token: its input, x² (which the mean keeps), x·rms⁻¹ and rms⁻¹: 3h + 1 numbers;
/// 2L + 1 norms. And each block norm's output, h numbers: the split products read it gathered
/// but keep only the rank's part, gathering it again in backward (GatheredSequence; the head
/// keeps the final norm's gathered). Everything inside the split layers is the same size with or
/// without SP, so the difference is exactly
///   (b·s − n_r)·((2L + 1)·(3h + 1) + 2L·h)·element_bytes.
int64_t sequence_parallel_activation_savings(const ch02::TransformerShape& shape, int t, int rank,
                                             int64_t b, int64_t s, int64_t element_bytes = 4);

}  // namespace fivefold::ch10
