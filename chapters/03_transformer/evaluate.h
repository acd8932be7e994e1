#pragma once
/// @file evaluate.h
/// @brief Chapter 03 evaluation: mean loss and perplexity over held-out batches, and exact-match
/// accuracy on the synthetic corpus's prompts by greedy generation.

#include <cstdint>
#include <map>
#include <string>

#include "03_transformer/data.h"
#include "03_transformer/model.h"

namespace fivefold::ch03 {

/// Mean next-token loss over some batches, and its exponential.
struct LossReport {
  double loss = 0;        ///< mean cross-entropy in nats per token
  double perplexity = 0;  ///< exp(loss)
  int64_t tokens = 0;     ///< tokens scored
};

/// The mean loss over batches 0..batches-1 of `sampler` (without gradients).
LossReport evaluate_loss(Transformer& model, const BatchSampler& sampler, int64_t batches);

/// Exact-match accuracy, overall and per task.
struct ExactMatchReport {
  std::map<std::string, int64_t> correct;  ///< per task
  std::map<std::string, int64_t> total;    ///< per task
  /// Correct answers over all tasks divided by examples.
  double accuracy() const;
  /// Accuracy of one task (0 when it had no examples).
  double accuracy(const std::string& task) const;
};

/// Whether `model` answers `example` exactly: fed "\n" + prompt (lines follow a newline in the
/// corpus), it generates greedily up to 8 tokens or a newline, and the output is the answer
/// followed by a newline.
bool answers_exactly(Transformer& model, const SyntheticExample& example);

/// answers_exactly over synthetic examples 0..count-1 of `split`, counted by task.
ExactMatchReport exact_match(Transformer& model, uint64_t data_seed, Split split, int64_t count);

}  // namespace fivefold::ch03
