#pragma once
/// @file zero.h
/// @brief Chapter 09: ZeRO stages 1 and 2 (Rajbhandari et al. 2020) for fp32 AdamW. The
/// trainable parameters are viewed as one flat vector of Ψ numbers, padded to a multiple of N and
/// cut into N equal shards; rank r owns shard r of the optimizer state (stage 1) and, in stage 2,
/// of the gradients too. A step reduce-scatters the gradients (each rank receives the average of
/// its shard), updates its shard of the parameters with its shard of AdamW's state, and
/// all-gathers the parameters: the same 2(N − 1)/N·Ψ per rank on the wire as DDP's all-reduce.

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "03_transformer/train.h"
#include "fivefold/dist.h"
#include "fivefold/io.h"

namespace fivefold::ch09 {

/// Bytes this rank keeps between steps, by kind (what the ZeRO formulas count): the parameters
/// (all of them in stages 1 and 2), the gradients kept (the full ones in stage 1, this rank's
/// shard in 2), AdamW's two moments for this rank's shard. Chapter 03's StateBytes, which every
/// training step reports.
using ZeroMemory = ch03::StateBytes;

/// The ZeRO formulas, AdamW, per rank, for Ψ trainable numbers over N ranks (s = ⌈Ψ/N⌉), with
/// the parameters kept in fp32 (`param_bytes` 4): stage 0 (DDP) 4Ψ + 4Ψ + 8Ψ; 1: 4Ψ + 4Ψ + 8s;
/// 2: 4Ψ + 4s + 8s; 3: 4s + 4s + 8s. In mixed precision (`param_bytes` 2: bf16 parameters and
/// gradients, fp32 master weights beside the moments, chapter 14) the paper's 2Ψ + 2Ψ + 12Ψ:
/// 1: 2Ψ + 2Ψ + 12s; 2: 2Ψ + 2s + 12s; 3: 2s + 2s + 12s.
ZeroMemory zero_memory_formula(int64_t psi, int64_t ranks, int stage, int64_t param_bytes = 4);

/// The part of one parameter that falls in a rank's shard.
struct ShardSegment {
  int64_t param = 0;    ///< the parameter's index
  int64_t first = 0;    ///< its first element in the shard (flat index into the parameter)
  int64_t begin = 0;    ///< where that element sits in the shard
  int64_t length = 0;   ///< elements
  bool decays = false;  ///< weight decay applies (make_optimizer's groups)
};

/// Rank r's shard of a flat vector of parameters (their elements in order, padded with zeros to
/// a multiple of N and cut into N equal shards): which pieces of which parameters it holds.
struct ShardLayout {
  int64_t numel = 0;                   ///< the parameters' elements (before padding)
  int64_t shard = 0;                   ///< elements per shard: ceil(numel / N)
  std::vector<ShardSegment> segments;  ///< in shard order; the rest of the shard is padding
};

/// The layout of `params` (name, tensor) over `ranks`, seen from `rank`. Parameter k's index is
/// first_index + k. Decay as make_optimizer groups: matrices decay, norms don't, nor does the
/// embedding unless config.decay_embeddings.
ShardLayout shard_layout(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                         int64_t first_index, int ranks, int rank, const ch03::TrainConfig& config);

/// The gradients of `params` as one flat vector of `padded_numel` numbers (at least their total:
/// zeros pad the end and stand in for a missing gradient), divided by `ranks` so that a sum over
/// the ranks is their mean: what ZeRO reduce-scatters. Sets has_gradient[first_index + k] to 1 for
/// each parameter k that has a gradient.
torch::Tensor pack_padded_gradients(const std::vector<torch::Tensor>& params, int64_t padded_numel,
                                    int ranks, torch::Tensor& has_gradient, int64_t first_index);

/// The whole tensors of `params` ((name, parameter), index order; only shapes are read), in fp32,
/// from every rank's `shard` laid out as `layout` (this rank's): every other rank sends rank 0 of
/// `comm` its pieces (where each lies, then the shard), and rank 0 writes them into zeroed
/// full-size tensors; then rank 0 broadcasts them, or, with `to_rank0`, keeps them alone (an empty
/// map elsewhere: the others hold nothing more than their shard). Collective. Used to consolidate
/// sharded optimizer state (a checkpoint's writer: `to_rank0`) and gradients by parameter name.
io::TensorMap unshard(const ShardLayout& layout, const torch::Tensor& shard,
                      const std::vector<std::pair<std::string, torch::Tensor>>& params,
                      dist::Communicator& comm, bool to_rank0 = false);

/// What a data-parallel step must know of the ranks that hold other pieces of the model (chapter
/// 10 onwards): for each parameter, the groups beyond data parallelism that reduce or count its
/// gradient. Data parallelism itself averages every gradient over its group; empty groups mean
/// every rank of that group holds the whole model (this chapter alone).
struct ModelParallelGroups {
  /// Parameters whose gradient on this rank is a partial sum, by name, and the group to sum it
  /// over: tp for the norms under sequence parallelism (chapter 10), the first and last pipeline
  /// stage for a tied embedding (chapter 11), the expert-parallel ranks for every weight they
  /// replicate (chapter 13). A name may have several groups (a norm under sequence parallelism
  /// with experts over ep): it is summed over each in turn, in the order they were added.
  std::multimap<std::string, dist::CommunicatorPtr> partial;
  /// Parameters of which an identical copy is counted in the global norm on another rank of
  /// `norm` (a parameter replicated over tp is counted on tp rank 0 only).
  std::set<std::string> counted_elsewhere;
  /// The groups whose ranks hold different pieces of the model (tp; tp x pp; ep ...): the
  /// squared gradient norm is summed over each in turn. Empty: none.
  std::vector<dist::CommunicatorPtr> norm;
};

/// Adds up the partial gradients of `params` (name, parameter) over their groups, in place: one
/// all-reduce per group, of all that group's gradients packed together, the groups in the order
/// their first parameter's name sorts (the same order on every rank; a name's groups in the order
/// they were added). Parameters without a gradient count as zeros.
void reduce_partial_gradients(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                              const ModelParallelGroups& groups);

/// 1 for the elements of `layout`'s shard that this rank counts in the global norm, 0 for those
/// of parameters counted elsewhere; undefined when every element counts. `params`: (name,
/// parameter) in the layout's index order.
torch::Tensor norm_mask(const ShardLayout& layout,
                        const std::vector<std::pair<std::string, torch::Tensor>>& params,
                        const ModelParallelGroups& groups);

/// Sums `squares` (this rank's share of the squared norm, double [1]) over `comm` (when the
/// pieces are sharded over it) and over each of `groups.norm`, and returns the square root: the
/// global gradient norm.
double global_norm(torch::Tensor squares, dist::Communicator* comm,
                   const ModelParallelGroups& groups);

/// Clips a gradient sharded over `comm` by its global norm (each rank knows the squares of its
/// own shard, weighted by `mask` when defined: one all-reduce of a number over `comm`, and one
/// over groups.norm). Returns the norm before clipping.
double clip_sharded_gradient(torch::Tensor& grad_shard, dist::Communicator& comm, double max_norm,
                             const torch::Tensor& mask = {},
                             const ModelParallelGroups& groups = {});

/// 1 for each of `params` that `state` (adamw::state_by_name's layout) holds moments for, else 0: the
/// parameters that had a gradient before the state was saved. One device's AdamW keeps stepping
/// those (LibTorch's zero_grad zeroes a gradient, it does not drop it), so a resumed ZeRO step
/// must too.
torch::Tensor had_gradients(const io::TensorMap& state,
                            const std::vector<std::pair<std::string, torch::Tensor>>& params);

/// AdamW on this rank's shard: the operations of torch::optim::AdamW, in the same order, on each
/// parameter's piece of the shard, with make_optimizer's decay and one step count per parameter. A
/// parameter that got a gradient on no rank is skipped, as AdamW skips a parameter without a
/// gradient (its elements, moments and step count stay as they are). ZeRO-1/2 and FSDP share it.
class ShardedAdamW {
 public:
  /// Zero moments for `layout`'s shard; `n_params` parameters in all (indices 0 .. n_params − 1).
  ShardedAdamW(ShardLayout layout, int64_t n_params, ch03::TrainConfig config);
  /// Updates `shard` [layout.shard] in place with `grad` [same]; `has_gradient` [n_params] > 0
  /// marks the parameters that take this step. The learning rate is learning_rate(config, step).
  void step(torch::Tensor& shard, const torch::Tensor& grad, const torch::Tensor& has_gradient,
            int64_t step);
  /// Bytes of the two moments (8 per element of the shard).
  int64_t state_bytes() const { return (exp_avg_.numel() + exp_avg_sq_.numel()) * 4; }

  /// The whole state under parameter names, in adamw::state_by_name's layout, on every rank of
  /// `comm` (collective, unshard). `params`: (name, parameter) in index order (the parameters'
  /// shapes are read; their storage may be freed). `to_rank0`: on rank 0 of `comm` alone (an
  /// empty map elsewhere), the others sending their shards and holding nothing more.
  io::TensorMap state(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                      dist::Communicator& comm, bool to_rank0 = false) const;
  /// Keeps this rank's pieces of `state` (that layout, read from `source`, named in errors).
  void load_state(const io::TensorMap& state,
                  const std::vector<std::pair<std::string, torch::Tensor>>& params,
                  const std::string& source);
  /// The shard's layout.
  const ShardLayout& layout() const { return layout_; }

 private:
  ShardLayout layout_;
  ch03::TrainConfig config_;
  std::vector<int64_t> steps_;          // per parameter: AdamW steps taken
  torch::Tensor exp_avg_, exp_avg_sq_;  // [shard]
};

/// ZeRO-1 or ZeRO-2 data parallelism with AdamW: the same update as torch::optim::AdamW with
/// make_optimizer's two groups (matrices decay, norms and the embedding do not), clipping by the
/// global gradient norm. A parameter that got a gradient on no rank is skipped, as AdamW skips a
/// parameter without a gradient (its step count does not advance); frozen parameters are left out.
class ZeroOptimizer {
 public:
  /// Broadcasts rank 0's parameters, lays out the shards. `stage` is 1 or 2. `groups`: the
  /// model-parallel groups of the parameters (partial gradients summed before the reduce-scatter,
  /// the norm counted once over them). With config.param_dtype below fp32 (chapter 14) this rank
  /// keeps its shard of fp32 master weights, rounds the parameters to that type, reduce-scatters
  /// the gradients in fp32 (the shard kept in the parameters' type) and all-gathers the updated
  /// parameters in their type.
  ZeroOptimizer(std::shared_ptr<torch::nn::Module> model, dist::CommunicatorPtr comm, int stage,
                ch03::TrainConfig config, ModelParallelGroups groups = {});

  /// After backward: reduce-scatter the gradients to this rank's shard (their mean over ranks),
  /// clip by the global norm, AdamW on the shard with learning_rate(config, step), all-gather the
  /// parameters. Stage 2 drops the full gradients as soon as they are copied. Returns the global
  /// gradient norm before clipping.
  double step(int64_t step);

  /// Zeroes (stage 1, like LibTorch 1.13's zero_grad) or drops (stage 2, like set_to_none) the
  /// gradients before the next backward. The difference shows for a parameter that had a gradient
  /// last step and none this step: stage 1 steps it with a zero gradient, stage 2 skips it.
  void zero_grad();

  /// The bytes this rank keeps, measured from the tensors it holds (the master weights' shard
  /// with the optimizer's). Stage 1 keeps no gradient shard between steps: the reduced shard is
  /// written back over this rank's range of the full gradients it keeps anyway.
  ZeroMemory memory() const;

  /// With master weights: the parameters become the whole masters (fp32, all-gathered;
  /// collective) until round_parameters(), for a checkpoint. Otherwise nothing.
  void reveal_masters();
  /// With master weights: parameters revealed become their rounding again (no communication).
  void round_parameters();

  /// Ψ (trainable numbers).
  int64_t numel() const { return layout_.numel; }
  /// Numbers per shard (ceil(Ψ / N)).
  int64_t shard_numel() const { return layout_.shard; }

  /// AdamW's state by parameter name, complete on every rank (collective; ShardedAdamW::state),
  /// or, with `to_rank0`, on rank 0 alone.
  io::TensorMap optimizer_state(bool to_rank0 = false) const {
    return adam_->state(named_, *comm_, to_rank0);
  }
  /// Keeps this rank's part of a state in that layout. A parameter with moments there had a
  /// gradient before it was saved: it is stepped from now on, as in the run never interrupted.
  void load_optimizer_state(const io::TensorMap& state, const std::string& source) {
    adam_->load_state(state, named_, source);
    had_gradient_ = had_gradients(state, named_);
  }
  /// The last step's gradient shards (the mean over the ranks, after clipping), whole, by
  /// parameter name; complete on every rank (collective).
  io::TensorMap gradients() const;

 private:
  std::shared_ptr<torch::nn::Module> model_;
  dist::CommunicatorPtr comm_;
  int stage_;
  ch03::TrainConfig config_;
  std::vector<torch::Tensor> params_;                         // trainable, in registration order
  std::vector<std::pair<std::string, torch::Tensor>> named_;  // the same, with their names
  ShardLayout layout_;
  std::unique_ptr<ShardedAdamW> adam_;
  torch::Tensor grad_shard_;  // [shard], stage 2's gradients, kept after the step (gradients())
  torch::Tensor master_;      // [shard] fp32 master weights; undefined: the parameters are fp32
  ModelParallelGroups groups_;
  torch::Tensor norm_mask_;  // undefined: every element counts
  // This rank's shard of the parameters as they are now, a new fp32 [shard] (padding zero); or
  // (`gradients`) of their gradients, in the parameters' type (zeros where one has none).
  torch::Tensor shard_of_parameters(bool gradients = false) const;
  // 1 for each parameter that has had a gradient on some rank: on one device its gradient then
  // stays (zeroed, not freed), so AdamW keeps stepping it even in a step that gives it none (an
  // expert no token chose). Stage 2 frees the full gradients, so it remembers here.
  torch::Tensor had_gradient_;
};

}  // namespace fivefold::ch09
