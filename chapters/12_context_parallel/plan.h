#pragma once
/// @file plan.h
/// @brief Chapter 12's formulas: what context parallelism moves per attention layer, as the tests
/// count it from the communicator (exactly), and what `fivefold plan --cp` prints. Derivations:
/// notes/12_context_parallel.md.

#include <cstdint>
#include <vector>

#include "02_flops_6np/flops.h"
#include "12_context_parallel/context_parallel.h"

namespace fivefold::ch12 {

/// Calls and payload bytes of one kind of operation.
struct CpOps {
  int64_t calls = 0;          ///< operations issued
  int64_t payload_bytes = 0;  ///< as comm_stats counts them (all_gather: the gathered output)
};

/// One attention layer's context-parallel communication for one micro-batch, forward and backward,
/// on rank `rank` of `cp` (fp32: 4-byte floats, 8-byte positions).
struct CpTraffic {
  CpOps all_gather;      ///< both kernels: 2 per forward (key counts, key positions); all-gather:
                         ///< the keys and values too
  CpOps send_recv;       ///< ring: keys and values around the ring, and their gradients back
  CpOps reduce_scatter;  ///< all-gather kernel's backward: the key/value gradients to their owners
  /// Of the three, the bytes forward hands over (the counts and positions, the ring's forward
  /// pass or the all-gather of keys and values): what recomputing the attention (chapter 14)
  /// hands over again.
  int64_t forward_payload_bytes = 0;
};

/// The traffic of one attention layer of a micro-batch of `rows` sequences of `seq` tokens split
/// by `layout`, with `kv_heads` key/value heads on this rank of widths `key_dim` and `value_dim`
/// (MLA: the heads' query/key width and value width). With W = rows·kv_heads·(key_dim +
/// value_dim)·4 bytes per token and n_j the tokens rank j holds: the ring sends, forward, the
/// blocks of every rank but r + 1 (cp − 1 steps), backward the same blocks again and every
/// rank's gradient once (cp steps): W·(2·(seq − n_{r+1}) + seq); all-gather gathers W·seq forward
/// and hands W·seq to the reduce-scatter backward. Both gather cp counts and seq positions.
CpTraffic context_parallel_traffic(int64_t cp, int64_t rank, int64_t rows, int64_t seq,
                                   int64_t kv_heads, int64_t key_dim, int64_t value_dim,
                                   CpLayout layout, CpAttention attention);

/// The attention scores rank `rank` of `cp` computes per row and query head in one forward over a
/// sequence of `seq` tokens split by `layout` (backward computes each once more): the ring, its
/// queries against every rank's block, both in tiles of ring_tile(its tokens); all-gather, against
/// the gathered keys in blocks and tiles of kAllGatherBlock. Only the pairs of tiles where some
/// query sees some key count (visible_scores).
int64_t attention_scores(int64_t cp, int64_t rank, int64_t seq, CpLayout layout,
                         CpAttention attention);

/// The matmul FLOPs of one score of blockwise attention (the ring's, all-gather's and chapter 03's
/// tiled kernel), forward and backward, with queries and keys of `key_dim` and values of
/// `value_dim`: forward q·kᵀ and p·v (2·key_dim + 2·value_dim); backward, which keeps no
/// probabilities, q·kᵀ again, pᵀ·dO, dO·vᵀ, dS·k and dSᵀ·q (6·key_dim + 4·value_dim).
constexpr int64_t blockwise_flops_per_score(int64_t key_dim, int64_t value_dim) {
  return 8 * key_dim + 6 * value_dim;
}

/// The bytes of fp32 activations one micro-batch of `rows` sequences of `seq` tokens leaves alive
/// for backward on rank `rank` of `cp`, through the whole model (Llama-shaped: RMSNorm, SwiGLU,
/// RoPE, no biases). With n = rows·n_r the rank's tokens, per layer: chapter 11's per-token terms
/// outside attention (8h + 4f + 2 floats), then what attention keeps: q, the output, the LSE and
/// o_proj's input (3·H·d + H floats), the ring also its own keys and values (2·K·d), all-gather
/// instead every rank's (rows·seq·K·2d floats); RoPE's cos and sin rows (n_r·d floats) and every
/// rank's key positions (seq int64). No [seq, seq] term: that is what falls as 1/cp.
int64_t cp_activation_bytes(const ch02::TransformerShape& shape, int64_t cp, int64_t rank,
                            int64_t rows, int64_t seq, CpLayout layout, CpAttention attention);

/// One block's part of cp_activation_bytes: what each layer keeps on rank `rank` (chapter 14
/// builds its recomputation formulas under cp on it).
int64_t cp_block_activation_bytes(const ch02::TransformerShape& shape, int64_t cp, int64_t rank,
                                  int64_t rows, int64_t seq, CpLayout layout,
                                  CpAttention attention);

}  // namespace fivefold::ch12
