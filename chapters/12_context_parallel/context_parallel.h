#pragma once
/// @file context_parallel.h
/// @brief Chapter 12: context parallelism. The cp ranks of a group share every sequence: each
/// holds some of its tokens (and their activations) through the whole model. Everything a token
/// computes alone (norms, projections, MLP, loss) runs on its rank unchanged; attention needs every
/// earlier key, so the keys and values travel: around a ring, one block per step, while the
/// current block computes (ring attention, Liu et al. 2023), or gathered whole before attention
/// (all-gather KV, as Llama 3 and torchtitan do). Gradients of the weights are then averaged over
/// dp x cp, like data parallelism's: the cp ranks saw different tokens of the same rows.
///
/// Masks come from positions, never from order: every rank learns every rank's key positions (an
/// all-gather of a few integers per attention call), so any assignment of tokens to ranks works.
/// Two are built: contiguous (rank r holds the r-th slice) and zig-zag (the sequence cut into 2·cp
/// chunks, rank r holding chunks r and 2·cp − 1 − r, so every rank has the same causal work).

#include <memory>
#include <string>
#include <vector>

#include "03_transformer/model.h"
#include "03_transformer/train.h"
#include "12_context_parallel/attention.h"
#include "fivefold/dist.h"

namespace fivefold::ch12 {

/// How a sequence's tokens are assigned to the cp ranks.
enum class CpLayout {
  Contiguous,  ///< rank r: the r-th of cp consecutive slices (as even as they split)
  Zigzag,      ///< rank r: chunks r and 2·cp − 1 − r of 2·cp equal chunks
};

/// How the keys and values reach the other ranks.
enum class CpAttention {
  Ring,       ///< one block per step around the ring, overlapped with the block's computation
  AllGather,  ///< gathered whole before attention (each rank then holds every key and value)
};

/// "contiguous" or "zigzag" -> CpLayout; throws fivefold::Error naming the choices otherwise.
CpLayout parse_cp_layout(const std::string& name);
/// "ring" or "allgather" -> CpAttention; throws fivefold::Error naming the choices otherwise.
CpAttention parse_cp_attention(const std::string& name);

/// Refuses, before any communication, what cannot be split: a sequence of `seq` tokens over `cp`
/// ranks needs seq >= cp (contiguous; the slices may differ by one token) or seq divisible by
/// 2·cp (zig-zag: each rank's two chunks must be equal for the work to balance). With cp 1 any
/// sequence is fine.
void check_context_parallel(int64_t seq, int64_t cp, CpLayout layout);

/// The same for training `config` with sequences of `seq` tokens, and with cp > 1 a model whose
/// experts use the Switch auxiliary loss or a capacity: each rank would route its part of the
/// sequence on its own statistics, not the sequence's (global statistics: chapter 13).
void check_context_parallel(const ch03::ModelConfig& config, int64_t seq, int64_t cp,
                            CpLayout layout);

/// The positions (int64, ascending) of the tokens that rank `rank` of `cp` holds in a sequence of
/// `seq` tokens.
torch::Tensor shard_positions(int64_t seq, int64_t cp, int64_t rank, CpLayout layout);

/// How many tokens rank `rank` of `cp` holds: shard_positions(...).size(0), without building the
/// positions (the plan formulas ask it for every layout a search tries).
int64_t shard_size(int64_t seq, int64_t cp, int64_t rank, CpLayout layout);

/// Rank `rank`'s part of `batch`: its tokens' inputs and targets, their positions, and the loss
/// weight cp·n_r/seq that makes the ranks' mean losses average to the batch's (ch03::Batch).
ch03::Batch shard_batch(const ch03::Batch& batch, int64_t cp, int64_t rank, CpLayout layout);

/// The tiles ring attention cuts a rank's `tokens` queries and each block of keys into (at most this
/// many consecutive positions each): half a shard, so a zig-zag shard's two chunks and a contiguous
/// shard's two halves (notes/12_context_parallel.md §5).
int64_t ring_tile(int64_t tokens);

/// Ring attention over the ranks of `cp`: q, k, v and positions are this rank's tokens' (any
/// layout); returns this rank's queries' attention over every rank's keys, and its LSE. Each of
/// cp steps computes one block (attend_block; blocks no query sees are skipped but still passed
/// on) while the next block arrives (send_recv_async); backward runs the ring again, each block's
/// key/value gradient travelling with it back to its owner while the next block computes. One
/// autograd function. `overlap` false waits for every transfer as soon as it is posted: the same
/// arithmetic and bytes with nothing hidden, for measuring what the overlap hides.
ch03::AttentionOutput ring_attention(const torch::Tensor& q, const torch::Tensor& k,
                                     const torch::Tensor& v, const torch::Tensor& q_positions,
                                     const torch::Tensor& k_positions, double scale,
                                     const dist::CommunicatorPtr& cp, bool overlap = true);

/// The keys per block of all-gather attention (ContextParallelKernel's).
constexpr int64_t kAllGatherBlock = 128;

/// All-gather attention: every rank's keys and values gathered (all_gather, uneven parts allowed),
/// then blockwise_attention over them with blocks of `block` keys; in backward their gradients are
/// summed back to their owners (a reduce-scatter, with the gather's uneven parts).
ch03::AttentionOutput all_gather_attention(const torch::Tensor& q, const torch::Tensor& k,
                                           const torch::Tensor& v, const torch::Tensor& q_positions,
                                           const torch::Tensor& k_positions, double scale,
                                           const dist::CommunicatorPtr& cp,
                                           int64_t block = kAllGatherBlock);

/// A context-parallel group: its communicator and how it splits and attends.
struct ContextParallel {
  dist::CommunicatorPtr cp;                   ///< the ranks that share every sequence
  CpLayout layout = CpLayout::Zigzag;         ///< which tokens each rank holds
  CpAttention attention = CpAttention::Ring;  ///< how keys and values travel
  bool overlap = true;  ///< ring: compute while blocks travel (false only to measure it)
};

/// ring_attention or all_gather_attention in chapter 03's attention-kernel slot.
class ContextParallelKernel : public ch03::AttentionKernel {
 public:
  /// Attends over the ranks of `group.cp` as `group.attention` says.
  explicit ContextParallelKernel(ContextParallel group) : group_(std::move(group)) {}
  ch03::AttentionOutput compute(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const torch::Tensor& q_positions,
                                const torch::Tensor& k_positions, double scale) const override;

 private:
  ContextParallel group_;
};

/// A training step with context parallelism around another step (chapter 09's, 10's or 11's),
/// built over the dp x cp ranks: each micro-batch is cut to this rank's tokens (shard_batch) and
/// the model attends with ContextParallelKernel; the inner step averages the gradients over dp x cp
/// as it would over data-parallel ranks. full_model() attends with chapter 03's kernel again (it
/// evaluates whole sequences).
class ContextParallelStep : public ch03::TrainingStep {
 public:
  /// `inner` must be made over the dp x cp ranks (it averages the gradients over them).
  ContextParallelStep(std::unique_ptr<ch03::TrainingStep> inner, ContextParallel group);
  /// Cuts each micro-batch to this rank's tokens (shard_batch), then runs the inner step.
  ch03::StepResult step(const std::vector<ch03::Batch>& micro_batches, int64_t step) override;
  ch03::Transformer& model() override { return inner_->model(); }
  /// The inner step's whole model with chapter 03's kernel (whole sequences on each rank). Where
  /// that is the model this step trains, the next step() puts back the kernel it trained with:
  /// the ring or all-gather kernel, or what a later chapter wrapped around it (chapter 14's
  /// selective recomputation).
  ch03::Transformer& full_model() override;
  io::TensorMap optimizer_state() override { return inner_->optimizer_state(); }
  io::TensorMap optimizer_state_for_writer() override {
    return inner_->optimizer_state_for_writer();
  }
  void load_optimizer_state(const io::TensorMap& state, const std::string& source) override {
    inner_->load_optimizer_state(state, source);
  }
  /// The inner step's: every rank's tokens reached them through its average over dp x cp.
  io::TensorMap gradients() override { return inner_->gradients(); }
  ch03::StateBytes state_bytes() override { return inner_->state_bytes(); }
  /// The step it wraps.
  ch03::TrainingStep& inner() { return *inner_; }

 private:
  std::unique_ptr<ch03::TrainingStep> inner_;
  ContextParallel group_;
  std::shared_ptr<const ch03::AttentionKernel> training_kernel_;  ///< set while evaluating
};

/// A ch03::StepFactory: `inner` (made over the dp x cp ranks) wrapped in ContextParallelStep.
ch03::StepFactory context_parallel_step(ch03::StepFactory inner, ContextParallel group);

}  // namespace fivefold::ch12
