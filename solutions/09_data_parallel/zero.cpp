// Chapter 09: ZeRO-1 and ZeRO-2, sharded AdamW over a flat view of the parameters.

#include "09_data_parallel/zero.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <utility>

#include "fivefold/adamw_state.h"
#include "fivefold/error.h"

namespace fivefold::ch09 {

ZeroMemory zero_memory_formula(int64_t psi, int64_t ranks, int stage, int64_t param_bytes) {
  FIVEFOLD_CHECK(psi >= 0 && ranks >= 1 && stage >= 0 && stage <= 3,
                 "zero_memory_formula: need psi >= 0, ranks >= 1, stage 0..3");
  FIVEFOLD_CHECK(param_bytes == 2 || param_bytes == 4,
                 "zero_memory_formula: parameters of 2 (bf16) or 4 (fp32) bytes, got ",
                 param_bytes);
  const int64_t shard = (psi + ranks - 1) / ranks;
  const int64_t optimizer = param_bytes < 4 ? 12 : 8;  // fp32 master weights beside the moments
  return {param_bytes * (stage >= 3 ? shard : psi), param_bytes * (stage >= 2 ? shard : psi),
          optimizer * (stage >= 1 ? shard : psi)};
}

ShardLayout shard_layout(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                         int64_t first_index, int ranks, int rank,
                         const ch03::TrainConfig& config) {
  ShardLayout layout;
  for (const auto& item : params) layout.numel += item.second.numel();
  layout.shard = (layout.numel + ranks - 1) / ranks;
  const int64_t lo = rank * layout.shard, hi = lo + layout.shard;  // this rank's flat range
  int64_t start = 0;  // where parameter k starts in the flat vector
  for (size_t k = 0; k < params.size(); ++k) {
    const auto& [name, p] = params[k];
    const int64_t from = std::max(lo, start), to = std::min(hi, start + p.numel());
    if (from < to) {
      const bool embedding = name == "model.embed_tokens.weight";
      layout.segments.push_back({first_index + static_cast<int64_t>(k), from - start, from - lo,
                                 to - from,
                                 p.dim() == 2 && (!embedding || config.decay_embeddings)});
    }
    start += p.numel();
  }
  return layout;
}

torch::Tensor pack_padded_gradients(const std::vector<torch::Tensor>& params, int64_t padded_numel,
                                    int ranks, torch::Tensor& has_gradient, int64_t first_index) {
  auto flat = torch::zeros({padded_numel});
  int64_t offset = 0;
  for (size_t k = 0; k < params.size(); ++k) {
    const auto& g = params[k].grad();
    if (g.defined()) {
      flat.narrow(0, offset, g.numel()).copy_(g.reshape(-1));
      has_gradient[first_index + static_cast<int64_t>(k)] = 1.0;
    }
    offset += params[k].numel();
  }
  return flat.div_(ranks);
}

void reduce_partial_gradients(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                              const ModelParallelGroups& groups) {
  if (groups.partial.empty()) return;
  torch::NoGradGuard no_grad;
  // The partial gradients in name order, then grouped by communicator in the order the groups
  // first appear: the same order on every rank (never the order of pointers, which differs from
  // process to process: two ranks reducing two groups in opposite orders would wait forever).
  auto sorted = params;
  std::sort(sorted.begin(), sorted.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::pair<dist::Communicator*, std::vector<torch::Tensor>>> by_group;
  for (const auto& [name, p] : sorted) {
    const auto [first, last] = groups.partial.equal_range(name);
    for (auto found = first; found != last; ++found) {
      auto* comm = found->second.get();
      auto it = std::find_if(by_group.begin(), by_group.end(),
                             [&](const auto& g) { return g.first == comm; });
      if (it == by_group.end()) it = by_group.insert(by_group.end(), {comm, {}});
      it->second.push_back(p);
    }
  }
  for (auto& [comm, members] : by_group) {
    std::vector<torch::Tensor> flat;
    for (auto& p : members) {
      if (!p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
      flat.push_back(p.grad().reshape(-1));
    }
    // One all-reduce for all of this group's partial gradients, summed in fp32 even where they
    // are kept in bf16 (chapter 14's master weights).
    auto packed = ch03::at_least_fp32(torch::cat(flat));
    comm->all_reduce(packed);
    int64_t offset = 0;
    for (auto& p : members) {
      p.mutable_grad().copy_(packed.narrow(0, offset, p.numel()).view_as(p));
      offset += p.numel();
    }
  }
}

torch::Tensor norm_mask(const ShardLayout& layout,
                        const std::vector<std::pair<std::string, torch::Tensor>>& params,
                        const ModelParallelGroups& groups) {
  if (groups.counted_elsewhere.empty()) return {};
  auto mask = torch::ones({layout.shard});
  for (const auto& s : layout.segments) {
    if (groups.counted_elsewhere.count(params[static_cast<size_t>(s.param)].first) > 0)
      mask.narrow(0, s.begin, s.length).zero_();
  }
  return mask;
}

double global_norm(torch::Tensor squares, dist::Communicator* comm,
                   const ModelParallelGroups& groups) {
  if (comm != nullptr) comm->all_reduce(squares);     // the shards of the data-parallel group
  for (const auto& group : groups.norm)
    if (group) group->all_reduce(squares);  // the model's other pieces
  return std::sqrt(squares.item<double>());
}

double clip_sharded_gradient(torch::Tensor& grad_shard, dist::Communicator& comm, double max_norm,
                             const torch::Tensor& mask, const ModelParallelGroups& groups) {
  const auto wide = ch03::at_least_fp32(grad_shard);
  auto squares = (mask.defined() ? wide.pow(2) * mask : wide.pow(2));
  const double norm = global_norm(squares.sum().to(torch::kDouble).reshape({1}), &comm, groups);
  if (max_norm > 0 && norm > max_norm) grad_shard.mul_(max_norm / norm);
  return norm;
}

ShardedAdamW::ShardedAdamW(ShardLayout layout, int64_t n_params, ch03::TrainConfig config)
    : layout_(std::move(layout)), config_(config), steps_(static_cast<size_t>(n_params), 0) {
  config_.validate();
  exp_avg_ = torch::zeros({layout_.shard});
  exp_avg_sq_ = torch::zeros({layout_.shard});
}

void ShardedAdamW::step(torch::Tensor& shard, const torch::Tensor& grad,
                        const torch::Tensor& has_gradient, int64_t step) {
  torch::NoGradGuard no_grad;
  const auto& c = config_;
  const double lr = ch03::learning_rate(c, step);
  const auto active = has_gradient.accessor<float, 1>();
  for (size_t i = 0; i < steps_.size(); ++i) steps_[i] += active[static_cast<int64_t>(i)] > 0;
  for (const auto& s : layout_.segments) {
    if (active[s.param] <= 0) continue;  // no gradient on any rank: AdamW skips the parameter
    auto p = shard.narrow(0, s.begin, s.length), g = grad.narrow(0, s.begin, s.length);
    auto m = exp_avg_.narrow(0, s.begin, s.length), v = exp_avg_sq_.narrow(0, s.begin, s.length);
    // torch::optim::AdamW::step, line by line.
    if (s.decays) p.mul_(1 - lr * c.weight_decay);
    m.mul_(c.beta1).add_(g, 1 - c.beta1);
    v.mul_(c.beta2).addcmul_(g, g, 1 - c.beta2);
    const auto t = static_cast<double>(steps_[static_cast<size_t>(s.param)]);
    const double bias1 = 1 - std::pow(c.beta1, t), bias2 = 1 - std::pow(c.beta2, t);
    auto denom = (v.sqrt() / std::sqrt(bias2)).add_(c.eps);
    p.addcdiv_(m, denom, -lr / bias1);
  }
}

io::TensorMap unshard(const ShardLayout& layout, const torch::Tensor& shard,
                      const std::vector<std::pair<std::string, torch::Tensor>>& params,
                      dist::Communicator& comm, bool to_rank0) {
  std::vector<int64_t> start(params.size() + 1, 0);  // where parameter k starts in [Ψ]
  for (size_t k = 0; k < params.size(); ++k) start[k + 1] = start[k] + params[k].second.numel();
  // A rank's pieces as rows of (parameter, its first element, place in the shard, length).
  std::vector<int64_t> rows;
  for (const auto& s : layout.segments)
    rows.insert(rows.end(), {s.param, s.first, s.begin, s.length});
  const auto pieces =
      torch::tensor(rows, torch::kLong).view({static_cast<int64_t>(rows.size() / 4), 4});
  torch::Tensor full;
  if (comm.rank() != 0) {
    comm.send(torch::tensor({pieces.size(0), shard.size(0)}), 0);
    if (pieces.size(0) > 0) comm.send(pieces, 0);
    if (shard.size(0) > 0) comm.send(shard.contiguous(), 0);
  } else {
    full = torch::zeros({start.back()});
    auto place = [&](const torch::Tensor& where, const torch::Tensor& from) {
      const auto r = where.accessor<int64_t, 2>();
      for (int64_t i = 0; i < where.size(0); ++i)
        full.narrow(0, start[static_cast<size_t>(r[i][0])] + r[i][1], r[i][3])
            .copy_(from.narrow(0, r[i][2], r[i][3]));
    };
    place(pieces, shard);
    auto theirs = torch::empty_like(shard);  // one buffer for every rank's (shards are equal)
    for (int rank = 1; rank < comm.size(); ++rank) {
      auto sizes = torch::empty({2}, torch::kLong);
      comm.recv(sizes, rank);
      auto where = torch::empty({sizes[0].item<int64_t>(), 4}, torch::kLong);
      if (sizes[1].item<int64_t>() != theirs.size(0)) theirs.resize_({sizes[1].item<int64_t>()});
      if (where.size(0) > 0) comm.recv(where, rank);
      if (theirs.size(0) > 0) comm.recv(theirs, rank);
      place(where, theirs);
    }
  }
  if (!to_rank0) {
    if (!full.defined()) full = torch::empty({start.back()});
    comm.broadcast(full, 0);
  }
  if (!full.defined()) return {};
  io::TensorMap tensors;
  for (size_t k = 0; k < params.size(); ++k) {
    const auto& [name, p] = params[k];
    tensors[name] = full.narrow(0, start[k], p.numel()).view(p.sizes());
  }
  return tensors;
}

io::TensorMap ShardedAdamW::state(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                                  dist::Communicator& comm, bool to_rank0) const {
  const auto m = unshard(layout_, exp_avg_, params, comm, to_rank0);
  const auto v = unshard(layout_, exp_avg_sq_, params, comm, to_rank0);
  if (to_rank0 && comm.rank() != 0) return {};  // it sent its shards
  io::TensorMap tensors;
  for (size_t k = 0; k < params.size(); ++k) {
    if (steps_[k] == 0) continue;  // no step taken: AdamW has no state for it yet
    const std::string& name = params[k].first;
    tensors[name + ".exp_avg"] = m.at(name);
    tensors[name + ".exp_avg_sq"] = v.at(name);
    tensors[name + ".step"] = torch::tensor(steps_[k], torch::kLong);
  }
  return tensors;
}

torch::Tensor had_gradients(const io::TensorMap& state,
                            const std::vector<std::pair<std::string, torch::Tensor>>& params) {
  auto had = torch::zeros({static_cast<int64_t>(params.size())});
  for (size_t k = 0; k < params.size(); ++k)
    if (state.count(params[k].first + ".exp_avg")) had[static_cast<int64_t>(k)] = 1;
  return had;
}

void ShardedAdamW::load_state(const io::TensorMap& state,
                              const std::vector<std::pair<std::string, torch::Tensor>>& params,
                              const std::string& source) {
  const std::vector<bool> has = adamw::check_state(state, source, params);
  for (size_t k = 0; k < params.size(); ++k)
    steps_[k] = has[k] ? state.at(params[k].first + ".step").item<int64_t>() : 0;
  for (const auto& s : layout_.segments) {
    const std::string& name = params[static_cast<size_t>(s.param)].first;
    if (!state.count(name + ".exp_avg")) {
      exp_avg_.narrow(0, s.begin, s.length).zero_();
      exp_avg_sq_.narrow(0, s.begin, s.length).zero_();
      continue;
    }
    exp_avg_.narrow(0, s.begin, s.length)
        .copy_(state.at(name + ".exp_avg").reshape(-1).narrow(0, s.first, s.length));
    exp_avg_sq_.narrow(0, s.begin, s.length)
        .copy_(state.at(name + ".exp_avg_sq").reshape(-1).narrow(0, s.first, s.length));
  }
}

ZeroOptimizer::ZeroOptimizer(std::shared_ptr<torch::nn::Module> model, dist::CommunicatorPtr comm,
                             int stage, ch03::TrainConfig config, ModelParallelGroups groups)
    : model_(std::move(model)),
      comm_(std::move(comm)),
      stage_(stage),
      config_(config),
      groups_(std::move(groups)) {
  FIVEFOLD_CHECK(stage_ == 1 || stage_ == 2, "ZeroOptimizer: stage must be 1 or 2, got ", stage_);
  config_.validate();
  torch::NoGradGuard no_grad;
  for (auto& item : model_->named_parameters()) {
    comm_->broadcast(item.value(), 0);  // every rank starts from rank 0's weights
    if (!item.value().requires_grad()) continue;
    params_.push_back(item.value());
    named_.emplace_back(item.key(), item.value());
  }
  layout_ = shard_layout(named_, 0, comm_->size(), comm_->rank(), config_);
  adam_ = std::make_unique<ShardedAdamW>(layout_, static_cast<int64_t>(params_.size()), config_);
  norm_mask_ = norm_mask(layout_, named_, groups_);
  if (config_.param_dtype != torch::kFloat) {  // mixed precision: this rank's fp32 masters
    master_ = shard_of_parameters();
    for (auto& p : params_) p.set_data(p.to(config_.param_dtype));
  }
}

torch::Tensor ZeroOptimizer::shard_of_parameters(bool gradients) const {
  auto shard = torch::zeros({layout_.shard}, gradients ? config_.param_dtype : torch::kFloat);
  for (const auto& s : layout_.segments) {
    const auto& p = params_[static_cast<size_t>(s.param)];
    const auto& source = gradients ? p.grad() : p;
    if (source.defined())
      shard.narrow(0, s.begin, s.length).copy_(source.reshape(-1).narrow(0, s.first, s.length));
  }
  return shard;
}

io::TensorMap ZeroOptimizer::gradients() const {
  return unshard(layout_, stage_ == 1 ? shard_of_parameters(/*gradients=*/true) : grad_shard_,
                 named_, *comm_);
}

void ZeroOptimizer::reveal_masters() {
  if (!master_.defined()) return;
  const auto whole = comm_->all_gather(master_);  // [shard * N]
  int64_t offset = 0;
  for (auto& p : params_) {
    p.set_data(whole.narrow(0, offset, p.numel()).view_as(p).clone());
    offset += p.numel();
  }
}

void ZeroOptimizer::round_parameters() {
  if (!master_.defined()) return;
  for (auto& p : params_)
    if (p.scalar_type() != config_.param_dtype) p.set_data(p.to(config_.param_dtype));
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
  const int n = comm_->size();
  // 1. The full gradient as one padded flat vector, divided by N: the reduce-scatter's sum is then
  //    the mean, and this rank receives its shard of it.
  reduce_partial_gradients(named_, groups_);  // partial sums over tp first (chapter 10)
  auto has_gradient = torch::zeros({static_cast<int64_t>(params_.size())});
  auto flat = pack_padded_gradients(params_, layout_.shard * n, n, has_gradient, 0);
  comm_->all_reduce(has_gradient);  // > 0: some rank has this parameter's gradient
  if (!had_gradient_.defined()) had_gradient_ = torch::zeros_like(has_gradient);
  had_gradient_ = torch::maximum(had_gradient_, has_gradient.gt(0).to(torch::kFloat));
  has_gradient = had_gradient_.clone();       // a gradient once: zeros now, as on one device
  if (stage_ == 2) zero_grad();               // the full gradients go as soon as they are packed
  grad_shard_ = comm_->reduce_scatter(flat);  // [shard], reduced in fp32
  flat = torch::Tensor();
  // With master weights the shard is kept as the gradients are (bf16): ZeRO's 2Ψ/N in stage 2.
  if (master_.defined()) grad_shard_ = grad_shard_.to(config_.param_dtype);

  // 2. Global-norm clipping, then 3. AdamW on this rank's shard of the parameters (the masters).
  const double norm =
      clip_sharded_gradient(grad_shard_, *comm_, config_.grad_clip, norm_mask_, groups_);
  const auto grad = ch03::at_least_fp32(grad_shard_);
  if (stage_ == 1) {
    // Stage 1 keeps the full gradients until the next zero_grad anyway: the reduced shard goes
    // back over this rank's range of them (where gradients() reads it), not kept beside them.
    for (const auto& s : layout_.segments) {
      auto& g = params_[static_cast<size_t>(s.param)].mutable_grad();
      if (g.defined())
        g.view(-1).narrow(0, s.first, s.length).copy_(grad_shard_.narrow(0, s.begin, s.length));
    }
    grad_shard_ = torch::Tensor();
  }
  if (!std::isfinite(norm)) return norm;  // no update (the norm is global: every rank returns)
  torch::Tensor mine = master_.defined() ? master_ : shard_of_parameters();
  adam_->step(mine, grad, has_gradient, step);

  // 4. Everyone's updated shards, back into the model (in the parameters' type).
  auto gathered = comm_->all_gather(mine.to(config_.param_dtype));  // [shard * N]
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
  if (grad_shard_.defined()) m.gradients += grad_shard_.numel() * grad_shard_.element_size();
  m.optimizer = adam_->state_bytes();
  if (master_.defined()) m.optimizer += master_.numel() * master_.element_size();
  return m;
}

}  // namespace fivefold::ch09
