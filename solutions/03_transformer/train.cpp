// Chapter 03 training step: schedule, AdamW groups, clipping, accumulation.

#include "03_transformer/train.h"

#include <cmath>

#include "03_transformer/checkpoint.h"
#include "fivefold/adamw_state.h"
#include "fivefold/error.h"

namespace fivefold::ch03 {

void TrainConfig::validate() const {
  FIVEFOLD_CHECK(lr > 0 && min_lr >= 0 && min_lr <= lr,
                 "train config: need 0 <= min_lr <= lr, lr > 0");
  FIVEFOLD_CHECK(warmup_steps >= 0 && total_steps > warmup_steps,
                 "train config: need total_steps (", total_steps, ") > warmup_steps (",
                 warmup_steps, ") >= 0");
  FIVEFOLD_CHECK(weight_decay >= 0 && grad_clip >= 0 && eps > 0,
                 "train config: weight_decay, grad_clip >= 0, eps > 0");
  FIVEFOLD_CHECK(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1,
                 "train config: betas must be in [0, 1)");
  FIVEFOLD_CHECK(param_dtype == torch::kFloat || param_dtype == torch::kBFloat16,
                 "train config: parameters are kept in fp32 or bf16, not ", param_dtype);
}

double learning_rate(const TrainConfig& c, int64_t step) {
  if (step < c.warmup_steps)
    return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - c.warmup_steps) /
                                            static_cast<double>(c.total_steps - c.warmup_steps));
  return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1.0 + std::cos(M_PI * progress));
}

std::unique_ptr<torch::optim::AdamW> make_optimizer(Transformer& model, const TrainConfig& c) {
  return make_optimizer(adamw::parameters_by_name(*model), c);
}

std::unique_ptr<torch::optim::AdamW> make_optimizer(
    const std::vector<std::pair<std::string, torch::Tensor>>& params, const TrainConfig& c) {
  c.validate();
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& [name, p] : params) {
    const bool embedding = name == "model.embed_tokens.weight";
    (p.dim() == 2 && (!embedding || c.decay_embeddings) ? decay : no_decay).push_back(p);
  }
  auto options = [&](double weight_decay) {
    return std::make_unique<torch::optim::AdamWOptions>(torch::optim::AdamWOptions(c.lr)
                                                            .betas({c.beta1, c.beta2})
                                                            .eps(c.eps)
                                                            .weight_decay(weight_decay));
  };
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(decay, options(c.weight_decay));
  groups.emplace_back(no_decay, options(0.0));
  if (c.make_adamw) return c.make_adamw(std::move(groups), torch::optim::AdamWOptions(c.lr));
  return std::make_unique<torch::optim::AdamW>(groups, torch::optim::AdamWOptions(c.lr));
}

MasterWeights::MasterWeights(Transformer& model, torch::Dtype dtype) : dtype_(dtype) {
  torch::NoGradGuard no_grad;
  for (const auto& item : model->named_parameters())
    if (item.value().requires_grad()) params_.emplace_back(item.key(), item.value());
  for (auto& [name, p] : params_) {
    masters_.emplace_back(name, p.detach().to(torch::kFloat, /*non_blocking=*/false,
                                              /*copy=*/true));
    p.set_data(p.to(dtype));
  }
}

void MasterWeights::load_gradients() {
  for (size_t k = 0; k < params_.size(); ++k) {
    const auto& p = params_[k].second;
    auto& master = masters_[k].second;
    if (p.grad().defined()) {
      master.mutable_grad() = p.grad().to(torch::kFloat);
    } else if (master.grad().defined()) {
      master.mutable_grad().zero_();
    }
  }
}

void MasterWeights::store() {
  torch::NoGradGuard no_grad;
  for (size_t k = 0; k < params_.size(); ++k) {
    auto& p = params_[k].second;
    auto& master = masters_[k].second;
    if (p.scalar_type() == dtype_) {
      p.copy_(master);  // rounded to the parameter's type
    } else {
      p.set_data(master.to(dtype_));  // revealed: its own storage again
    }
    if (master.grad().defined() && !p.grad().defined()) p.mutable_grad() = torch::zeros_like(p);
    master.mutable_grad() = torch::Tensor();
  }
}

void MasterWeights::reveal() {
  for (size_t k = 0; k < params_.size(); ++k) params_[k].second.set_data(masters_[k].second);
}

std::vector<std::pair<std::string, torch::Tensor>> stepped_parameters(
    Transformer& model, const MasterWeights* masters) {
  return masters != nullptr ? masters->masters() : adamw::parameters_by_name(*model);
}

int64_t MasterWeights::bytes() const {
  int64_t total = 0;
  for (const auto& [name, m] : masters_) total += m.numel() * m.element_size();
  return total;
}

torch::Tensor loss_of(Transformer& model, const Batch& batch) {
  // The model's parts: embedding, every block, then the output slot's loss (which a
  // vocabulary-parallel head computes without building the logits).
  auto x = model->embed(batch.inputs);  // [rows, seq, d_model]
  x = model->forward_layers(x, batch_positions(batch), 0, model->config().n_layers);
  return model->loss(x, batch.targets);
}

namespace {
thread_local double current_loss_weight = 1.0;
}  // namespace

LossWeightScope::LossWeightScope(double weight) : previous_(current_loss_weight) {
  current_loss_weight = weight;
}

LossWeightScope::~LossWeightScope() { current_loss_weight = previous_; }

double LossWeightScope::current() { return current_loss_weight; }

double accumulate_gradients(Transformer& model, const std::vector<Batch>& micro_batches) {
  FIVEFOLD_CHECK(!micro_batches.empty(), "accumulate_gradients: no micro-batches");
  int64_t rows = 0;
  for (const auto& b : micro_batches) rows += b.inputs.size(0);
  double total = 0;
  for (const auto& b : micro_batches) {
    // Weighting each micro-batch's mean by its share of rows makes the sum the whole batch's mean.
    const double share = static_cast<double>(b.inputs.size(0)) / static_cast<double>(rows);
    LossWeightScope weight(share * b.loss_weight);  // the auxiliary losses count alike
    auto loss = loss_of(model, b) * (share * b.loss_weight);
    loss.backward();
    total += loss.item<double>();
  }
  return total;
}

double clip_gradients(Transformer& model, double max_norm) {
  return clip_gradients(model->parameters(), max_norm);
}

double clip_gradients(const std::vector<torch::Tensor>& params, double max_norm) {
  double squares = 0;
  for (const auto& p : params) {
    if (p.grad().defined()) squares += at_least_fp32(p.grad()).pow(2).sum().item<double>();
  }
  const double norm = std::sqrt(squares);
  if (max_norm > 0 && norm > max_norm) {
    torch::NoGradGuard no_grad;
    for (const auto& p : params) {
      if (p.grad().defined()) p.grad().mul_(max_norm / norm);
    }
  }
  return norm;
}

StepResult train_step(Transformer& model, torch::optim::AdamW& optimizer, const TrainConfig& c,
                      const std::vector<Batch>& micro_batches, int64_t step,
                      MasterWeights* masters) {
  optimizer.zero_grad();
  if (masters != nullptr) {
    masters->store();    // the rounding again, if a checkpoint revealed the masters
    model->zero_grad();  // the optimizer holds the masters, not these
  }
  StepResult result;
  result.loss = accumulate_gradients(model, micro_batches);
  if (masters != nullptr) masters->load_gradients();  // the clip and AdamW read them (fp32)
  std::vector<torch::Tensor> stepped;  // what AdamW steps: the masters where there are some
  for (const auto& [name, p] : stepped_parameters(model, masters)) stepped.push_back(p);
  result.grad_norm = clip_gradients(stepped, c.grad_clip);
  result.lr = learning_rate(c, step);
  if (!std::isfinite(result.grad_norm)) return result;  // no update from a NaN or inf
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(result.lr);
  }
  optimizer.step();
  if (masters != nullptr) masters->store();
  return result;
}

SingleProcessStep::SingleProcessStep(Transformer model, const TrainConfig& config)
    : model_(std::move(model)), config_(config) {
  config_.validate();
  if (config_.param_dtype != torch::kFloat)
    masters_ = std::make_unique<MasterWeights>(model_, config_.param_dtype);
  optimizer_ = make_optimizer(stepped_parameters(model_, masters_.get()), config_);
}

StepResult SingleProcessStep::step(const std::vector<Batch>& micro_batches, int64_t step) {
  return train_step(model_, *optimizer_, config_, micro_batches, step, masters_.get());
}

Transformer& SingleProcessStep::full_model() {
  if (masters_) masters_->reveal();
  return model_;
}

StateBytes SingleProcessStep::state_bytes() {
  if (masters_) masters_->store();  // between steps the parameters are the rounding
  return ch03::state_bytes(model_, *optimizer_, masters_.get());
}

StateBytes state_bytes(Transformer& model, torch::optim::AdamW& optimizer,
                       const MasterWeights* masters) {
  auto bytes = [](const torch::Tensor& t) {
    return t.defined() ? static_cast<int64_t>(t.numel() * t.element_size()) : int64_t{0};
  };
  StateBytes b;
  for (const auto& p : model->parameters()) {
    b.parameters += bytes(p);
    b.gradients += bytes(p.grad());
  }
  for (const auto& [key, state] : optimizer.state()) {
    const auto& adam = static_cast<const torch::optim::AdamWParamState&>(*state);
    b.optimizer += bytes(adam.exp_avg()) + bytes(adam.exp_avg_sq());
  }
  if (masters != nullptr) b.optimizer += masters->bytes();
  return b;
}

io::TensorMap SingleProcessStep::gradients() {
  io::TensorMap out;
  for (const auto& item : model_->named_parameters()) {
    if (item.value().grad().defined()) out[item.key()] = item.value().grad().detach().clone();
  }
  return out;
}

io::TensorMap SingleProcessStep::optimizer_state() {
  return adamw::state_by_name(stepped_parameters(model_, masters_.get()), *optimizer_);
}

void SingleProcessStep::load_optimizer_state(const io::TensorMap& state,
                                             const std::string& source) {
  adamw::load_state(state, source, stepped_parameters(model_, masters_.get()), *optimizer_);
}

}  // namespace fivefold::ch03
