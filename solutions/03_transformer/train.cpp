// Chapter 03 training step: schedule, AdamW groups, clipping, accumulation.

#include "03_transformer/train.h"

#include <cmath>

#include "03_transformer/checkpoint.h"
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
}

double learning_rate(const TrainConfig& c, int64_t step) {
  if (step < c.warmup_steps)
    return c.lr * static_cast<double>(step + 1) / static_cast<double>(c.warmup_steps);
  const double progress = std::min(1.0, static_cast<double>(step - c.warmup_steps) /
                                            static_cast<double>(c.total_steps - c.warmup_steps));
  return c.min_lr + 0.5 * (c.lr - c.min_lr) * (1.0 + std::cos(M_PI * progress));
}

std::unique_ptr<torch::optim::AdamW> make_optimizer(Transformer& model, const TrainConfig& c) {
  c.validate();
  std::vector<torch::Tensor> decay, no_decay;
  for (const auto& item : model->named_parameters()) {
    const bool embedding = item.key() == "model.embed_tokens.weight";
    (item.value().dim() == 2 && (!embedding || c.decay_embeddings) ? decay : no_decay)
        .push_back(item.value());
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
    if (p.grad().defined()) squares += p.grad().pow(2).sum().item<double>();
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
                      const std::vector<Batch>& micro_batches, int64_t step) {
  optimizer.zero_grad();
  StepResult result;
  result.loss = accumulate_gradients(model, micro_batches);
  result.grad_norm = clip_gradients(model, c.grad_clip);
  result.lr = learning_rate(c, step);
  if (!std::isfinite(result.grad_norm)) return result;  // no update from a NaN or inf
  for (auto& group : optimizer.param_groups()) {
    static_cast<torch::optim::AdamWOptions&>(group.options()).lr(result.lr);
  }
  optimizer.step();
  return result;
}

SingleProcessStep::SingleProcessStep(Transformer model, const TrainConfig& config)
    : model_(std::move(model)), config_(config), optimizer_(make_optimizer(model_, config)) {}

StepResult SingleProcessStep::step(const std::vector<Batch>& micro_batches, int64_t step) {
  return train_step(model_, *optimizer_, config_, micro_batches, step);
}

StateBytes state_bytes(Transformer& model, torch::optim::AdamW& optimizer) {
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
  return ch03::optimizer_state(model_, *optimizer_);
}

void SingleProcessStep::load_optimizer_state(const io::TensorMap& state,
                                             const std::string& source) {
  ch03::load_optimizer_state(state, source, model_, *optimizer_);
}

}  // namespace fivefold::ch03
