// Chapter 03 generation: sampling and the KV-cache decoding loop.

#include "03_transformer/generate.h"

#include <algorithm>

#include "fivefold/error.h"
#include "fivefold/seed.h"

namespace fivefold::ch03 {

void SamplingOptions::validate() const {
  FIVEFOLD_CHECK(temperature > 0, "sampling: temperature must be positive, got ", temperature);
  FIVEFOLD_CHECK(top_k >= 0, "sampling: top_k must be >= 0, got ", top_k);
}

int64_t pick_token(const torch::Tensor& logits, const SamplingOptions& options,
                   at::Generator& generator) {
  if (options.greedy) return logits.argmax().item<int64_t>();
  auto scaled = logits.to(torch::kFloat) / options.temperature;
  if (options.top_k > 0 && options.top_k < scaled.size(0)) {
    // Everything below the k-th largest logit gets probability zero.
    auto kth = std::get<0>(scaled.topk(options.top_k)).min();
    scaled = scaled.masked_fill(scaled < kth, -INFINITY);
  }
  auto probs = torch::softmax(scaled, 0);
  return torch::multinomial(probs, 1, /*replacement=*/false, generator).item<int64_t>();
}

std::vector<int64_t> generate(Transformer& model, const std::vector<int64_t>& prompt,
                              int64_t max_new_tokens, const SamplingOptions& options) {
  options.validate();
  FIVEFOLD_CHECK(!prompt.empty(), "generate: the prompt is empty");
  FIVEFOLD_CHECK(max_new_tokens >= 0, "generate: max_new_tokens must be >= 0");
  const int64_t vocab = model->config().vocab_size;
  for (int64_t t : prompt) {
    FIVEFOLD_CHECK(t >= 0 && t < vocab, "generate: prompt token ", t,
                   " is outside the vocabulary (0..", vocab - 1, ")");
  }
  torch::NoGradGuard no_grad;
  auto generator = generator_for(options.seed, "sampling");
  std::vector<int64_t> sequence = prompt, produced;
  KVCache cache;
  // With the cache the first pass feeds the whole prompt, later passes only the newest token.
  auto next_input = torch::tensor(prompt, torch::kLong).unsqueeze(0);  // [1, prompt length]
  for (int64_t step = 0; step < max_new_tokens; ++step) {
    torch::Tensor logits;  // [1, positions fed, vocab]
    if (options.use_cache) {
      logits = model->forward(next_input, &cache);
    } else {
      logits = model->forward(torch::tensor(sequence, torch::kLong).unsqueeze(0));
    }
    const int64_t token = pick_token(logits[0][-1], options, generator);
    produced.push_back(token);
    sequence.push_back(token);
    if (options.on_token) options.on_token(token);
    const auto& stops = options.stop_tokens;
    if (std::find(stops.begin(), stops.end(), token) != stops.end()) break;
    next_input = torch::full({1, 1}, token, torch::kLong);
  }
  return produced;
}

}  // namespace fivefold::ch03
