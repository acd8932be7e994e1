#pragma once
/// @file attention.h
/// @brief Chapter 12: attention over the keys in blocks. A query's attention over all its keys
/// can be computed one block of keys at a time: each block gives an output normalised within the
/// block and the log-sum-exp (LSE) of its scores, and two such partial results merge exactly into
/// the result over both blocks (the online softmax, Milakov & Gimelshein 2018; FlashAttention, Dao
/// et al. 2022). The blocks may live on other ranks (ring attention, context_parallel.h) or be
/// slices of the local keys (blockwise attention: the [seq_q, seq_k] scores never exist whole).
///
/// Every function here takes the tokens' positions, not their order: query at position i sees the
/// keys at positions <= i. Shapes as chapter 03's ch03::AttentionKernel: q [batch, heads, seq_q,
/// d], k [batch, kv_heads, seq_k, d], v [batch, kv_heads, seq_k, v_dim] (grouped-query: kv head j
/// serves query heads j·g .. j·g + g − 1), positions int64 [seq_q] and [seq_k].

#include <torch/torch.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "03_transformer/model.h"

namespace fivefold::ch12 {

/// Attention of the queries over one block of keys: the output normalised over the block's
/// visible keys, and the LSE of the scaled scores over them. A query that sees none of the block's
/// keys gets output 0 and LSE −inf (the merge's neutral element). Plain tensor operations: under
/// autograd it differentiates like chapter 03's attention.
ch03::AttentionOutput attend_block(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, const torch::Tensor& q_positions,
                                   const torch::Tensor& k_positions, double scale);

/// The online-softmax merge: a and b are partial results of the same queries over two disjoint
/// sets of keys; returns the result over their union, exactly (up to rounding), and its LSE. A
/// query that sees no key in a (LSE −inf) takes b's result, and the other way round; one that sees
/// none in either keeps output 0 and LSE −inf. **Exercise** (README, "The exercise").
ch03::AttentionOutput merge_attention(const ch03::AttentionOutput& a,
                                      const ch03::AttentionOutput& b);

/// True when some query at `q_positions` sees some key at `k_positions` (a block that no query
/// sees is skipped: under the causal mask, about half of all blocks).
bool block_visible(const torch::Tensor& q_positions, const torch::Tensor& k_positions);

/// `positions` cut into tiles: runs of consecutive positions of at most `tile` each (first index,
/// length), in order. A contiguous shard of 2t tokens is two tiles of t, a zig-zag shard of two
/// chunks of t the two chunks. Visibility is decided per pair of tiles: a query tile sees a key
/// tile unless all its keys come after all its queries; smaller tiles skip more of the masked
/// triangle, in more (smaller) products.
std::vector<std::pair<int64_t, int64_t>> position_runs(const torch::Tensor& positions,
                                                       int64_t tile);

/// The scores a block of keys at `k_positions` costs queries at `q_positions`, both cut into tiles
/// of `tile` (position_runs) as RunAccumulator::add and add_block_gradients cut them: over the pairs
/// of tiles where some query sees some key, the product of their lengths. Forward computes each of
/// them once, backward once again.
int64_t visible_scores(const torch::Tensor& q_positions, const torch::Tensor& k_positions,
                       int64_t tile);

/// Partial results of the queries, one per tile of their positions (position_runs), merged as
/// blocks of keys come: add() computes only the (query tile, key tile) pairs where some query sees
/// some key, so a zig-zag shard skips its early chunk's future like a contiguous one.
class RunAccumulator {
 public:
  /// Queries q [batch, heads, seq_q, d] at `q_positions`, scores scaled by `scale`, cut into
  /// tiles of at most `tile` consecutive positions.
  RunAccumulator(const torch::Tensor& q, const torch::Tensor& q_positions, double scale,
                 int64_t tile);
  /// Merges the queries' attention over one block of keys (any positions).
  void add(const torch::Tensor& k, const torch::Tensor& v, const torch::Tensor& k_positions);
  /// The result over every block added: output [batch, heads, seq_q, v_dim] and LSE (zeros and
  /// −inf for queries that saw no key). `value_dim`: v_dim, for runs that saw nothing.
  ch03::AttentionOutput result(int64_t value_dim) const;

 private:
  torch::Tensor q_, q_positions_;
  double scale_;
  int64_t tile_;
  std::vector<std::pair<int64_t, int64_t>> runs_;
  std::vector<ch03::AttentionOutput> partial_;
};

/// Adds one block's gradients to dq (all queries), dk and dv (the block's keys), pair of tiles by
/// pair of tiles as RunAccumulator computed them.
void add_block_gradients(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& q_positions, const torch::Tensor& k_positions,
                         double scale, int64_t tile, const torch::Tensor& grad_output,
                         const torch::Tensor& lse, const torch::Tensor& delta,
                         torch::Tensor& grad_q, torch::Tensor& grad_k, torch::Tensor& grad_v);

/// The gradients of one block's share of attention.
struct BlockGradients {
  torch::Tensor dq;  ///< [batch, heads, seq_q, d]: this block's contribution to dL/dq
  torch::Tensor dk;  ///< [batch, kv_heads, seq_k, d]
  torch::Tensor dv;  ///< [batch, kv_heads, seq_k, v_dim]
};

/// Backward of attention through one block of keys, recomputing its probabilities from the
/// *final* LSE (over all keys): p = exp(scale·q·k − lse). With dO the output's gradient and
/// delta = Σ_d dO·O (per query, over the final output O): dV = pᵀ·dO, dS = p ∘ (dO·Vᵀ − delta),
/// dQ = scale·dS·K, dK = scale·dSᵀ·Q. Summed over the blocks these are the whole attention's
/// gradients, which is what lets ring attention's backward visit the blocks one at a time.
BlockGradients attend_block_backward(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const torch::Tensor& q_positions,
                                     const torch::Tensor& k_positions, double scale,
                                     const torch::Tensor& grad_output, const torch::Tensor& lse,
                                     const torch::Tensor& delta);

/// Attention over keys cut into blocks of `block` tokens (merged with merge_attention; blocks no
/// query sees skipped), as one autograd function: it keeps q, k, v, the output and the LSE for
/// backward, which recomputes each block's probabilities (attend_block_backward). So the
/// [seq_q, seq_k] probabilities are never kept, only [seq_q, block] at a time. The LSE is returned
/// for merging and carries no gradient.
ch03::AttentionOutput blockwise_attention(const torch::Tensor& q, const torch::Tensor& k,
                                          const torch::Tensor& v, const torch::Tensor& q_positions,
                                          const torch::Tensor& k_positions, double scale,
                                          int64_t block);

/// blockwise_attention in chapter 03's attention-kernel slot (any positions: also the zig-zag
/// shards of context parallelism and generation with a KV cache).
class BlockwiseAttentionKernel : public ch03::AttentionKernel {
 public:
  /// `block`: keys per block (> 0).
  explicit BlockwiseAttentionKernel(int64_t block = 128);
  ch03::AttentionOutput compute(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const torch::Tensor& q_positions,
                                const torch::Tensor& k_positions, double scale) const override;

 private:
  int64_t block_;
};

}  // namespace fivefold::ch12
