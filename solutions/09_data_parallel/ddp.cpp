// Chapter 09 plumbing: naive data parallelism, and DDP's buckets, hooks and final wait.

#include "09_data_parallel/ddp.h"

#include <torch/csrc/autograd/utils/lambda_post_hook.h>

#include "fivefold/error.h"
#include "fivefold/timer.h"

namespace fivefold::ch09 {

namespace {
// The buffer one all-reduce averages: the gradients of `params`, flattened (zeros where a parameter
// has none), then one "has a gradient" flag per parameter; all divided by the ranks `n`, so that
// the sum over ranks is the mean and a flag above zero means some rank had that gradient.
torch::Tensor pack_gradients(const std::vector<torch::Tensor>& params, int n) {
  std::vector<torch::Tensor> parts, flags;
  for (const auto& p : params) {
    const auto& g = p.grad();
    parts.push_back(g.defined() ? g.reshape(-1) : torch::zeros({p.numel()}));
    flags.push_back(torch::full({1}, g.defined() ? 1.0f : 0.0f));
  }
  parts.insert(parts.end(), flags.begin(), flags.end());
  return torch::cat(parts) / static_cast<double>(n);
}

// Writes the averaged gradients of a reduced pack_gradients buffer back: into each existing
// gradient, or as a new tensor (never a view of the communication buffer, which the optimizer's
// zero_grad could not detach). A parameter whose gradient no rank had keeps none.
void unpack_gradients(std::vector<torch::Tensor>& params, const torch::Tensor& flat) {
  const int64_t first_flag = flat.size(0) - static_cast<int64_t>(params.size());
  int64_t offset = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    auto& p = params[k];
    if (flat[first_flag + static_cast<int64_t>(k)].item<float>() > 0) {
      auto average = flat.narrow(0, offset, p.numel()).view_as(p);
      if (p.grad().defined()) {
        p.mutable_grad().copy_(average);
      } else {
        p.mutable_grad() = average.to(p.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
      }
    }
    offset += p.numel();
  }
}
}  // namespace

void all_reduce_gradients(dist::Communicator& comm, torch::nn::Module& model) {
  for (auto& p : model.parameters()) {
    if (!p.requires_grad()) continue;
    // One blocking all-reduce per parameter; every rank joins every one, used or not.
    std::vector<torch::Tensor> one = {p};
    auto buffer = pack_gradients(one, comm.size());
    comm.all_reduce(buffer);
    unpack_gradients(one, buffer);
  }
}

DistributedDataParallel::DistributedDataParallel(std::shared_ptr<torch::nn::Module> model,
                                                 dist::CommunicatorPtr comm, DdpOptions options)
    : model_(std::move(model)), comm_(std::move(comm)), options_(options) {
  FIVEFOLD_CHECK(options_.bucket_bytes > 0, "DDP: bucket_bytes must be positive");
  {  // Every rank starts from rank 0's parameters.
    torch::NoGradGuard no_grad;
    for (auto& p : model_->parameters()) comm_->broadcast(p, 0);
  }
  for (auto& p : model_->parameters()) {
    if (p.requires_grad()) params_.push_back(p);
  }
  // Buckets in reverse registration order: the gradients backward produces first.
  bucket_of_.resize(params_.size());
  int64_t bytes = 0;
  for (size_t i = params_.size(); i-- > 0;) {
    const int64_t size = params_[i].numel() * params_[i].element_size();
    if (buckets_.empty() || (bytes > 0 && bytes + size > options_.bucket_bytes)) {
      buckets_.emplace_back();
      bytes = 0;
    }
    buckets_.back().push_back(i);
    bucket_of_[i] = buckets_.size() - 1;
    bytes += size;
  }
  ready_in_bucket_.assign(buckets_.size(), 0);
  ready_.assign(params_.size(), false);
  flat_.resize(buckets_.size());
  work_.resize(buckets_.size());
  // A hook on each parameter's gradient accumulator: it runs once the gradient of this backward
  // has been added into p.grad(). The accumulators are kept alive here (the parameter holds only
  // a weak reference to its accumulator).
  for (size_t i = 0; i < params_.size(); ++i) {
    auto accumulator = torch::autograd::impl::grad_accumulator(params_[i]);
    hook_keys_.push_back(
        accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
            [this, i](const torch::autograd::variable_list& outputs,
                      const torch::autograd::variable_list&) {
              if (in_backward_sync_ && options_.overlap) mark_ready(i);
              return outputs;
            })));
    accumulators_.push_back(accumulator);
  }
}

DistributedDataParallel::~DistributedDataParallel() {
  for (size_t i = 0; i < accumulators_.size(); ++i) accumulators_[i]->del_post_hook(hook_keys_[i]);
  // All-reduces launched by a backward whose sync never finished still use their buffers.
  for (size_t b = 0; b < next_bucket_; ++b) work_[b].wait();
}

void DistributedDataParallel::launch(size_t b) {
  std::vector<torch::Tensor> bucket;
  for (size_t i : buckets_[b]) bucket.push_back(params_[i]);
  flat_[b] = pack_gradients(bucket, comm_->size());
  work_[b] = comm_->all_reduce_async(flat_[b]);
  ++current_.buckets;
  if (in_backward_sync_) ++current_.launched_in_backward;
}

void DistributedDataParallel::finish_gradient_sync() {
  in_backward_sync_ = false;
  // Launch what backward did not (parameters without a gradient this time; everything without
  // overlap), still in bucket order.
  while (next_bucket_ < buckets_.size()) launch(next_bucket_++);
  Timer timer;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    work_[b].wait();
    std::vector<torch::Tensor> bucket;
    for (size_t i : buckets_[b]) bucket.push_back(params_[i]);
    unpack_gradients(bucket, flat_[b]);
  }
  current_.wait_seconds = timer.seconds();
  stats_ = current_;
  current_ = DdpStats{};
  // Ready for the next backward.
  std::fill(ready_.begin(), ready_.end(), false);
  std::fill(ready_in_bucket_.begin(), ready_in_bucket_.end(), 0);
  next_bucket_ = 0;
  in_backward_sync_ = true;
}

DistributedDataParallel::NoSync::NoSync(DistributedDataParallel& ddp) : ddp_(ddp) {
  ddp_.in_backward_sync_ = false;
}

DistributedDataParallel::NoSync::~NoSync() { ddp_.in_backward_sync_ = true; }

}  // namespace fivefold::ch09
