// Chapter 03 generation: the KV cache changes the cost, not the result; attention over cached keys
// (fewer queries than keys) equals the naive loop; sampling is reproducible and respects top-k.

#include <algorithm>
#include <cmath>
#include <set>

#include "03_transformer/generate.h"
#include "fivefold/seed.h"
#include "testing.h"

using namespace fivefold::ch03;
using fivefold::testing::throws_error_containing;

namespace {
ModelConfig small(int64_t n_kv_heads) {
  ModelConfig c;
  c.vocab_size = 61;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = n_kv_heads;
  c.d_ff = 64;
  c.seed = 3;
  return c;
}
}  // namespace

TEST(CausalAttention, QueriesAfterCachedKeysEqualTheNaiveLoop) {
  // 2 queries at positions 5 and 6 of 7 keys (a KV cache holding 5 positions).
  const int64_t heads = 4, n_kv = 2, seq_q = 2, seq_k = 7, dim = 8;
  auto q = torch::randn({1, heads, seq_q, dim}, fivefold::generator_for(2, "q"), torch::kDouble);
  auto k = torch::randn({1, n_kv, seq_k, dim}, fivefold::generator_for(2, "k"), torch::kDouble);
  auto v = torch::randn({1, n_kv, seq_k, dim}, fivefold::generator_for(2, "v"), torch::kDouble);
  auto expected = torch::zeros({1, heads, seq_q, dim}, torch::kDouble);
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t g = h / (heads / n_kv);
    for (int64_t i = 0; i < seq_q; ++i) {
      const int64_t position = seq_k - seq_q + i;  // keys 0..position are visible
      auto keys = k[0][g].narrow(0, 0, position + 1);
      auto weights = torch::softmax(torch::mv(keys, q[0][h][i]) / std::sqrt(8.0), 0);
      expected[0][h][i] = torch::mv(v[0][g].narrow(0, 0, position + 1).t(), weights);
    }
  }
  EXPECT_TENSOR_CLOSE(causal_attention(q, k, v), expected, 1e-12, 1e-12);
}

TEST(KVCache, IncrementalLogitsEqualTheFullForward) {
  for (int64_t n_kv : {4, 2, 1}) {
    Transformer model(small(n_kv));
    torch::NoGradGuard no_grad;
    auto tokens = torch::randint(61, {2, 12}, fivefold::generator_for(4, "tokens"));
    auto full = model(tokens);  // [2, 12, vocab]
    // Feed 5 tokens, then 1, then the remaining 6: each pass sees the cache of the previous ones.
    KVCache cache;
    std::vector<torch::Tensor> parts;
    for (auto [start, length] : {std::pair<int64_t, int64_t>{0, 5}, {5, 1}, {6, 6}}) {
      EXPECT_EQ(cache.length(), start);
      parts.push_back(model->forward(tokens.narrow(1, start, length), &cache));
    }
    EXPECT_EQ(cache.length(), 12);
    // Same products over the same keys, but different matmul shapes: fp32 rounding differs (1e-5).
    EXPECT_TENSOR_CLOSE(torch::cat(parts, 1), full, 1e-5, 1e-5);
  }
}

TEST(KVCache, BytesEqualTheFormula) {
  for (int64_t n_kv : {4, 2, 1}) {
    const ModelConfig c = small(n_kv);
    Transformer model(c);
    torch::NoGradGuard no_grad;
    KVCache cache;
    const int64_t batch = 3, tokens = 10;
    model->forward(torch::zeros({batch, tokens}, torch::kLong), &cache);
    // notes/03_transformer.md section 2: 2 · L · h_kv · d_head · b · n · e
    EXPECT_EQ(cache.bytes(), 2 * c.n_layers * n_kv * c.resolved_head_dim() * batch * tokens * 4);
  }
}

TEST(Generate, WithAndWithoutTheCacheGiveTheSameTokens) {
  Transformer model(small(2));
  const std::vector<int64_t> prompt = {3, 1, 4, 1, 5};
  SamplingOptions cached, uncached;
  uncached.use_cache = false;
  EXPECT_EQ(generate(model, prompt, 20, cached), generate(model, prompt, 20, uncached));
  cached.greedy = uncached.greedy = false;  // sampling: same seed, same draws
  cached.top_k = uncached.top_k = 5;
  cached.seed = uncached.seed = 11;
  EXPECT_EQ(generate(model, prompt, 20, cached), generate(model, prompt, 20, uncached));
}

TEST(Generate, GreedyTakesTheArgmaxAndStopsAtAStopToken) {
  Transformer model(small(4));
  const std::vector<int64_t> prompt = {7, 8, 9};
  const auto ten = generate(model, prompt, 10);
  ASSERT_EQ(ten.size(), 10u);
  // Step by step: each token is the argmax of the full forward over the sequence so far.
  std::vector<int64_t> sequence = prompt;
  torch::NoGradGuard no_grad;
  for (int64_t token : ten) {
    auto logits = model(torch::tensor(sequence, torch::kLong).unsqueeze(0))[0][-1];
    EXPECT_EQ(token, logits.argmax().item<int64_t>());
    sequence.push_back(token);
  }
  SamplingOptions stop;
  stop.stop_tokens = {ten[3]};
  const auto stopped = generate(model, prompt, 10, stop);
  const auto first = std::find(ten.begin(), ten.end(), ten[3]) - ten.begin();
  EXPECT_EQ(stopped, std::vector<int64_t>(ten.begin(), ten.begin() + first + 1));
}

TEST(Generate, SamplingIsSeededAndRespectsTopK) {
  Transformer model(small(4));
  SamplingOptions options;
  options.greedy = false;
  options.seed = 5;
  const std::vector<int64_t> prompt = {1, 2};
  EXPECT_EQ(generate(model, prompt, 30, options), generate(model, prompt, 30, options));
  options.seed = 6;
  const auto other = generate(model, prompt, 30, options);
  options.seed = 5;
  EXPECT_NE(generate(model, prompt, 30, options), other);

  // top_k = 3: every draw is among the 3 most likely tokens; top_k = 1 is greedy.
  auto logits = torch::randn({50}, fivefold::generator_for(1, "logits"));
  const auto top3 = std::get<1>(logits.topk(3));
  options.top_k = 3;
  auto generator = fivefold::generator_for(1, "draws");
  std::set<int64_t> drawn;
  for (int i = 0; i < 300; ++i) drawn.insert(pick_token(logits, options, generator));
  EXPECT_EQ(drawn, std::set<int64_t>(top3.data_ptr<int64_t>(), top3.data_ptr<int64_t>() + 3));
  options.top_k = 1;
  EXPECT_EQ(pick_token(logits, options, generator), logits.argmax().item<int64_t>());
}

TEST(Generate, RejectsBadInput) {
  Transformer model(small(4));
  EXPECT_TRUE(throws_error_containing([&] { generate(model, {}, 3); }, "prompt is empty"));
  EXPECT_TRUE(throws_error_containing([&] { generate(model, {1, 61}, 3); }, "outside the vocab"));
  SamplingOptions hot;
  hot.temperature = 0;
  EXPECT_TRUE(throws_error_containing([&] { generate(model, {1}, 3, hot); }, "temperature"));
}
