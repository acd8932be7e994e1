#pragma once
/// @file ddp.h
/// @brief Chapter 09: data parallelism. Every rank holds the whole model and a slice of the
/// global batch; after backward, gradients are averaged over ranks so that every rank takes the
/// same optimizer step a single device would take on the whole batch.
///
/// Two ways to average: `all_reduce_gradients` (naive: one blocking all-reduce per parameter after
/// backward), and `DistributedDataParallel` (gradients packed into buckets, each all-reduced
/// asynchronously as soon as backward has produced all of its gradients, so communication overlaps
/// the rest of backward).

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <vector>

#include "fivefold/dist.h"

namespace fivefold::ch09 {

/// Naive data parallelism: averages every parameter's gradient over `comm`, one blocking
/// all-reduce per parameter, after backward. Parameters without a gradient on every rank keep
/// none; one with a gradient on some ranks gets the average with zeros for the others.
void all_reduce_gradients(dist::Communicator& comm, torch::nn::Module& model);

/// Settings of DistributedDataParallel.
struct DdpOptions {
  int64_t bucket_bytes =
      1 << 20;          ///< gradient bytes per bucket (PyTorch: 25 MiB; models here are small)
  bool overlap = true;  ///< false: reduce every bucket after backward (for comparison)
};

/// What the last synchronisation did (for the demo and the tests).
struct DdpStats {
  int64_t buckets = 0;               ///< buckets all-reduced
  int64_t launched_in_backward = 0;  ///< of those, launched by a hook while backward ran
  double wait_seconds = 0;           ///< time finish_gradient_sync spent waiting for the network
};

/// Bucketed, overlapped gradient averaging for a model (PyTorch's DDP, in miniature).
///
/// At construction, rank 0's parameters are broadcast (every rank starts equal) and the trainable
/// parameters are grouped into buckets of about `bucket_bytes`, in reverse order of registration
/// (backward produces the last layers' gradients first). A hook on each parameter's gradient
/// accumulator marks it ready; when a bucket is complete and every earlier bucket has been
/// launched, its gradients are copied into one flat buffer, divided by the world size and
/// all-reduced asynchronously on the communicator's issue thread while backward goes on.
/// Buckets launch in index order on every rank, so all ranks issue the same collectives in the
/// same order even if their hooks fire in different orders.
class DistributedDataParallel {
 public:
  /// Wraps `model` (kept alive here) for data parallelism over `comm`.
  DistributedDataParallel(std::shared_ptr<torch::nn::Module> model, dist::CommunicatorPtr comm,
                          DdpOptions options = {});
  ~DistributedDataParallel();
  DistributedDataParallel(const DistributedDataParallel&) = delete;
  DistributedDataParallel& operator=(const DistributedDataParallel&) = delete;

  /// Call after backward, before clipping and the optimizer step: launches the buckets still
  /// pending (those holding parameters that got no gradient in this backward, or all of them
  /// without overlap), waits for every all-reduce, and writes the averages back into the
  /// parameters' gradients. A parameter that got no gradient on any rank keeps none, as on a
  /// single device.
  void finish_gradient_sync();

  /// While a NoSync guard lives, backward passes only accumulate gradients locally (gradient
  /// accumulation: sync once, on the last micro-batch).
  class NoSync {
   public:
    /// Turns the hooks of `ddp` off until this guard goes away.
    explicit NoSync(DistributedDataParallel& ddp);
    ~NoSync();

   private:
    DistributedDataParallel& ddp_;
  };
  /// A NoSync guard for this wrapper.
  NoSync no_sync() { return NoSync(*this); }

  /// The buckets: indices into the trainable parameters, in launch order.
  const std::vector<std::vector<size_t>>& buckets() const { return buckets_; }
  /// What the last finish_gradient_sync did.
  const DdpStats& stats() const { return stats_; }

  /// The hook's work when parameter `index` (into the trainable parameters) has its gradient:
  /// mark it ready, then launch, in bucket order, every complete bucket not yet launched.
  /// **Exercise** (README, "The exercise").
  void mark_ready(size_t index);

 private:
  /// Flattens bucket `b`'s gradients (zeros where none) followed by one "has a gradient" flag per
  /// parameter, divides by the world size and starts its all-reduce: after it, a flag above zero
  /// means some rank had that gradient.
  void launch(size_t b);

  std::shared_ptr<torch::nn::Module> model_;
  dist::CommunicatorPtr comm_;
  DdpOptions options_;
  std::vector<torch::Tensor> params_;  // trainable, in registration order
  std::vector<std::shared_ptr<torch::autograd::Node>> accumulators_;  // kept alive for the hooks
  std::vector<uintptr_t> hook_keys_;  // to remove the hooks in the destructor
  std::vector<std::vector<size_t>> buckets_;
  std::vector<size_t> bucket_of_;         // parameter index -> bucket
  std::vector<int64_t> ready_in_bucket_;  // gradients ready, per bucket
  std::vector<bool> ready_;               // per parameter, this backward
  size_t next_bucket_ = 0;                // the next bucket to launch
  std::vector<torch::Tensor> flat_;       // per bucket: the buffer being reduced
  std::vector<dist::Work> work_;          // per bucket: its all-reduce
  bool in_backward_sync_ = true;          // false inside NoSync or finish
  DdpStats current_;                      // this backward so far
  DdpStats stats_;                        // the last finished synchronisation
};

}  // namespace fivefold::ch09
