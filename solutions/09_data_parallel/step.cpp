// Chapter 09: one training step for every ZeRO stage (chapter 03's TrainingStep).

#include "09_data_parallel/step.h"

#include <cmath>
#include <optional>
#include <utility>

#include "fivefold/adamw_state.h"
#include "fivefold/error.h"

namespace fivefold::ch09 {

DataParallelStep::DataParallelStep(ch03::Transformer model, dist::CommunicatorPtr comm, int stage,
                                   const ch03::TrainConfig& config, ModelParallelGroups groups,
                                   ForwardBackward forward_backward)
    : model_(std::move(model)),
      comm_(std::move(comm)),
      stage_(stage),
      config_(config),
      groups_(std::move(groups)),
      forward_backward_(std::move(forward_backward)) {
  FIVEFOLD_CHECK(stage_ >= 0 && stage_ <= 3, "ZeRO stage must be 0, 1, 2 or 3, got ", stage_);
  config_.validate();
  if (stage_ == 0) {
    if (config_.param_dtype != torch::kFloat) {
      // Master weights from rank 0's fp32 parameters, then the parameters rounded (DDP's hooks
      // go on the rounded ones).
      {
        torch::NoGradGuard no_grad;
        for (auto& p : model_->parameters()) comm_->broadcast(p, 0);
      }
      masters_ = std::make_unique<ch03::MasterWeights>(model_, config_.param_dtype);
      adam_ = ch03::make_optimizer(masters_->masters(), config_);
    } else {
      adam_ = ch03::make_optimizer(model_, config_);
    }
    ddp_ = std::make_unique<DistributedDataParallel>(model_.ptr(), comm_);
  } else if (stage_ < 3) {
    zero_ = std::make_unique<ZeroOptimizer>(model_.ptr(), comm_, stage_, config_, groups_);
  } else {
    fsdp_ = std::make_unique<FullyShardedDataParallel>(model_, comm_, config_, groups_);
  }
}

ch03::StepResult DataParallelStep::step(const std::vector<ch03::Batch>& micro_batches,
                                        int64_t step) {
  FIVEFOLD_CHECK(!micro_batches.empty(), "DataParallelStep: no micro-batches");
  if (adam_) adam_->zero_grad();
  if (masters_) {
    masters_->store();    // the rounding again, if a checkpoint revealed the masters
    model_->zero_grad();  // AdamW holds the masters, not these
  }
  if (zero_) zero_->round_parameters();  // likewise for the sharded masters
  if (zero_) zero_->zero_grad();
  if (fsdp_) fsdp_->round_parameters();
  if (fsdp_) fsdp_->zero_grad();
  int64_t rows = 0;
  for (const auto& b : micro_batches) rows += b.inputs.size(0);
  double local = 0;  // this rank's mean loss
  if (forward_backward_) {
    // Someone else's order of backwards (a pipeline's): DDP reduces every bucket afterwards.
    std::optional<DistributedDataParallel::NoSync> guard;
    if (ddp_) guard.emplace(*ddp_);
    if (fsdp_) fsdp_->gather_for_step();  // ZeRO-3: the part stays whole for the step
    local = forward_backward_(micro_batches);
  }
  for (size_t i = 0; i < (forward_backward_ ? 0 : micro_batches.size()); ++i) {
    const auto& b = micro_batches[i];
    // Each micro-batch's mean weighted by its share of the rows: the sum is this rank's mean.
    const double share = static_cast<double>(b.inputs.size(0)) / static_cast<double>(rows);
    ch03::LossWeightScope weight(share * b.loss_weight);  // the auxiliary losses count alike
    auto loss = (fsdp_ ? fsdp_->loss(b) : ch03::loss_of(model_, b)) * (share * b.loss_weight);
    if (ddp_ && i + 1 < micro_batches.size()) {
      auto guard = ddp_->no_sync();  // DDP: accumulate locally, synchronise on the last one
      loss.backward();
    } else {
      loss.backward();
    }
    local += loss.item<double>();
  }
  ch03::StepResult result;
  result.lr = ch03::learning_rate(config_, step);
  if (ddp_) {
    ddp_->finish_gradient_sync();  // every gradient is now the mean over the ranks
    const auto named = adamw::parameters_by_name(*model_);
    reduce_partial_gradients(named, groups_);  // partial sums over tp (chapter 10)
    if (masters_) masters_->load_gradients();  // the clip and AdamW read the masters' (fp32)
    result.grad_norm =
        clip_gradients(masters_ ? masters_->masters() : named, config_.grad_clip, groups_);
    for (auto& group : adam_->param_groups())
      static_cast<torch::optim::AdamWOptions&>(group.options()).lr(result.lr);
    if (std::isfinite(result.grad_norm)) {  // the norm is global: all ranks agree
      adam_->step();
      if (masters_) masters_->store();
    }
  } else if (zero_) {
    result.grad_norm = zero_->step(step);
  } else {
    result.grad_norm = fsdp_->step(step);
  }
  // Every rank holds the same number of rows, so the mean of the ranks' means is the batch mean.
  auto loss = torch::tensor({local}, torch::kDouble);
  comm_->all_reduce(loss, dist::ReduceOp::Average);
  result.loss = loss.item<double>();
  return result;
}

ch03::Transformer& DataParallelStep::full_model() {
  if (fsdp_) fsdp_->gather_full_parameters();
  if (zero_) zero_->reveal_masters();
  if (masters_) masters_->reveal();
  return model_;
}

io::TensorMap DataParallelStep::optimizer_state() {
  if (zero_) return zero_->optimizer_state();
  if (fsdp_) return fsdp_->optimizer_state();
  return adamw::state_by_name(ch03::stepped_parameters(model_, masters_.get()), *adam_);
}

io::TensorMap DataParallelStep::optimizer_state_for_writer() {
  if (zero_) return zero_->optimizer_state(/*to_rank0=*/true);
  if (fsdp_) return fsdp_->optimizer_state(/*to_rank0=*/true);
  return comm_->rank() == 0 ? optimizer_state() : io::TensorMap{};  // DDP: every rank holds it
}

void DataParallelStep::load_optimizer_state(const io::TensorMap& state, const std::string& source) {
  if (zero_) return zero_->load_optimizer_state(state, source);
  if (fsdp_) return fsdp_->load_optimizer_state(state, source);
  adamw::load_state(state, source, ch03::stepped_parameters(model_, masters_.get()), *adam_);
}

ch03::StateBytes DataParallelStep::state_bytes() {
  if (masters_) masters_->store();  // between steps the parameters are the rounding
  if (adam_) return ch03::state_bytes(model_, *adam_, masters_.get());
  if (zero_) zero_->round_parameters();
  if (fsdp_) fsdp_->round_parameters();
  return zero_ ? zero_->memory() : fsdp_->memory();
}

io::TensorMap DataParallelStep::gradients() {
  if (zero_) return zero_->gradients();
  if (fsdp_) return fsdp_->gradients();
  io::TensorMap grads;
  for (const auto& item : model_->named_parameters())
    if (item.value().grad().defined()) grads[item.key()] = item.value().grad().clone();
  return grads;
}

double clip_gradients(const std::vector<std::pair<std::string, torch::Tensor>>& params,
                      double max_norm, const ModelParallelGroups& groups) {
  torch::NoGradGuard no_grad;
  std::vector<torch::Tensor> grads;
  auto squares = torch::zeros({1}, torch::kDouble);
  for (const auto& [name, p] : params) {
    if (!p.grad().defined()) continue;
    grads.push_back(p.grad());
    if (groups.counted_elsewhere.count(name) == 0)
      squares += ch03::at_least_fp32(p.grad()).pow(2).sum().to(torch::kDouble);
  }
  const double norm = global_norm(squares, nullptr, groups);
  if (max_norm > 0 && norm > max_norm)
    for (auto& g : grads) g.mul_(max_norm / norm);
  return norm;
}

ch03::StepFactory data_parallel_step(dist::CommunicatorPtr comm, int stage) {
  return [comm, stage](ch03::Transformer model, const ch03::TrainConfig& config) {
    return std::unique_ptr<ch03::TrainingStep>(
        new DataParallelStep(std::move(model), comm, stage, config));
  };
}

}  // namespace fivefold::ch09
