// Chapter 03 evaluation: loss, perplexity and exact match.

#include "03_transformer/evaluate.h"

#include <cmath>

#include "03_transformer/generate.h"
#include "03_transformer/train.h"

namespace fivefold::ch03 {

LossReport evaluate_loss(Transformer& model, const BatchSampler& sampler, int64_t batches) {
  torch::NoGradGuard no_grad;
  LossReport report;
  double total = 0;
  for (int64_t i = 0; i < batches; ++i) {
    const Batch batch = sampler.batch(i);
    const int64_t tokens = batch.targets.numel();
    total += loss_of(model, batch).item<double>() * static_cast<double>(tokens);
    report.tokens += tokens;
  }
  report.loss = report.tokens > 0 ? total / static_cast<double>(report.tokens) : 0.0;
  report.perplexity = std::exp(report.loss);
  return report;
}

double ExactMatchReport::accuracy() const {
  int64_t right = 0, all = 0;
  for (const auto& [task, n] : total) {
    all += n;
    right += correct.at(task);
  }
  return all > 0 ? static_cast<double>(right) / static_cast<double>(all) : 0.0;
}

double ExactMatchReport::accuracy(const std::string& task) const {
  auto found = total.find(task);
  if (found == total.end() || found->second == 0) return 0.0;
  return static_cast<double>(correct.at(task)) / static_cast<double>(found->second);
}

bool answers_exactly(Transformer& model, const SyntheticExample& example) {
  SamplingOptions greedy;
  greedy.stop_tokens = {'\n'};
  const auto output =
      generate(model, ByteTokenizer::encode("\n" + example.prompt), /*max_new_tokens=*/8, greedy);
  return output == ByteTokenizer::encode(example.answer + "\n");
}

ExactMatchReport exact_match(Transformer& model, uint64_t data_seed, Split split, int64_t count) {
  ExactMatchReport report;
  for (int64_t i = 0; i < count; ++i) {
    const SyntheticExample example = synthetic_example(data_seed, split, i);
    report.total[example.task] += 1;
    report.correct[example.task] += answers_exactly(model, example) ? 1 : 0;
  }
  return report;
}

}  // namespace fivefold::ch03
