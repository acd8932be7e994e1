// Chapter 03's model: attention against a naive loop (the exercise), causality, agreement with
// chapter 02's functional model on the same weights, FLOPs measured == chapter 02's formula, and
// the plumbing (Hugging Face names, parameter count, seeded initialisation, config errors).

#include <cmath>

#include "01_weight_init/weight_init.h"
#include "03_transformer/model.h"
#include "fivefold/error.h"
#include "fivefold/seed.h"
#include "testing.h"

using namespace fivefold::ch03;

namespace {
ModelConfig small(int64_t n_kv_heads = 4, bool tied = false) {
  ModelConfig c;
  c.vocab_size = 97;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = n_kv_heads;
  c.d_ff = 80;
  c.tied_embeddings = tied;
  c.rms_norm_eps = 1e-6;  // chapter 02's functional model uses 1e-6
  return c;
}

torch::Tensor tokens_for(const ModelConfig& c, int64_t batch, int64_t seq) {
  return torch::randint(c.vocab_size, {batch, seq}, fivefold::generator_for(9, "tokens"));
}
}  // namespace

TEST(CausalAttention, EqualsANaiveLoopOverPositions) {
  for (int64_t n_kv : {4, 2, 1}) {
    const int64_t batch = 2, heads = 4, seq = 6, dim = 8;
    auto q =
        torch::randn({batch, heads, seq, dim}, fivefold::generator_for(1, "q"), torch::kDouble);
    auto k = torch::randn({batch, n_kv, seq, dim}, fivefold::generator_for(1, "k"), torch::kDouble);
    auto v = torch::randn({batch, n_kv, seq, dim}, fivefold::generator_for(1, "v"), torch::kDouble);
    auto expected = torch::zeros({batch, heads, seq, dim}, torch::kDouble);
    for (int64_t b = 0; b < batch; ++b) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t g = h / (heads / n_kv);  // the kv head serving query head h
        for (int64_t i = 0; i < seq; ++i) {
          // softmax over j <= i of q_i·k_j / sqrt(dim), then the weighted sum of v_j.
          auto scores = torch::mv(k[b][g].narrow(0, 0, i + 1), q[b][h][i]) / std::sqrt(8.0);
          expected[b][h][i] = torch::mv(v[b][g].narrow(0, 0, i + 1).t(), torch::softmax(scores, 0));
        }
      }
    }
    EXPECT_TENSOR_CLOSE(causal_attention(q, k, v), expected, 1e-12, 1e-12);
  }
}

TEST(Transformer, FutureTokensDoNotChangeThePast) {
  Transformer model(small(2));
  auto tokens = tokens_for(model->config(), 1, 12);
  auto changed = tokens.clone();
  changed.narrow(1, 8, 4).fill_(5);  // rewrite positions 8..11
  torch::NoGradGuard no_grad;
  auto a = model(tokens), b = model(changed);
  EXPECT_TENSOR_EQ(a.narrow(1, 0, 8), b.narrow(1, 0, 8));
  EXPECT_FALSE(torch::equal(a.narrow(1, 8, 4), b.narrow(1, 8, 4)));
}

TEST(Transformer, AgreesWithChapter02sModelOnTheSameWeights) {
  for (const auto& config : {small(4), small(2, /*tied=*/true), small(1)}) {
    Transformer model(config);
    std::map<std::string, torch::Tensor> weights;
    for (const auto& item : model->named_parameters()) weights[item.key()] = item.value();
    auto tokens = tokens_for(config, 3, 10);
    // fp32, same operations in the same order: 1e-6 covers any difference in fused kernels.
    EXPECT_TENSOR_CLOSE(model(tokens), fivefold::ch02::forward(config.shape(), weights, tokens),
                        1e-6, 1e-6);
  }
}

TEST(Transformer, MeasuredFlopsEqualChapter02sFormula) {
  for (const auto& config : {small(4), small(2, true)}) {
    Transformer model(config);
    for (int64_t seq : {1, 9}) {
      auto tokens = tokens_for(config, 2, seq);
      fivefold::ch02::FlopCounter counter;
      auto logits = model(tokens);
      torch::cross_entropy_loss(logits.view({-1, config.vocab_size}), tokens.view({-1})).backward();
      EXPECT_EQ(counter.flops(),
                2.0 * seq * fivefold::ch02::training_flops_per_token(config.shape(), seq));
    }
  }
}

// A model split into parts (a pipeline stage holds some layers; the first the embedding, the last
// the head) has, under the same global names, the whole model's initial weights bit for bit, and
// its parts run in a row compute the whole model's logits and loss.
TEST(Transformer, PartsHoldTheWholeModelsWeightsAndComputeItsForward) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    ModelConfig config = small(2, tied);
    config.n_layers = 4;
    Transformer whole(config);
    ModelPart first_part{0, 1, /*embedding=*/true, /*head=*/false, {}};
    ModelPart middle_part{1, 3, false, false, {}};
    ModelPart last_part{3, -1, false, true, {}};
    Transformer first(config, ModelRecipe{}, first_part),
        middle(config, ModelRecipe{}, middle_part), last(config, ModelRecipe{}, last_part);
    auto reference = whole->named_parameters();
    int64_t names = 0;
    for (auto* part : {&first, &middle, &last}) {
      for (const auto& item : (*part)->named_parameters()) {
        SCOPED_TRACE(item.key());
        ASSERT_TRUE(reference.contains(item.key()));
        EXPECT_TENSOR_EQ(item.value(), reference[item.key()]);
        ++names;
      }
    }
    // Every name once, except the tied table, which the first and the last part both hold.
    EXPECT_EQ(names, static_cast<int64_t>(reference.size()) + (tied ? 1 : 0));
    EXPECT_EQ(middle->layer_indices(), (std::vector<int64_t>{1, 2}));
    EXPECT_TRUE(reference.contains("model.layers.2.mlp.down_proj.weight"));
    EXPECT_FALSE(middle->named_parameters().contains("model.norm.weight"));

    const auto tokens = tokens_for(config, 2, 7);
    const auto positions = position_range(0, 7);
    auto x = first->forward_layers(first->embed(tokens), positions, 0, 1);
    x = middle->forward_layers(x, positions, 1, 3);
    x = last->forward_layers(x, positions, 3, 4);
    // The same operations in the same order: bit for bit.
    EXPECT_TENSOR_EQ(last->logits(x), whole(tokens));
    EXPECT_TRUE(fivefold::testing::throws_error_containing(
        [&] { middle->forward_layers(x, positions, 0, 2); }, "layer 0 is not held by this part"));
    // An interleaved pipeline stage (chapter 11) holds several ranges: layers 0 and 2..3 here.
    ModelPart ranges{0, 1, true, true, {}};
    ranges.more_layers = {{2, 4}};
    Transformer gapped(config, ModelRecipe{}, ranges);
    EXPECT_EQ(gapped->layer_indices(), (std::vector<int64_t>{0, 2, 3}));
    EXPECT_FALSE(gapped->part().whole(config.n_layers));
    for (const auto& item : gapped->named_parameters()) {
      SCOPED_TRACE(item.key());
      EXPECT_TENSOR_EQ(item.value(), reference[item.key()]);
    }
    EXPECT_TRUE(fivefold::testing::throws_error_containing(
        [&] { gapped->forward_layers(x, positions, 0, 2); }, "layer 1 is not held"));
    ranges.more_layers = {{0, 2}};
    EXPECT_TRUE(fivefold::testing::throws_error_containing(
        [&] { Transformer(config, ModelRecipe{}, ranges); }, "must follow the ranges before"));
    EXPECT_TRUE(
        fivefold::testing::throws_error_containing([&] { middle->embed(tokens); }, "no embedding"));
  }
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [] {
        Transformer(small(), ModelRecipe{}, ModelPart{1, 5, true, true, {}});
      },
      "not within the model's 2"));
}

// The output slot's loss ignores targets of -100 (padding), as PyTorch's cross-entropy does.
TEST(Transformer, LossIgnoresPaddedTargets) {
  const auto config = small();
  Transformer model(config);
  const auto tokens = tokens_for(config, 2, 6);
  auto targets = tokens.roll(-1, 1);
  const auto hidden = model->forward_layers(model->embed(tokens), position_range(0, 6), 0, 2);
  auto padded = targets.clone();
  padded.narrow(1, 4, 2).fill_(-100);
  EXPECT_NEAR(model->loss(hidden, padded).item<double>(),
              model->loss(hidden.narrow(1, 0, 4), targets.narrow(1, 0, 4)).item<double>(), 1e-6);
}

// The linear map every block uses: its backward equals torch's linear; deferred, the weight gets
// no gradient until the store is flushed, then exactly the same one (chapter 11's zero bubble).
TEST(Linear, DeferredWeightGradientEqualsTheImmediateOne) {
  torch::manual_seed(0);
  Linear layer(6, 4);
  const auto x = torch::randn({2, 3, 6}, torch::requires_grad());
  const auto dy = torch::randn({2, 3, 4});
  // torch's own linear for reference.
  const auto w = layer->weight.detach().clone().requires_grad_(true);
  const auto x_ref = x.detach().clone().requires_grad_(true);
  torch::nn::functional::linear(x_ref, w).backward(dy);

  layer(x).backward(dy);
  EXPECT_TENSOR_CLOSE(layer->weight.grad(), w.grad(), 1e-6, 1e-5);
  EXPECT_TENSOR_CLOSE(x.grad(), x_ref.grad(), 1e-6, 1e-5);

  layer->weight.mutable_grad() = torch::Tensor();
  x.mutable_grad() = torch::Tensor();
  WeightGradientStore store;
  {
    DeferWeightGradients defer(store);
    layer(x).backward(dy);
  }
  EXPECT_FALSE(layer->weight.grad().defined());  // put off
  EXPECT_TENSOR_CLOSE(x.grad(), x_ref.grad(), 1e-6, 1e-5);
  EXPECT_EQ(store.size(), 1u);
  store.flush();
  EXPECT_EQ(store.size(), 0u);
  EXPECT_TENSOR_CLOSE(layer->weight.grad(), w.grad(), 1e-6, 1e-5);
}
