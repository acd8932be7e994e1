#pragma once
/// @file plan.h
/// @brief Chapter 14's plan terms: what recomputation costs in FLOPs and saves in memory, as
/// formulas that the chapter's tests check against the counts of the real code (chapter 02's
/// FLOP counter, fivefold::MemoryTracker).

#include <cstdint>

#include <nlohmann/json.hpp>

#include "02_flops_6np/flops.h"
#include "03_transformer/model.h"
#include "12_context_parallel/context_parallel.h"
#include "12_context_parallel/plan.h"
#include "14_memory/precision.h"
#include "14_memory/recompute.h"

namespace fivefold::ch14 {

/// Training matmul FLOPs per token of a sequence of `context` tokens with `config`'s
/// recomputation: chapter 02's 3 x forward, plus the forward run again in backward: every
/// recomputed block's (Full: ceil(n_layers / every) blocks, all but the head, ~8NP in all) or
/// every block's attention core (Selective: the scores and the weighted values).
double training_flops_per_token(const ch02::TransformerShape& shape, int64_t context,
                                const RecomputeConfig& config);

/// The blocks Full recomputation runs again: global indices i < n_layers with i % every == 0.
int64_t recomputed_layers(int64_t n_layers, int64_t every);

/// One rank's share of a tensor-parallel group (chapter 10), for block_activation_bytes.
struct TensorParallelShare {
  int64_t ranks = 1;               ///< t, the ranks of the group
  int64_t rank = 0;                ///< this rank
  bool sequence_parallel = false;  ///< the residual stream and the norms split by sequence
  /// Of `tokens` (a sequence, or a cp rank's part of one), those this rank keeps the residual
  /// stream for: its part (split_sizes) under sequence parallelism, else all of them.
  int64_t own(int64_t tokens) const;
};

/// A rank's part of chapter 13's expert parallelism, for a MoE layer's activations: the ranks of
/// its group, and the rows its experts computed (the routing decides them).
struct ExpertParallelShare {
  int64_t ranks = 1;      ///< ep
  int64_t received = -1;  ///< rows the rank's experts computed; -1: the balanced expectation
};

/// One rank's share of a context-parallel group (chapter 12), for block_activation_bytes.
struct ContextParallelShare {
  int64_t ranks = 1;                                      ///< c, the ranks that share a sequence
  int64_t rank = 0;                                       ///< this rank
  ch12::CpLayout layout = ch12::CpLayout::Zigzag;         ///< which tokens it holds
  ch12::CpAttention attention = ch12::CpAttention::Ring;  ///< how keys and values travel
  /// Of a sequence of `seq` tokens, those this rank holds (ch12::shard_size; all without cp).
  int64_t tokens(int64_t seq) const;
};

/// Bytes of tensor storage one block of chapter 03's Llama (RMSNorm, grouped-query attention with
/// RoPE, SwiGLU) allocates in forward and keeps until backward, in fp32 with the lesson's kernels
/// (causal_attention, chapter 03's RMSNorm), for `batch` rows of `seq` tokens, when the block is
/// run with `mode` (derived in notes/14_memory.md; measured by the tests with MemoryTracker):
///   None       chapter 11's ch11::block_activation_bytes:
///              4bs(12d + 4f + 2) + 4·b·h·s² + s² + 4s·hd (+ 16h with grouped-query attention)
///   Selective  4bs(10d + 2·h_kv·hd + 4f + 2) + 4s·hd: the s² terms are gone
///   Full       4bsd: the block's output, which the next block keeps as its input
/// (d d_model, f d_ff, h heads, h_kv key/value heads, hd head_dim). Full "every k" is Full for
/// the blocks it recomputes and None for the others. On a rank of chapter 10's tensor parallelism
/// (`tp`) the heads and d_ff are this rank's share, and with sequence parallelism so are the
/// tokens of the norms and the residual stream, while the norms' outputs are kept gathered over
/// the whole sequence (notes §1, "Under tensor parallelism").
///
/// In bf16 (chapter 14's Bf16MatmulKernel) the linear maps keep their inputs rounded to bf16:
/// None and Selective keep 2b·s(2d + h·hd + f) bytes fewer (the two norms' outputs, the heads'
/// merged output, SwiGLU's product: this rank's share, over the whole sequence); Full the same.
///
/// On a rank of chapter 12's context parallelism (`cp`, holding s_r of every sequence's `seq`
/// tokens): None is chapter 12's ch12::cp_block_activation_bytes; Full and Selective are the
/// one-device formulas at s_r tokens (the checkpointed core keeps q, k and v, whichever kernel
/// runs inside it, and none of what the ring or all-gather kernel keeps); bf16's saving is over
/// the rank's s_r tokens. With tp too (`tp` and `cp`), chapter 12's term is for this rank's heads
/// and d_ff, and with sequence parallelism the residual stream's part is kept for its share of
/// the s_r tokens only, as on one device under tp.
int64_t block_activation_bytes(const ch02::TransformerShape& shape, int64_t batch, int64_t seq,
                               Recompute mode, const TensorParallelShare& tp = {},
                               Precision precision = Precision::Fp32,
                               const ContextParallelShare& cp = {});

/// Bytes one block (`layer`, from 0) of a DeepSeek-V3-shaped `config` (chapter 06's MLA, chapter
/// 07's MoE from its first MoE layer, a dense SwiGLU before) keeps until backward, in fp32 with the
/// lesson's kernels and no recomputation, for `batch` rows of `seq` tokens (notes §1, "MLA and
/// MoE"). Per token, in floats: the norms and the residual stream, 8d + 2 as in Llama's block;
/// MLA the query latent and its norm (4·q_lora + 1), the key/value latent and its norm
/// (4·d_c + r + 1), per head q scaled and the keys (n + r each), the values and the heads' output
/// (dv each): h(2(n + r) + 2dv) (one row keeps kv_b_proj's whole output: h·n more); a dense MLP
/// 4f; a MoE layer the shared expert 4f_s, the router's scores and the gates' sum (E + 1), and per
/// assignment (k a token) its input row, its expert's output and that output gated (3d), the
/// expert's SwiGLU (4f_e) and 3 gate values, plus four int64 indices. Per block: the
/// probabilities 4b·h·s², the mask s², RoPE's cos and sin 4s·r. Dropless routing without the
/// auxiliary loss only (refused otherwise, as not derived). With full recomputation (`mode`
/// Full) the block keeps its input, 4bsd, as a Llama block does, and a MoE layer its last routing
/// (k int64 indices and k gates a token, kept outside the graph). With selective recomputation
/// (`mode` Selective) the checkpointed core keeps its inputs instead of the kernel's: per head q
/// and k (n + r each) and v, a view of kv_b_proj's whole output (n + dv), with o_proj's input
/// (dv): h(2(n + r) + n + 2dv) a token at any batch, and no s² terms.
///
/// On a rank of chapter 10's tensor parallelism (`tp`): its h/t heads, its part of d_ff and of the
/// shared experts (split_sizes); the latents, their norms, the router and the routed experts stay
/// whole. With sequence parallelism the residual stream's part (6d + 2 floats) and the routing
/// (the router, the assignments, the indices) are kept for the rank's own tokens only, and a MoE
/// layer keeps those tokens' rows once more (d floats a token), and without shared experts nothing
/// gathers its norm's output (d floats a token fewer); full recomputation keeps the rank's own
/// tokens' input and routing.
///
/// On a rank of chapter 12's context parallelism (`cp`, s_r of every row's tokens; with tp too,
/// tp's share of them): everything per token over its s_r tokens, no probabilities or mask; per
/// head chapter 12's kernel keeps q (n + r), its output and o_proj's input (dv each) and the
/// log-sum-exp, the ring also the rank's own keys (n + r) and values, a view of kv_b_proj's
/// whole output (n + dv); all-gather instead every rank's keys and values, 4b·s·h(n + r + dv);
/// plus every rank's key positions (8s) and RoPE's rows at s_r.
///
/// In bf16 (`precision`) the linear maps keep their inputs rounded, 2 bytes fewer an element where
/// the fp32 input is then freed: the norm's output, the query latent, the key/value latent, the
/// heads' output; a dense MLP its input and SwiGLU's product (d + f); a MoE layer per assignment
/// the routed row and the expert's SwiGLU product (d + f_e, for the tokens it routes), and with
/// shared experts their product (f_s) less one more rounded copy of the norm's output (d: the
/// router and the experts round other inputs in between, and Bf16MatmulKernel remembers the last
/// two roundings only); under sequence parallelism the router reads the rank's own rows and the
/// shared experts' gathered input is rounded once, d fewer instead of one more. Under tp the
/// rank's heads and shares, under cp its s_r tokens.
///
/// On a rank of chapter 13's expert parallelism (`ep`) a MoE layer's experts compute the R rows
/// the routing sends them, not the k a token the rank routes (A of them): each received row keeps
/// 2d + 4f_e floats and its regrouping index (an int64), each of the rank's assignments 2d + 3
/// floats and five int64s, against 3d + 4f_e + 3 floats and four on one device; so R − A rows
/// more (or fewer) at 4(2d + 4f_e + 2) bytes, and d floats and an int64 more an assignment. In
/// bf16 the routed row and the expert's SwiGLU product are rounded where the expert runs: on the
/// received rows. Full recomputation keeps none of it. A is the rank's tokens' (tp and cp: the
/// tokens it routes). Measured with ep alone (2 and 4 ranks) and beside tp 2, with and without
/// sequence parallelism, and cp 2.
int64_t deepseek_block_activation_bytes(const ch03::ModelConfig& config, int64_t layer,
                                        int64_t batch, int64_t seq,
                                        Recompute mode = Recompute::None,
                                        const TensorParallelShare& tp = {},
                                        const ContextParallelShare& cp = {},
                                        Precision precision = Precision::Fp32,
                                        const ExpertParallelShare& ep = {});

/// A recomputation choice and what it costs: the blocks' activations for one micro-batch and the
/// training FLOPs per token.
struct RecomputeChoice {
  RecomputeConfig config;      ///< none, selective, or full every k
  int64_t bytes = 0;           ///< what the n_layers blocks keep (block_activation_bytes)
  double flops_per_token = 0;  ///< training_flops_per_token
};

/// Which recomputation to use under a memory budget: of none, selective and full every k (k from
/// n_layers down to 1), the one with the fewest training FLOPs whose blocks keep at most `budget`
/// bytes for a micro-batch of `batch` x `seq` tokens on one device in `precision` (fewer bytes
/// breaks a tie). Throws fivefold::Error, naming full recomputation's bytes, when none fits.
RecomputeChoice recompute_under_budget(const ch02::TransformerShape& shape, int64_t batch,
                                       int64_t seq, int64_t budget,
                                       Precision precision = Precision::Fp32);

/// What `fivefold plan` prints for a Llama-shaped model: block_activation_bytes in each mode for
/// one micro-batch of `rows` sequences of `seq` tokens in `precision`, on one device and, with
/// tp > 1, on rank 0 of tp with and without sequence parallelism, with cp > 1 on rank 0 of cp
/// (`cp_layout`, `cp_attention`), and with both on rank 0 of each; and the training FLOPs per
/// token in each mode. Empty for
/// another architecture (GPT-2's LayerNorm and GELU), which the formulas do not count.
nlohmann::json activation_plan(const ch02::TransformerShape& shape, int64_t rows, int64_t seq,
                               int64_t tp, Precision precision = Precision::Fp32, int64_t cp = 1,
                               ch12::CpLayout cp_layout = ch12::CpLayout::Zigzag,
                               ch12::CpAttention cp_attention = ch12::CpAttention::Ring);

}  // namespace fivefold::ch14
