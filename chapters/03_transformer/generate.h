#pragma once
/// @file generate.h
/// @brief Chapter 03 generation: greedy, temperature and top-k sampling, with a KV cache so that
/// each new token costs one position's forward pass instead of the whole sequence's.

#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <vector>

#include "03_transformer/model.h"

namespace fivefold::ch03 {

/// How to pick each next token.
struct SamplingOptions {
  bool greedy = true;                ///< take the most likely token (ignores temperature and top_k)
  double temperature = 1.0;          ///< divides the logits before sampling (> 0)
  int64_t top_k = 0;                 ///< sample among the k most likely tokens only (0: all)
  uint64_t seed = 0;                 ///< sampling generator's seed: same seed, same tokens
  std::vector<int64_t> stop_tokens;  ///< stop after producing one of these (it is returned)
  bool use_cache = true;  ///< false: recompute the whole sequence at every step (for tests)
  /// Called with each new token as soon as it is chosen (to stream the output); may be empty.
  std::function<void(int64_t)> on_token;
  /// Throws fivefold::Error for a non-positive temperature or a negative top_k.
  void validate() const;
};

/// The next token from `logits` [vocab] under `options`, drawing from `generator` when sampling.
int64_t pick_token(const torch::Tensor& logits, const SamplingOptions& options,
                   at::Generator& generator);

/// Continues `prompt` by up to `max_new_tokens` tokens and returns the new tokens only. With the
/// cache, the prompt is processed once and each step feeds one token; without it, each step runs
/// the whole sequence. Both pick the same tokens (test_ch03_generate). Throws fivefold::Error for
/// an empty prompt or a token outside the model's vocabulary.
std::vector<int64_t> generate(Transformer& model, const std::vector<int64_t>& prompt,
                              int64_t max_new_tokens, const SamplingOptions& options = {});

}  // namespace fivefold::ch03
