// Chapter 09: ZeRO-3 / FSDP, units gathered before use, freed after, gathered again for backward.

#include "09_data_parallel/fsdp.h"

#include <cmath>
#include <c10/core/CPUAllocator.h>

#include <algorithm>
#include <string>
#include <utility>

#include "fivefold/error.h"

namespace fivefold::ch09 {

namespace {
// The unit of a parameter: 1 + i for "model.layers.{i}....", 0 (the root) for the rest.
size_t unit_of(const std::string& name) {
  const std::string prefix = "model.layers.";
  if (name.rfind(prefix, 0) != 0) return 0;
  return 1 + std::stoul(name.substr(prefix.size(), name.find('.', prefix.size()) - prefix.size()));
}
}  // namespace

FullyShardedDataParallel::FullyShardedDataParallel(ch03::Transformer model,
                                                   dist::CommunicatorPtr comm,
                                                   ch03::TrainConfig config,
                                                   ModelParallelGroups groups)
    : model_(std::move(model)),
      comm_(std::move(comm)),
      config_(config),
      groups_(std::move(groups)) {
  config_.validate();
  torch::NoGradGuard no_grad;
  const int n = comm_->size(), r = comm_->rank();
  units_.resize(1 + model_->config().n_layers);
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> named(units_.size());
  for (auto& item : model_->named_parameters()) {
    const auto& p = item.value();
    FIVEFOLD_CHECK(p.is_contiguous() && p.storage_offset() == 0 &&
                       p.storage().nbytes() == static_cast<size_t>(p.numel() * p.element_size()),
                   "FSDP: parameter ", item.key(), " must own its storage exactly");
    comm_->broadcast(item.value(), 0);  // every rank starts from rank 0's weights
    // A parameter no gradient reaches (chapter 07's balancing bias, changed after each step by
    // the balancing update) stays whole on every rank, as the optimizer never sees it.
    if (!p.requires_grad()) continue;
    named[unit_of(item.key())].emplace_back(item.key(), p);
  }
  // Each unit's parameters, one padded flat vector per unit, cut into N shards: this rank keeps
  // shard r of each, one after another in shards_ (and the matching gradients in grads_).
  ShardLayout local;  // all the units' shards, one after another
  int64_t offset = 0;
  for (size_t u = 0; u < units_.size(); ++u) {
    Unit& unit = units_[u];
    const auto layout = shard_layout(named[u], static_cast<int64_t>(params_.size()), n, r, config_);
    unit.first = static_cast<int64_t>(params_.size());
    for (const auto& [name, p] : named[u]) {
      unit.params.push_back(p);
      params_.push_back(p);
      named_.emplace_back(name, p);
    }
    unit.numel = layout.numel;
    unit.shard = layout.shard;
    unit.offset = offset;
    for (auto segment : layout.segments) {
      segment.begin += offset;
      local.segments.push_back(segment);
    }
    offset += layout.shard;
    local.numel += layout.numel;
  }
  const bool masters = config_.param_dtype != torch::kFloat;
  shards_ = torch::zeros({offset});
  grads_ = torch::zeros({offset}, config_.param_dtype);
  has_gradient_ = torch::zeros({static_cast<int64_t>(params_.size())});
  local.shard = offset;
  adam_ = std::make_unique<ShardedAdamW>(local, static_cast<int64_t>(params_.size()), config_);
  norm_mask_ = norm_mask(local, named_, groups_);
  for (auto& unit : units_) {
    std::vector<torch::Tensor> flat;
    for (const auto& p : unit.params) flat.push_back(p.reshape(-1));
    flat.push_back(torch::zeros({unit.shard * n - unit.numel}));
    param_shard(unit).copy_(torch::cat(flat).narrow(0, r * unit.shard, unit.shard));
    if (masters)  // mixed precision: the parameters are kept in their type from here on
      for (auto& p : unit.params) p.set_data(p.to(config_.param_dtype));
  }
  if (masters) {
    rounded_ = shards_.to(config_.param_dtype);
    param_bytes_ = rounded_.element_size();
  }
  for (auto& unit : units_) {
    unit.gathered = true;  // the whole model exists now; from here on it lives in shards
    gathered_bytes_ += unit.numel * param_bytes_;
    free(unit);
  }
}

void FullyShardedDataParallel::gather(Unit& unit) {
  if (unit.gathered) return;
  auto full = comm_->all_gather(gathered_shard(unit));  // [shard * N]: the unit's padded vector
  int64_t offset = 0;
  for (auto& p : unit.params) {
    // New memory under the same storage: every tensor that shares it (autograd's saved copies
    // of this weight included) sees it. Writing through variable_data() leaves the parameter's
    // version counter alone, so backward accepts the weights it saved as unchanged.
    const auto bytes = static_cast<size_t>(p.numel() * p.element_size());
    c10::StorageImpl* storage = p.storage().unsafeGetStorageImpl();
    storage->set_data_ptr_noswap(c10::GetAllocator(p.device().type())->allocate(bytes));
    storage->set_nbytes(bytes);
    p.variable_data().view(-1).copy_(full.narrow(0, offset, p.numel()));
    offset += p.numel();
  }
  unit.gathered = true;
  gathered_bytes_ += unit.numel * param_bytes_;
  peak_gathered_bytes_ = std::max(peak_gathered_bytes_, gathered_bytes_);
}

void FullyShardedDataParallel::free(Unit& unit) {
  if (!unit.gathered) return;
  for (auto& p : unit.params) p.storage().unsafeGetStorageImpl()->reset();  // 0 bytes
  unit.gathered = false;
  gathered_bytes_ -= unit.numel * param_bytes_;
}

void FullyShardedDataParallel::release(Unit& unit) {
  // The unit's gradients as one padded flat vector divided by N: the reduce-scatter's sum is the
  // mean, and this rank receives its shard of it, added to what earlier backwards left there.
  const int n = comm_->size();
  if (!groups_.partial.empty()) {  // partial sums over tp first (chapter 10)
    const auto first = named_.begin() + unit.first;
    reduce_partial_gradients({first, first + static_cast<int64_t>(unit.params.size())}, groups_);
  }
  auto flat = pack_padded_gradients(unit.params, unit.shard * n, n, has_gradient_, unit.first);
  for (auto& p : unit.params) p.mutable_grad() = torch::Tensor();  // the full gradients go
  grad_shard(unit).add_(comm_->reduce_scatter(flat));
  unit.pending = false;
  free(unit);
}

void FullyShardedDataParallel::on_backward(size_t u) {
  // Backward runs the units in reverse: reaching block i means block i + 1 is done (autograd
  // runs every node of a later block, and its gradient accumulators, before this block's output
  // node: they were created later in forward, and the engine runs ready nodes latest first).
  // The root (u = 0) comes first in backward and is released by step().
  if (u > 0 && u + 1 < units_.size() && units_[u + 1].pending) release(units_[u + 1]);
  gather(units_[u]);
  units_[u].pending = true;
}

torch::Tensor FullyShardedDataParallel::hidden(const torch::Tensor& tokens,
                                               const torch::Tensor& positions) {
  // The model's parts, each with its unit gathered: the root (embedding now, final norm and head
  // at the end), then one block at a time, freed as soon as it has run.
  gather(units_[0]);
  auto x = model_->embed(tokens);
  for (int64_t i = 0; i < model_->config().n_layers; ++i) {
    Unit& unit = units_[1 + i];
    gather(unit);
    x = model_->forward_layers(x, positions, i, i + 1);
    free(unit);
    // When backward reaches this block's output, gather the block again.
    if (x.requires_grad()) x.register_hook([this, i](const torch::Tensor&) { on_backward(1 + i); });
  }
  return x;
}

torch::Tensor FullyShardedDataParallel::finish(const torch::Tensor& output) {
  free(units_[0]);
  if (output.requires_grad())
    output.register_hook([this](const torch::Tensor&) { on_backward(0); });
  return output;
}

torch::Tensor FullyShardedDataParallel::forward(const torch::Tensor& tokens) {
  return finish(model_->logits(hidden(tokens, ch03::position_range(0, tokens.size(1)))));
}

torch::Tensor FullyShardedDataParallel::loss(const ch03::Batch& batch) {
  return finish(model_->loss(hidden(batch.inputs, ch03::batch_positions(batch)), batch.targets));
}

double FullyShardedDataParallel::step(int64_t step) {
  torch::NoGradGuard no_grad;
  // Backward left the first block and the root gathered: release them, in the same order on every
  // rank. Units gathered by gather_full_parameters are freed: the update makes them stale.
  for (size_t u = units_.size(); u-- > 0;) {
    if (units_[u].pending) release(units_[u]);
    free(units_[u]);
  }
  auto has_gradient = has_gradient_.clone();
  comm_->all_reduce(has_gradient);  // > 0: some rank had this parameter's gradient
  // Once a parameter has had a gradient, one device keeps it (zeroed between steps, not freed),
  // so AdamW keeps stepping it even in a step that gives it none (an expert no token chose).
  if (!had_gradient_.defined()) had_gradient_ = torch::zeros_like(has_gradient);
  had_gradient_ = torch::maximum(had_gradient_, has_gradient.gt(0).to(torch::kFloat));
  has_gradient = had_gradient_.clone();
  const double norm = clip_sharded_gradient(grads_, *comm_, config_.grad_clip, norm_mask_, groups_);
  if (!std::isfinite(norm)) return norm;  // no update (the norm is global: every rank agrees)
  adam_->step(shards_, ch03::at_least_fp32(grads_), has_gradient, step);
  if (rounded_.defined()) rounded_.copy_(shards_);  // what the next forward gathers
  return norm;
}

void FullyShardedDataParallel::zero_grad() {
  grads_.zero_();
  has_gradient_.zero_();
}

void FullyShardedDataParallel::gather_full_parameters() {
  torch::NoGradGuard no_grad;
  if (!rounded_.defined()) {
    for (auto& unit : units_) gather(unit);
    return;
  }
  // Mixed precision: the masters themselves, whole, in fp32 tensors of their own.
  round_parameters();
  for (auto& unit : units_) {
    free(unit);
    const auto full = comm_->all_gather(param_shard(unit));
    int64_t offset = 0;
    for (auto& p : unit.params) {
      p.set_data(full.narrow(0, offset, p.numel()).view_as(p).clone());
      offset += p.numel();
    }
  }
  revealed_ = true;
}

void FullyShardedDataParallel::round_parameters() {
  if (!revealed_) return;
  torch::NoGradGuard no_grad;
  // Gathered, in the parameters' type, as gather_full_parameters leaves them in fp32: the next
  // forward needs no gather, the same as without master weights.
  for (auto& unit : units_) {
    for (auto& p : unit.params) p.set_data(p.to(config_.param_dtype));
    unit.gathered = true;
    gathered_bytes_ += unit.numel * param_bytes_;
  }
  revealed_ = false;
}

void FullyShardedDataParallel::gather_for_step() {
  torch::NoGradGuard no_grad;
  for (auto& unit : units_) {
    gather(unit);
    unit.pending = true;  // step() reduce-scatters its gradients
  }
}

ZeroMemory FullyShardedDataParallel::memory() const {
  ZeroMemory m;
  // With master weights the fp32 shards are the optimizer's, the parameters their rounding.
  const auto& own = rounded_.defined() ? rounded_ : shards_;
  m.parameters = own.numel() * own.element_size();
  m.gradients = grads_.numel() * grads_.element_size();
  for (const auto& p : params_) {
    m.parameters += static_cast<int64_t>(p.storage().nbytes());
    if (p.grad().defined()) m.gradients += p.grad().numel() * p.grad().element_size();
  }
  m.optimizer = adam_->state_bytes();
  if (rounded_.defined()) m.optimizer += shards_.numel() * shards_.element_size();
  return m;
}

std::vector<int64_t> FullyShardedDataParallel::unit_numels() const {
  std::vector<int64_t> numels;
  for (const auto& unit : units_) numels.push_back(unit.numel);
  return numels;
}

}  // namespace fivefold::ch09
