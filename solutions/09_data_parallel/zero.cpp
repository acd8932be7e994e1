// Chapter 09: ZeRO-1 and ZeRO-2, sharded AdamW over a flat view of the parameters.

#include "09_data_parallel/zero.h"

#include <cmath>
#include <utility>

#include "fivefold/error.h"

namespace fivefold::ch09 {

ZeroMemory zero_memory_formula(int64_t psi, int64_t ranks, int stage) {
  FIVEFOLD_CHECK(psi >= 0 && ranks >= 1 && stage >= 0 && stage <= 3,
                 "zero_memory_formula: need psi >= 0, ranks >= 1, stage 0..3");
  const int64_t shard = (psi + ranks - 1) / ranks;
  return {4 * (stage >= 3 ? shard : psi), 4 * (stage >= 2 ? shard : psi),
          8 * (stage >= 1 ? shard : psi)};
}

ShardLayout shard_layout(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                         int64_t first_index, int ranks, int rank,
                         const ch03::TrainConfig& config) {
  ShardLayout layout;
  std::vector<torch::Tensor> decays, owner;
  for (size_t k = 0; k < params.size(); ++k) {
    const auto& [name, p] = params[k];
    const bool embedding = name == "model.embed_tokens.weight";
    const bool decay = p.dim() == 2 && (!embedding || config.decay_embeddings);
    decays.push_back(torch::full({p.numel()}, decay ? 1.0f : 0.0f));
    owner.push_back(torch::full({p.numel()}, first_index + static_cast<int64_t>(k)));
    layout.numel += p.numel();
  }
  layout.shard = (layout.numel + ranks - 1) / ranks;
  // The whole padded vector's masks, then this rank's slice of them.
  decays.push_back(torch::zeros({layout.shard * ranks - layout.numel}));
  owner.push_back(torch::full({layout.shard * ranks - layout.numel}, int64_t{-1}));
  layout.decays = torch::cat(decays).narrow(0, rank * layout.shard, layout.shard).clone();
  layout.owner = torch::cat(owner).narrow(0, rank * layout.shard, layout.shard).clone();
  return layout;
}

double clip_sharded_gradient(torch::Tensor& grad_shard, dist::Communicator& comm, double max_norm) {
  auto squares = grad_shard.pow(2).sum().to(torch::kDouble).reshape({1});
  comm.all_reduce(squares);
  const double norm = std::sqrt(squares.item<double>());
  if (max_norm > 0 && norm > max_norm) grad_shard.mul_(max_norm / norm);
  return norm;
}

ShardedAdamW::ShardedAdamW(ShardLayout layout, int64_t n_params, ch03::TrainConfig config)
    : layout_(std::move(layout)), config_(config) {
  config_.validate();
  steps_ = torch::zeros({n_params}, torch::kLong);
  exp_avg_ = torch::zeros({layout_.shard});
  exp_avg_sq_ = torch::zeros({layout_.shard});
}

void ShardedAdamW::step(torch::Tensor& shard, const torch::Tensor& grad,
                        const torch::Tensor& has_gradient, int64_t step) {
  torch::NoGradGuard no_grad;
  const auto& c = config_;
  const double lr = ch03::learning_rate(c, step);
  const auto active_param = has_gradient > 0;
  steps_ += active_param.to(torch::kLong);
  // Per element: its parameter's activity and step count (padding: inactive).
  const auto owner = layout_.owner.clamp_min(0);
  const auto active = active_param.index_select(0, owner).logical_and(layout_.owner >= 0);
  const auto t = steps_.index_select(0, owner).to(torch::kDouble).clamp_min(1);
  const auto bias1 = (1 - torch::pow(c.beta1, t)).to(torch::kFloat);
  const auto bias2 = (1 - torch::pow(c.beta2, t)).to(torch::kFloat);
  auto updated = shard * (1 - lr * c.weight_decay * layout_.decays);
  auto m = exp_avg_ * c.beta1 + grad * (1 - c.beta1);
  auto v = exp_avg_sq_ * c.beta2 + grad * grad * (1 - c.beta2);
  auto denom = v.sqrt() / bias2.sqrt() + c.eps;
  updated = updated - (lr / bias1) * (m / denom);
  exp_avg_ = torch::where(active, m, exp_avg_);
  exp_avg_sq_ = torch::where(active, v, exp_avg_sq_);
  shard.copy_(torch::where(active, updated, shard));
}

ZeroOptimizer::ZeroOptimizer(std::shared_ptr<torch::nn::Module> model, dist::CommunicatorPtr comm,
                             int stage, ch03::TrainConfig config)
    : model_(std::move(model)), comm_(std::move(comm)), stage_(stage), config_(config) {
  FIVEFOLD_CHECK(stage_ == 1 || stage_ == 2, "ZeroOptimizer: stage must be 1 or 2, got ", stage_);
  config_.validate();
  torch::NoGradGuard no_grad;
  std::vector<std::pair<std::string, torch::Tensor>> trainable;
  for (auto& item : model_->named_parameters()) {
    comm_->broadcast(item.value(), 0);  // every rank starts from rank 0's weights
    if (!item.value().requires_grad()) continue;
    params_.push_back(item.value());
    trainable.emplace_back(item.key(), item.value());
  }
  layout_ = shard_layout(trainable, 0, comm_->size(), comm_->rank(), config_);
  adam_ = std::make_unique<ShardedAdamW>(layout_, static_cast<int64_t>(params_.size()), config_);
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
  const int64_t shard = layout_.shard, padding = shard * n - layout_.numel;
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
  parts.push_back(torch::zeros({padding}));
  auto flat = torch::cat(parts) / static_cast<double>(n);
  if (stage_ == 2) zero_grad();               // the full gradients go as soon as they are packed
  grad_shard_ = comm_->reduce_scatter(flat);  // [shard]
  flat = torch::Tensor();

  // 2. Global-norm clipping, then 3. AdamW on this rank's shard of the parameters.
  const double norm = clip_sharded_gradient(grad_shard_, *comm_, config_.grad_clip);
  std::vector<torch::Tensor> all;
  for (auto& p : params_) all.push_back(p.reshape(-1));
  all.push_back(torch::zeros({padding}));
  auto mine = torch::cat(all).narrow(0, r * shard, shard).clone();
  adam_->step(mine, grad_shard_, has_gradient, step);

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
  m.optimizer = adam_->state_bytes();
  return m;
}

}  // namespace fivefold::ch09
