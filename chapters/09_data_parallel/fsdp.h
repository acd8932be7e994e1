#pragma once
/// @file fsdp.h
/// @brief Chapter 09: ZeRO-3, fully sharded data parallelism (FSDP) for chapter 03's model. The
/// parameters themselves are sharded: between steps each rank keeps only its shard of every unit
/// (the root: embedding, final norm and LM head; then each block), 4Ψ/N bytes in all. A unit is
/// all-gathered just before its forward and freed just after; gathered again when backward reaches
/// it; and when backward has moved past it, its gradients are reduce-scattered to their shards and
/// its parameters freed. Per step: two all-gathers and one reduce-scatter of every parameter,
/// 3(N − 1)/N·4Ψ bytes on the wire per rank, 1.5x DDP's all-reduce.

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "03_transformer/data.h"
#include "03_transformer/model.h"
#include "03_transformer/train.h"
#include "09_data_parallel/zero.h"
#include "fivefold/dist.h"

namespace fivefold::ch09 {

/// ZeRO-3 data parallelism of a chapter 03 Transformer (with whatever position encoding is
/// installed) and AdamW, equal to torch::optim::AdamW with make_optimizer's groups and clipping by
/// the global gradient norm.
///
/// Freeing a parameter releases its storage's memory but keeps the tensor, its shape and its place
/// in autograd's saved tensors; gathering fills the same storage again, without counting as an
/// in-place change. That is how backward finds the weights it saved in forward. The hooks refer
/// to this object: keep it alive while a graph built by its forward may still run backward.
/// Only the optimizer changes parameters here: a parameter updated by other code between steps
/// (chapter 07's balancing bias) would have to be updated in its shard, which this class does not
/// offer yet.
class FullyShardedDataParallel {
 public:
  /// Broadcasts rank 0's parameters, keeps this rank's shard of each unit, frees the rest.
  /// `groups` as for ZeroOptimizer (partial gradients are summed as each unit is released). With
  /// config.param_dtype below fp32 (chapter 14) the fp32 shards are master weights: the units
  /// are gathered from their rounding (kept beside them, 2 bytes a number in bf16), computed in
  /// that type, their gradients reduce-scattered in fp32 into shards of that type.
  FullyShardedDataParallel(ch03::Transformer model, dist::CommunicatorPtr comm,
                           ch03::TrainConfig config, ModelParallelGroups groups = {});
  FullyShardedDataParallel(const FullyShardedDataParallel&) = delete;
  FullyShardedDataParallel& operator=(const FullyShardedDataParallel&) = delete;

  /// tokens [batch, seq] -> logits [batch, seq, vocab], as the model's forward (no KV cache), each
  /// unit gathered just before its part and freed just after. With gradients enabled, hooks on the
  /// units' outputs gather each unit again when backward reaches it.
  torch::Tensor forward(const torch::Tensor& tokens);
  /// The mean loss of `batch` (the model's output slot), computed as forward does.
  torch::Tensor loss(const ch03::Batch& batch);

  /// After backward (one or more: gradients accumulate in the shards): reduce-scatter the units
  /// backward left gathered, clip by the global norm, AdamW on this rank's shard with
  /// learning_rate(config, step). The parameters stay sharded until the next forward. Returns the
  /// global gradient norm before clipping.
  double step(int64_t step);

  /// Zeroes the gradient shards before the next step's backward.
  void zero_grad();

  /// Gathers every unit into the model (for a checkpoint, a comparison, generation) until the next
  /// step: with master weights, the masters themselves (fp32) until round_parameters().
  void gather_full_parameters();
  /// After gather_full_parameters with master weights: the parameters in their own type again,
  /// still gathered (no communication). Otherwise nothing.
  void round_parameters();

  /// Gathers every unit for a forward and backward run outside this wrapper (chapter 11's pipeline
  /// runs its layers micro-batch by micro-batch): the part stays gathered for the whole step, as
  /// FSDP under a pipeline usually runs (no gather per micro-batch), and step() reduce-scatters
  /// every unit's gradients.
  void gather_for_step();

  /// The bytes this rank holds now, measured from the tensors: parameters (shards and any unit
  /// gathered), gradients (shards and any full gradient), AdamW's moments.
  ZeroMemory memory() const;

  /// The most bytes of gathered (full) parameters held at once since construction.
  int64_t peak_gathered_bytes() const { return peak_gathered_bytes_; }

  /// The units' parameter counts: unit 0 is the root (embedding, final norm, LM head, and any
  /// parameter outside the blocks), unit 1 + i is block i.
  std::vector<int64_t> unit_numels() const;

  /// The wrapped model. Its parameters are empty while sharded: call gather_full_parameters()
  /// before using it without this wrapper.
  ch03::Transformer& model() { return model_; }

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
  io::TensorMap gradients() const { return unshard(adam_->layout(), grads_, named_, *comm_); }

 private:
  struct Unit {
    std::vector<torch::Tensor> params;  // the model's own tensors, registration order
    int64_t first = 0;  // index of its first parameter in params_ (the rest follow in order)
    int64_t numel = 0, shard = 0, offset = 0;  // offset: where its shard sits in the local vectors
    bool gathered = false;
    bool pending = false;  // gathered by backward: its gradients still to reduce-scatter
  };

  void gather(Unit& unit);     // all-gather the shards into the parameters' storage
  void free(Unit& unit);       // release the parameters' storage (shape and autograd state stay)
  void release(Unit& unit);    // reduce-scatter the gradients into the shard, drop them, free
  void on_backward(size_t u);  // backward reached unit u: release the unit after it, gather u
  // Embedding and every block, each unit gathered for its part; the root is left gathered.
  torch::Tensor hidden(const torch::Tensor& tokens, const torch::Tensor& positions);
  // Frees the root after the head, and gathers it again when backward reaches `output`.
  torch::Tensor finish(const torch::Tensor& output);
  torch::Tensor param_shard(const Unit& unit) { return shards_.narrow(0, unit.offset, unit.shard); }
  // What a unit is gathered from: its shard in the parameters' type.
  torch::Tensor gathered_shard(const Unit& unit) {
    return (rounded_.defined() ? rounded_ : shards_).narrow(0, unit.offset, unit.shard);
  }
  torch::Tensor grad_shard(const Unit& unit) { return grads_.narrow(0, unit.offset, unit.shard); }

  ch03::Transformer model_;
  dist::CommunicatorPtr comm_;
  ch03::TrainConfig config_;
  std::vector<Unit> units_;                                   // root, then the blocks
  std::vector<torch::Tensor> params_;                         // all parameters, in the units' order
  std::vector<std::pair<std::string, torch::Tensor>> named_;  // the same, with their names
  torch::Tensor shards_, grads_;  // this rank's shards of every unit, one after another
  torch::Tensor rounded_;         // shards_ in the parameters' type; undefined: they are fp32
  int64_t param_bytes_ = 4;       // bytes of a parameter's number
  bool revealed_ = false;         // the parameters hold the fp32 masters (gather_full_parameters)
  torch::Tensor has_gradient_;    // [params]: 1 where this rank had a gradient this step
  torch::Tensor had_gradient_;    // [params]: 1 once some rank has had one (ZeroOptimizer's)
  std::unique_ptr<ShardedAdamW> adam_;
  ModelParallelGroups groups_;
  torch::Tensor norm_mask_;  // undefined: every element counts
  int64_t gathered_bytes_ = 0, peak_gathered_bytes_ = 0;
};

}  // namespace fivefold::ch09
