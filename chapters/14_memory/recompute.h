#pragma once
/// @file recompute.h
/// @brief Chapter 14: activation recomputation. A training step keeps, from forward until
/// backward, every tensor backward will need: per layer many times the layer's input, and in
/// attention a [batch, heads, seq, seq] matrix that grows with the square of the sequence.
/// Recomputation keeps only a region's inputs instead, and runs the region's forward a second
/// time inside backward, with gradients on, to get them back:
///
///   full:       the region is a whole block; it keeps its input x [batch, seq, d_model] and costs
///               one more forward of every block (training FLOPs ~8NP instead of 6NP)
///   selective:  the region is the attention core (softmax(q·kᵀ)·v, the attention slot's kernel):
///               the s² part goes, the projections' activations stay; it costs the core's FLOPs
///
/// LibTorch's C++ API has no checkpoint function: `checkpoint` below is one, built on
/// torch::autograd::Function. Whatever runs inside a region runs twice, on every rank in the same
/// order: chapter 10's f and g, chapter 12's ring, chapter 13's all-to-alls and chapter 09's
/// ZeRO-3 gathers run again in backward exactly as in forward.

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "03_transformer/model.h"

namespace fivefold::ch14 {

/// What a region computes: tensors in, tensors out. It may read anything else it captures
/// (parameters, positions); only `inputs` get a gradient handed back from the region, the
/// parameters it uses accumulate theirs into .grad.
using Region = std::function<std::vector<torch::Tensor>(const std::vector<torch::Tensor>&)>;

/// Runs `region` on `inputs` without keeping anything it computes: the outputs are as
/// region(inputs) and carry gradients as if it had run with autograd on. Backward runs region
/// again on the same inputs, with gradients on and with the state the forward saw (the CPU random
/// generator and ch03::LossWeightScope), back-propagates the outputs' gradients through that second
/// run (the parameters it uses get theirs in .grad), and hands on the inputs' gradients. When no
/// input requires a gradient, or autograd is off, it is just region(inputs).
///
/// `kept` (empty, or one per input; an undefined one keeps its input) is what forward keeps of
/// an input in its place, for a region that reads that input only in a narrower or more compact
/// form: a bf16 copy of an fp32 input the region rounds to bf16 on entry, a view's own copy
/// without the rest of the storage it views. The second run gets it back in the input's own
/// type, so the region must give from it what it gives from the input, and the input's gradient
/// goes back in its own type (not rounded to the kept copy's).
std::vector<torch::Tensor> checkpoint(const Region& region,
                                      const std::vector<torch::Tensor>& inputs,
                                      const std::vector<torch::Tensor>& kept = {});

/// What recomputation covers.
enum class Recompute {
  None,       ///< keep every activation (chapter 03's training)
  Full,       ///< whole blocks: keep each recomputed block's input
  Selective,  ///< the attention core of every block: drop the softmax and its inputs' products
};

/// "none", "full" or "selective"; throws fivefold::Error for anything else, naming the choices.
Recompute parse_recompute(const std::string& name);
/// The name parse_recompute reads.
std::string to_string(Recompute mode);

/// Recomputation for one model (or one pipeline stage's part of it).
struct RecomputeConfig {
  Recompute mode = Recompute::None;  ///< what is recomputed
  /// Full recomputation of every `every`-th block only (global layer index i with i % every == 0;
  /// 1: every block): fewer FLOPs, more memory. Ignored unless mode is Full.
  int64_t every = 1;
  /// Under a pipeline (chapter 11): only stages 0 .. stages - 1 recompute; 0: every stage.
  /// 1F1B keeps p - r micro-batches in flight on stage r, so the first stages hold the most.
  int64_t stages = 0;
  /// What pipeline stage `stage` runs: this config, or None for a stage past `stages`.
  RecomputeConfig for_stage(int64_t stage) const {
    return stages > 0 && stage >= stages ? RecomputeConfig{Recompute::None, every, stages}
                                         : *this;
  }
};

/// Whether Full recomputation under `config` runs block `layer` (its global index) again:
/// mode Full and layer % every == 0. Selective recomputes every block's attention core instead.
bool recomputes_block(const RecomputeConfig& config, int64_t layer);
/// Whether block `layer`'s attention core runs again: Selective (every block), or a block Full
/// recomputes.
bool recomputes_attention(const RecomputeConfig& config, int64_t layer);
/// Installs `config` in `model`: Full sets its layer runner (ch03::TransformerImpl::
/// set_layer_runner) to run the chosen blocks through `checkpoint`; Selective wraps the attention
/// kernel each attention layer holds now (install the other kernels first) in
/// RecomputedAttentionKernel; None removes both. Forward with a KV cache (generation) is never
/// recomputed. Throws fivefold::Error for every < 1.
void apply_recompute(ch03::Transformer& model, const RecomputeConfig& config);

/// Selective recomputation: `inner`'s attend run through `checkpoint` with q, k and v its inputs,
/// so that what the kernel computes (scores, probabilities) is not kept for backward. For a kernel
/// that takes narrow inputs, under products narrower than fp32 (chapter 14's bf16), it keeps k
/// and v as that kernel reads them, the products' operands (ch03::matmul_operand), in storage of
/// their own; q as it comes (the tiled kernel scales it before rounding).
class RecomputedAttentionKernel : public ch03::AttentionKernel {
 public:
  /// Wraps `inner` (not null).
  explicit RecomputedAttentionKernel(std::shared_ptr<const ch03::AttentionKernel> inner);
  ch03::AttentionOutput compute(const torch::Tensor& q, const torch::Tensor& k,
                                const torch::Tensor& v, const torch::Tensor& q_positions,
                                const torch::Tensor& k_positions, double scale) const override;
  /// The kernel wrapped.
  const std::shared_ptr<const ch03::AttentionKernel>& inner() const { return inner_; }
  /// As `inner`: q, k and v reach the checkpoint, and are kept, as `inner` takes them (bf16 as
  /// they come for the fast paths' tiled kernel; widened to fp32 first for the lesson's).
  bool takes_narrow_inputs() const override { return inner_->takes_narrow_inputs(); }

 private:
  std::shared_ptr<const ch03::AttentionKernel> inner_;
};

}  // namespace fivefold::ch14
