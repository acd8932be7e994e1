// Chapter 09: ZeRO-1 and ZeRO-2, sharded AdamW over a flat view of the parameters.

#include "09_data_parallel/zero.h"

#include <cmath>

#include "fivefold/error.h"

namespace fivefold::ch09 {

ZeroMemory zero_memory_formula(int64_t psi, int64_t ranks, int stage) {
  FIVEFOLD_CHECK(psi >= 0 && ranks >= 1 && stage >= 0 && stage <= 3,
                 "zero_memory_formula: need psi >= 0, ranks >= 1, stage 0..3");
  const int64_t shard = (psi + ranks - 1) / ranks;
  return {4 * (stage >= 3 ? shard : psi), 4 * (stage >= 2 ? shard : psi),
          8 * (stage >= 1 ? shard : psi)};
}

ZeroOptimizer::ZeroOptimizer(std::shared_ptr<torch::nn::Module> model, dist::CommunicatorPtr comm,
                             int stage, ch03::TrainConfig config)
    : model_(std::move(model)), comm_(std::move(comm)), stage_(stage), config_(config) {
  FIVEFOLD_CHECK(stage_ == 1 || stage_ == 2, "ZeroOptimizer: stage must be 1 or 2, got ", stage_);
  config_.validate();
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> mask, owner;
  for (auto& item : model_->named_parameters()) {
    comm_->broadcast(item.value(), 0);  // every rank starts from rank 0's weights
    if (!item.value().requires_grad()) continue;
    params_.push_back(item.value());
    // make_optimizer's groups: matrices decay, except the embedding unless asked.
    const bool embedding = item.key() == "model.embed_tokens.weight";
    const bool decays = item.value().dim() == 2 && (!embedding || config_.decay_embeddings);
    mask.push_back(torch::full({item.value().numel()}, decays ? 1.0f : 0.0f));
    owner.push_back(torch::full({item.value().numel()}, static_cast<int64_t>(params_.size() - 1)));
    numel_ += item.value().numel();
  }
  const int n = comm_->size();
  shard_ = (numel_ + n - 1) / n;
  auto full_mask = torch::zeros({shard_ * n});
  full_mask.narrow(0, 0, numel_).copy_(torch::cat(mask));
  decay_mask_ = full_mask.narrow(0, comm_->rank() * shard_, shard_).clone();
  auto full_owner = torch::full({shard_ * n}, int64_t{-1});
  full_owner.narrow(0, 0, numel_).copy_(torch::cat(owner));
  owner_ = full_owner.narrow(0, comm_->rank() * shard_, shard_).clone();
  steps_ = torch::zeros({static_cast<int64_t>(params_.size())}, torch::kLong);
  exp_avg_ = torch::zeros({shard_});
  exp_avg_sq_ = torch::zeros({shard_});
}

void ZeroOptimizer::zero_grad() {
  for (auto& p : params_) {
    if (!p.grad().defined()) continue;
    if (stage_ == 1) {
      p.mutable_grad().zero_();
    } else {
      p.mutable_grad() = torch::Tensor();  // stage 2 keeps no full gradient between steps
    }
  }
}

double ZeroOptimizer::step(int64_t step) {
  torch::NoGradGuard no_grad;
  const int n = comm_->size(), r = comm_->rank();
  // 1. The full gradient as one padded flat vector, divided by N: the reduce-scatter's sum is then
  //    the mean, and this rank receives its shard of it.
  std::vector<torch::Tensor> parts;
  auto has_gradient = torch::zeros({static_cast<int64_t>(params_.size())});
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto& g = params_[i].grad();
    parts.push_back(g.defined() ? g.reshape(-1) : torch::zeros({params_[i].numel()}));
    has_gradient[static_cast<int64_t>(i)] = g.defined() ? 1.0 : 0.0;
  }
  comm_->all_reduce(has_gradient);  // > 0: some rank has this parameter's gradient
  parts.push_back(torch::zeros({shard_ * n - numel_}));
  auto flat = torch::cat(parts) / static_cast<double>(n);
  if (stage_ == 2) zero_grad();               // the full gradients go as soon as they are packed
  grad_shard_ = comm_->reduce_scatter(flat);  // [shard]
  flat = torch::Tensor();

  // 2. Global-norm clipping: each rank knows the squares of its shard only.
  auto squares = grad_shard_.pow(2).sum().to(torch::kDouble).reshape({1});
  comm_->all_reduce(squares);
  const double norm = std::sqrt(squares.item<double>());
  if (config_.grad_clip > 0 && norm > config_.grad_clip) grad_shard_.mul_(config_.grad_clip / norm);

  // 3. AdamW on this rank's shard, the operations of torch::optim::AdamW in the same order, on
  //    the elements of parameters that have a gradient somewhere (AdamW skips the others, and
  //    their step count does not advance).
  auto all = torch::cat([&] {
    std::vector<torch::Tensor> v;
    for (auto& p : params_) v.push_back(p.reshape(-1));
    v.push_back(torch::zeros({shard_ * n - numel_}));
    return v;
  }());
  auto mine = all.narrow(0, r * shard_, shard_).clone();
  const double lr = ch03::learning_rate(config_, step);
  const auto active_param = has_gradient > 0;
  steps_ += active_param.to(torch::kLong);
  const auto owner = owner_.clamp_min(0);
  const auto active = active_param.index_select(0, owner).logical_and(owner_ >= 0);
  const auto t = steps_.index_select(0, owner).to(torch::kDouble).clamp_min(1);
  const auto bias1 = (1 - torch::pow(config_.beta1, t)).to(torch::kFloat);
  const auto bias2 = (1 - torch::pow(config_.beta2, t)).to(torch::kFloat);
  auto updated = mine * (1 - lr * config_.weight_decay * decay_mask_);
  auto m = exp_avg_ * config_.beta1 + grad_shard_ * (1 - config_.beta1);
  auto v = exp_avg_sq_ * config_.beta2 + grad_shard_ * grad_shard_ * (1 - config_.beta2);
  auto denom = v.sqrt() / bias2.sqrt() + config_.eps;
  updated = updated - (lr / bias1) * (m / denom);
  exp_avg_ = torch::where(active, m, exp_avg_);
  exp_avg_sq_ = torch::where(active, v, exp_avg_sq_);
  mine = torch::where(active, updated, mine);

  // 4. Everyone's updated shards, back into the model.
  auto gathered = comm_->all_gather(mine);  // [shard * N]
  int64_t offset = 0;
  for (auto& p : params_) {
    p.copy_(gathered.narrow(0, offset, p.numel()).view_as(p));
    offset += p.numel();
  }
  return norm;
}

ZeroMemory ZeroOptimizer::memory() const {
  ZeroMemory m;
  for (const auto& p : model_->parameters()) m.parameters += p.numel() * p.element_size();
  for (const auto& p : params_) {
    if (p.grad().defined()) m.gradients += p.grad().numel() * p.grad().element_size();
  }
  if (stage_ == 2 && grad_shard_.defined()) m.gradients += grad_shard_.numel() * 4;
  m.optimizer = (exp_avg_.numel() + exp_avg_sq_.numel()) * 4;
  return m;
}

}  // namespace fivefold::ch09
