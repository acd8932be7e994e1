// Chapter 02, the exercise: FLOPs per token against the FLOPs LibTorch executes, measured by the
// counter over a real forward + backward, for an MLP and for the chapter's small transformer.

#include <cmath>

#include "fivefold/error.h"
#include "fivefold/seed.h"
#include "shapes.h"
#include "testing.h"

using namespace fivefold::ch02;

TEST(FlopCounter, MlpForwardAndBackward) {
  // Three layers 24 -> 40 -> 40 -> 8 on a batch of 16.
  const int64_t batch = 16;
  const std::vector<std::pair<int64_t, int64_t>> layers = {{24, 40}, {40, 40}, {40, 8}};
  std::vector<torch::Tensor> weights;
  double forward = 0;
  for (auto [in, out] : layers) {
    weights.push_back(torch::randn({out, in}, fivefold::generator_for(1, std::to_string(in)))
                          .requires_grad_(true));
    forward += 2.0 * batch * in * out;
  }
  for (bool input_needs_grad : {false, true}) {
    auto x = torch::randn({batch, 24}).requires_grad_(input_needs_grad);
    FlopCounter counter;
    auto y = x;
    for (const auto& w : weights) y = torch::relu(torch::linear(y, w));
    EXPECT_DOUBLE_EQ(counter.flops(), forward);
    y.sum().backward();
    // Backward is 2x forward, except that the first layer computes no gradient for an input
    // that does not need one: 3F - F_first (notes/02_flops_6np.md).
    const double first = 2.0 * batch * 24 * 40;
    EXPECT_DOUBLE_EQ(counter.flops(), input_needs_grad ? 3 * forward : 3 * forward - first);
  }
}

TEST(FlopsPerToken, MeasuredEqualsAnalyticExactly) {
  for (const auto& shape : ch02_test::small_shapes()) {
    const auto weights = make_weights(shape, 3);
    for (int64_t seq : {1, 7, 16}) {
      const int64_t batch = 3;
      auto tokens =
          torch::randint(shape.vocab_size, {batch, seq}, fivefold::generator_for(5, "tokens"));
      FlopCounter counter;
      auto logits = forward(shape, weights, tokens);  // [batch, seq, vocab]
      const double forward_measured = counter.flops();
      auto loss = torch::cross_entropy_loss(logits.view({-1, shape.vocab_size}), tokens.view({-1}));
      loss.backward();
      const double tokens_count = static_cast<double>(batch * seq);
      EXPECT_EQ(forward_measured, tokens_count * forward_flops_per_token(shape, seq).total())
          << "d_model " << shape.d_model << ", seq " << seq;
      EXPECT_EQ(counter.flops(), tokens_count * training_flops_per_token(shape, seq))
          << "d_model " << shape.d_model << ", seq " << seq;
    }
  }
}

TEST(FlopsPerToken, ComponentsOfAWorkedExample) {
  // d 32, 2 layers, 4 heads of 8 (2 kv heads), d_ff 80 gated, vocab 96, context 10:
  TransformerShape s{96, 32, 2, 4, 2, 8, 80};
  const auto f = forward_flops_per_token(s, 10);
  EXPECT_EQ(f.qkv, 2 * 2 * 32 * (32 + 2 * 16));    // 8192
  EXPECT_EQ(f.attention_scores, 2 * 2 * 32 * 10);  // 1280
  EXPECT_EQ(f.attention_values, 2 * 2 * 32 * 10);
  EXPECT_EQ(f.output_projection, 2 * 2 * 32 * 32);
  EXPECT_EQ(f.mlp, 2 * 3 * 2 * 32 * 80);
  EXPECT_EQ(f.lm_head, 2 * 32 * 96);
  EXPECT_EQ(training_flops_per_token(s, 10), 3 * f.total());
}

TEST(FlopsPerToken, SixNPlusTheContextTerm) {
  // Training FLOPs = 6 x matmul weights + 3 x (scores + values) = 6N +
  // 12·L·context·(heads·head_dim).
  for (const auto& shape : ch02_test::small_shapes()) {
    for (int64_t context : {1, 128, 4096}) {
      const double attention = 12.0 * shape.n_layers * context * shape.n_heads * shape.head_dim;
      EXPECT_EQ(training_flops_per_token(shape, context), six_n_flops_per_token(shape) + attention);
    }
  }
  // Kaplan et al.'s ratio for d_attn = d_model, d_ff = 4 d_model, N ~ 12 L d²: 1 + context/(6 d)
  // for attention computed in full (a causal kernel halves it: 1 + context/(12 d)).
  TransformerShape big{2, 4096, 32, 32, 32, 128, 4 * 4096, false};
  const double ratio = training_flops_per_token(big, 2048) / six_n_flops_per_token(big);
  EXPECT_NEAR(ratio, 1 + 2048.0 / (6 * 4096), 0.001);
}

TEST(Plan, ReportsTheFigures) {
  const auto shape = shape_from_hf_config(ch02_test::llama2_7b());
  const auto out = plan(shape, 4096, 2e12, 1e23, 989e12, 0.4, 1024);
  EXPECT_EQ(out["parameters"]["total"], 6738415616);
  EXPECT_EQ(out["flops_per_token"]["training"].get<double>(),
            training_flops_per_token(shape, 4096));
  const double flops = 2e12 * training_flops_per_token(shape, 4096);
  EXPECT_DOUBLE_EQ(out["training"]["flops"].get<double>(), flops);
  EXPECT_DOUBLE_EQ(out["training"]["seconds"].get<double>(), flops / (1024 * 989e12 * 0.4));
  EXPECT_DOUBLE_EQ(out["memory_per_device_bytes"]["total_without_activations"].get<double>(),
                   16.0 * 6738415616);
  EXPECT_NEAR(out["budget"]["chinchilla_parameters"].get<double>(), std::sqrt(1e23 / 120), 1.0);
  EXPECT_THROW(plan(shape, 0, 0, 0, 1, 1, 1), fivefold::Error);
  EXPECT_THROW(plan(shape, 4096, 1e9, 0, 989e12, 1.5, 8), fivefold::Error);  // MFU > 1
}
