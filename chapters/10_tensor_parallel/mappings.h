#pragma once
/// @file mappings.h
/// @brief Chapter 10: communication inside autograd. Each function here is one communication
/// pattern with its conjugate in backward, as Megatron-LM's `mappings.py` has them; the parallel
/// layers of chapters 10-15 are built from these and nothing else.
///
/// Tensor parallelism splits a layer's matrix over the tp ranks. Two operators make the split
/// layer compute, and differentiate, exactly as the whole one (Shoeybi et al. 2019, Megatron-LM):
///
///   f: forward identity,   backward all-reduce   (where a replicated input enters split matrices)
///   g: forward all-reduce, backward identity     (where split matrices' partial outputs are
///   summed)
///
/// f and g are conjugate: each one's backward is the other's forward. With sequence parallelism
/// (Korthikanti et al. 2022) the activations between the split layers are split along the
/// sequence, and f and g become an all-gather and a reduce-scatter along the sequence (again each
/// other's conjugate). Together the two move the same bytes as one all-reduce.
///
/// Sequence tensors are [batch, seq, ...] and are split along dim 1 into parts sized by
/// fivefold::split_sizes (uneven when tp does not divide seq). Every rank of `tp` must call the
/// same functions in the same order, forward and backward.

#include <torch/torch.h>

#include <cstdint>
#include <vector>

#include "03_transformer/seams.h"
#include "fivefold/dist.h"

namespace fivefold::ch10 {

/// f: returns x unchanged; in backward, the gradient is summed over `tp`. Every rank of `tp` holds
/// the same x and feeds it to its slice of a column-parallel layer: x's gradient is the sum of the
/// slices' contributions. **Exercise** (README, "The exercise").
torch::Tensor copy_to_tensor_parallel(const torch::Tensor& x, const dist::CommunicatorPtr& tp);

/// g: returns the sum of x over `tp` (every rank's partial output of a row-parallel layer); in
/// backward, the gradient passes unchanged (each partial sum contributed once to the total).
/// **Exercise**, with copy_to_tensor_parallel.
torch::Tensor reduce_from_tensor_parallel(const torch::Tensor& x, const dist::CommunicatorPtr& tp);

/// Sequence parallelism's f: x [batch, seq_r, ...], this rank's part of the sequence ->
/// [batch, seq, ...], every rank's parts in rank order (all-gather); in backward, the gradient is
/// summed over `tp` and each rank keeps its part (reduce-scatter). `seq` is the whole length.
torch::Tensor gather_from_sequence_parallel(const torch::Tensor& x, int64_t seq,
                                            const dist::CommunicatorPtr& tp);

/// Sequence parallelism's g: x [batch, seq, ...], a partial sum on every rank -> this rank's part
/// of the sum, [batch, seq_r, ...] (reduce-scatter); in backward, the parts are gathered
/// (all-gather).
torch::Tensor reduce_scatter_to_sequence_parallel(const torch::Tensor& x,
                                                  const dist::CommunicatorPtr& tp);

/// x [batch, seq, ...], the same on every rank -> this rank's part [batch, seq_r, ...] (no
/// communication); in backward, the parts' gradients are gathered (all-gather). Used to enter the
/// sequence-parallel region from a replicated tensor.
torch::Tensor scatter_to_sequence_parallel(const torch::Tensor& x, const dist::CommunicatorPtr& tp);

/// Sequence parallelism's gathered input as the split products after the gather keep it for their
/// weights' gradients (ch03::RemadeInput): this rank's part of the sequence, in the matmul
/// kernel's operand form (bf16 under chapter 14's kernel), gathered again the first time backward
/// asks for the whole, and let go once every product that reads it has asked (Korthikanti et al.
/// 2022: the norms' outputs kept 1/t on each rank, at the price of one more all-gather each in
/// backward).
class GatheredSequence : public ch03::RemadeInput {
 public:
  /// `part` [batch, seq_r, ...], this rank's part of a sequence of `seq` positions split over `tp`.
  GatheredSequence(const torch::Tensor& part, int64_t seq, dist::CommunicatorPtr tp);
  /// One more product reads the whole (each asks remake() once in backward).
  void add_reader() { ++readers_; }
  /// The whole [batch, seq, ...]: all-gathered on the first call, kept for the other readers.
  torch::Tensor remake() override;

 private:
  torch::Tensor part_, whole_;
  int64_t seq_;
  dist::CommunicatorPtr tp_;
  int readers_ = 0;
};

/// This rank's part of a sequence of `seq` positions: [first, first + length).
struct SequencePart {
  int64_t first = 0;   ///< first position held
  int64_t length = 0;  ///< positions held
};

/// The part rank `rank` of `size` holds (fivefold::split_sizes: the first seq % size ranks hold
/// one position more).
SequencePart sequence_part(int64_t seq, int rank, int size);

/// Keeps `comm` in an autograd context for the backward of a function that communicates (chapter
/// 12's ring attention uses it too).
void save_communicator(torch::autograd::AutogradContext* ctx, const dist::CommunicatorPtr& comm);

/// The communicator save_communicator kept.
dist::CommunicatorPtr saved_communicator(torch::autograd::AutogradContext* ctx);

/// All-gather along the sequence, outside autograd: x [batch, seq_r, ...] -> [batch, seq, ...],
/// every rank's part in rank order.
torch::Tensor all_gather_sequence(const torch::Tensor& x, int64_t seq, dist::Communicator& tp);

/// Reduce-scatter along the sequence, outside autograd: x [batch, seq, ...] -> this rank's part of
/// the sum over `tp`, [batch, seq_r, ...].
torch::Tensor reduce_scatter_sequence(const torch::Tensor& x, dist::Communicator& tp);

}  // namespace fivefold::ch10
