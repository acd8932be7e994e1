// The run's evaluation, shared out over the job's processes (evaluation.h).

#include "evaluation.h"

#include <cmath>
#include <string>

#include "03_transformer/train.h"

namespace fivefold::runtime {

using namespace fivefold::ch03;

LossReport shared_loss(Transformer& model, const BatchSampler& sampler, int64_t batches,
                       const dist::CommunicatorPtr& world) {
  if (!world || world->size() == 1) return evaluate_loss(model, sampler, batches);
  torch::NoGradGuard no_grad;
  auto found = torch::zeros({batches, 2}, torch::kDouble);  // each batch's loss sum and tokens
  for (int64_t i = world->rank(); i < batches; i += world->size()) {
    const Batch batch = sampler.batch(i);
    const auto tokens = static_cast<double>(batch.targets.numel());
    found[i][0] = loss_of(model, batch).item<double>() * tokens;
    found[i][1] = tokens;
  }
  world->all_reduce(found);  // each entry is one process's number plus zeros: exact
  LossReport report;
  double total = 0;
  for (int64_t i = 0; i < batches; ++i) {
    total += found[i][0].item<double>();
    report.tokens += static_cast<int64_t>(found[i][1].item<double>());
  }
  report.loss = report.tokens > 0 ? total / static_cast<double>(report.tokens) : 0.0;
  report.perplexity = std::exp(report.loss);
  return report;
}

ExactMatchReport shared_exact_match(Transformer& model, uint64_t data_seed, int64_t count,
                                    const dist::CommunicatorPtr& world) {
  if (!world || world->size() == 1) return exact_match(model, data_seed, Split::HeldOut, count);
  auto right = torch::zeros({count}, torch::kLong);
  for (int64_t i = world->rank(); i < count; i += world->size())
    right[i] = answers_exactly(model, synthetic_example(data_seed, Split::HeldOut, i)) ? 1 : 0;
  world->all_reduce(right);
  ExactMatchReport report;
  for (int64_t i = 0; i < count; ++i) {
    const std::string task = synthetic_example(data_seed, Split::HeldOut, i).task;
    report.total[task] += 1;
    report.correct[task] += right[i].item<int64_t>();
  }
  return report;
}

}  // namespace fivefold::runtime
