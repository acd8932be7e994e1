// Chapter 04: RoPE against hand-computed values and its defining properties (relative positions,
// norms, the complex form, the two layouts, offsets), and in chapter 03's model (KV cache,
// checkpoints, the recipe that installs it).

#include <cmath>

#include "03_transformer/checkpoint.h"
#include "03_transformer/generate.h"
#include "04_rope/rope.h"
#include "fivefold/io.h"
#include "fivefold/seed.h"
#include "testing.h"

using namespace fivefold::ch04;
using fivefold::testing::ScratchDir;
using fivefold::testing::throws_error_containing;

namespace {
torch::Tensor randn(std::vector<int64_t> shape, const std::string& name,
                    torch::Dtype dtype = torch::kDouble) {
  return torch::randn(shape, fivefold::generator_for(4, name), dtype);
}

// RoPE at positions first.. in float64 (cos/sin from the float64 angles).
torch::Tensor rope64(const torch::Tensor& x, int64_t first, double base, RopeLayout layout) {
  auto angles = torch::outer(torch::arange(first, first + x.size(-2), torch::kDouble),
                             rope_frequencies(x.size(-1), base));
  return apply_rope(x, angles.cos(), angles.sin(), layout);
}

fivefold::ch03::ModelConfig small(double rope_theta) {
  fivefold::ch03::ModelConfig c;
  c.vocab_size = 61;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.d_ff = 64;
  c.rope_theta = rope_theta;
  return c;
}
}  // namespace

TEST(Rope, HandComputedValues) {
  // d = 4, base 100: θ = (1, 0.1). Position 2 turns pair 0 by 2 rad and pair 1 by 0.2 rad.
  auto x = torch::tensor({1.0, 2.0, 3.0, 4.0}, torch::kDouble).view({1, 4});
  auto half = rope64(x, 2, 100.0, RopeLayout::HalfSplit);  // pairs (x0, x2), (x1, x3)
  const double c0 = std::cos(2.0), s0 = std::sin(2.0), c1 = std::cos(0.2), s1 = std::sin(0.2);
  auto expected_half =
      torch::tensor({1 * c0 - 3 * s0, 2 * c1 - 4 * s1, 1 * s0 + 3 * c0, 2 * s1 + 4 * c1},
                    torch::kDouble)
          .view({1, 4});
  EXPECT_TENSOR_CLOSE(half, expected_half, 1e-15, 0.0);
  auto inter = rope64(x, 2, 100.0, RopeLayout::Interleaved);  // pairs (x0, x1), (x2, x3)
  auto expected_inter =
      torch::tensor({1 * c0 - 2 * s0, 1 * s0 + 2 * c0, 3 * c1 - 4 * s1, 3 * s1 + 4 * c1},
                    torch::kDouble)
          .view({1, 4});
  EXPECT_TENSOR_CLOSE(inter, expected_inter, 1e-15, 0.0);
  // Position 0 is the identity; frequencies are base^(-2i/d).
  EXPECT_TENSOR_EQ(rope64(x, 0, 100.0, RopeLayout::HalfSplit), x);
  EXPECT_TENSOR_CLOSE(rope_frequencies(8, 10000.0),
                      torch::tensor({1.0, 0.1, 0.01, 0.001}, torch::kDouble), 1e-15, 1e-12);
}

TEST(Rope, ScoresDependOnlyOnRelativePosition) {
  for (auto layout : {RopeLayout::HalfSplit, RopeLayout::Interleaved}) {
    auto q = randn({1, 16}, "q"), k = randn({1, 16}, "k");
    auto score = [&](int64_t m, int64_t n) {
      return (rope64(q, m, 10000.0, layout) * rope64(k, n, 10000.0, layout)).sum().item<double>();
    };
    for (int64_t shift : {1, 7, 1000, 50000}) {
      EXPECT_NEAR(score(5, 2), score(5 + shift, 2 + shift), 1e-9) << "shift " << shift;
      EXPECT_NEAR(score(2, 9), score(2 + shift, 9 + shift), 1e-9) << "shift " << shift;
    }
    EXPECT_GT(std::abs(score(5, 2) - score(5, 3)), 1e-3);  // but it does depend on m - n
  }
}

TEST(Rope, PreservesNorms) {
  auto x = randn({2, 3, 10, 16}, "x");
  for (auto layout : {RopeLayout::HalfSplit, RopeLayout::Interleaved}) {
    auto rotated = rope64(x, 3, 10000.0, layout);
    EXPECT_TENSOR_CLOSE(rotated.norm(2, -1), x.norm(2, -1), 1e-12, 1e-12);
    EXPECT_FALSE(torch::allclose(rotated, x));
  }
}

TEST(Rope, ComplexFormEqualsRealForm) {
  auto x = randn({2, 4, 9, 8}, "x");
  EXPECT_TENSOR_CLOSE(apply_rope_complex(x, 11, 10000.0),
                      rope64(x, 11, 10000.0, RopeLayout::Interleaved), 1e-12, 1e-12);
}

TEST(Rope, LayoutsDifferByARowPermutation) {
  const int64_t d = 8;
  auto x = randn({3, 5, d}, "x");
  auto p = interleaved_to_half_split(d);
  EXPECT_TENSOR_EQ(p, torch::tensor({0, 2, 4, 6, 1, 3, 5, 7}, torch::kLong));
  // half_split(x[P]) == interleaved(x)[P]: permuting q_proj/k_proj rows converts the layouts.
  EXPECT_TENSOR_CLOSE(rope64(x.index_select(-1, p), 4, 10000.0, RopeLayout::HalfSplit),
                      rope64(x, 4, 10000.0, RopeLayout::Interleaved).index_select(-1, p), 1e-15,
                      0.0);
  // And the scores are the same either way: q·k is invariant under a common permutation.
  auto q = randn({1, d}, "q"), k = randn({1, d}, "k");
  auto s_inter =
      (rope64(q, 9, 1e4, RopeLayout::Interleaved) * rope64(k, 3, 1e4, RopeLayout::Interleaved))
          .sum();
  auto s_half = (rope64(q.index_select(-1, p), 9, 1e4, RopeLayout::HalfSplit) *
                 rope64(k.index_select(-1, p), 3, 1e4, RopeLayout::HalfSplit))
                    .sum();
  EXPECT_NEAR(s_inter.item<double>(), s_half.item<double>(), 1e-12);
}

TEST(Rope, AnOffsetEqualsTheSameSliceOfTheFullSequence) {
  RotaryEmbedding rope(16, 10000.0, RopeLayout::HalfSplit, /*cached_positions=*/20);
  auto q = randn({2, 4, 30, 16}, "q", torch::kFloat), k = randn({2, 2, 30, 16}, "k", torch::kFloat);
  // positions 20..29 computed beyond the cache
  auto [full_q, full_k] = rope.encode(q, k, fivefold::ch03::position_range(0, 30));
  for (int64_t first : {0, 5, 17, 25}) {
    auto [part_q, part_k] = rope.encode(q.narrow(2, first, 5), k.narrow(2, first, 5),
                                        fivefold::ch03::position_range(first, 5));
    EXPECT_TENSOR_CLOSE(part_q, full_q.narrow(2, first, 5), 1e-6, 1e-6);
    EXPECT_TENSOR_CLOSE(part_k, full_k.narrow(2, first, 5), 1e-6, 1e-6);
  }
}

// A sequence shard need not be contiguous (chapter 12's load-balanced layout takes a block from
// each end): the tokens at positions {2, 3, 26, 27} get the rows of those positions.
TEST(Rope, PositionsInAnyOrderEqualTheSameRowsOfTheFullSequence) {
  RotaryEmbedding rope(16, 10000.0, RopeLayout::HalfSplit, /*cached_positions=*/20);
  auto q = randn({2, 4, 30, 16}, "q", torch::kFloat), k = randn({2, 2, 30, 16}, "k", torch::kFloat);
  auto [full_q, full_k] = rope.encode(q, k, fivefold::ch03::position_range(0, 30));
  for (auto rows : {std::vector<int64_t>{2, 3, 26, 27}, std::vector<int64_t>{7, 1, 19, 4}}) {
    auto positions = torch::tensor(rows, torch::kLong);
    auto [part_q, part_k] =
        rope.encode(q.index_select(2, positions), k.index_select(2, positions), positions);
    EXPECT_TENSOR_CLOSE(part_q, full_q.index_select(2, positions), 1e-6, 1e-6);
    EXPECT_TENSOR_CLOSE(part_k, full_k.index_select(2, positions), 1e-6, 1e-6);
  }
}

TEST(RopeModel, KVCacheAndGenerationAgreeWithTheFullForward) {
  auto model = make_model(small(10000.0));
  torch::NoGradGuard no_grad;
  auto tokens = torch::randint(61, {2, 12}, fivefold::generator_for(4, "tokens"));
  auto full = model(tokens);
  fivefold::ch03::KVCache cache;
  auto first = model->forward(tokens.narrow(1, 0, 7), &cache);
  auto rest = model->forward(tokens.narrow(1, 7, 5), &cache);
  EXPECT_TENSOR_CLOSE(torch::cat({first, rest}, 1), full, 1e-5, 1e-5);
  fivefold::ch03::SamplingOptions cached, uncached;
  uncached.use_cache = false;
  EXPECT_EQ(generate(model, {3, 1, 4}, 15, cached), generate(model, {3, 1, 4}, 15, uncached));
  // Order matters now. In a one-layer model without positions, swapping the first two tokens
  // leaves the last position's logits unchanged (its attention sees a set); with RoPE they change.
  auto order = torch::tensor({{5, 9, 2}, {9, 5, 2}}, torch::kLong);
  auto one_layer = small(0);
  one_layer.n_layers = 1;
  auto nope = fivefold::ch03::build_model(one_layer);
  auto last_nope = nope(order).select(1, 2), last_rope = model(order).select(1, 2);
  EXPECT_TENSOR_CLOSE(last_nope[0], last_nope[1], 1e-6, 1e-6);
  EXPECT_FALSE(torch::allclose(last_rope[0], last_rope[1], 1e-3, 1e-3));
}

TEST(RopeModel, CheckpointsCarryRopeTheta) {
  ScratchDir dir("rope");
  auto model = make_model(small(500000.0));
  fivefold::ch03::save_model(dir.path("m"), model);
  EXPECT_EQ(fivefold::io::read_json(dir.path("m") + "/config.json")["rope_theta"], 500000.0);
  auto loaded = load_model(dir.path("m"));
  EXPECT_EQ(loaded->config().rope_theta, 500000.0);
  auto tokens = torch::randint(61, {1, 9}, fivefold::generator_for(4, "tokens"));
  torch::NoGradGuard no_grad;
  EXPECT_TENSOR_EQ(loaded(tokens), model(tokens));
  // Chapter 03's loader builds no encoding: it refuses to compute the wrong function.
  auto plain = fivefold::ch03::load_model(dir.path("m"));
  EXPECT_TRUE(throws_error_containing([&] { plain(tokens); }, "no position encoding"));
  // A model without RoPE writes rope_theta 0 (absent would mean Hugging Face's default, 10000)
  // and loads as before.
  auto nope = fivefold::ch03::build_model(small(0));
  fivefold::ch03::save_model(dir.path("nope"), nope);
  EXPECT_EQ(fivefold::io::read_json(dir.path("nope") + "/config.json")["rope_theta"], 0.0);
  EXPECT_EQ(load_model(dir.path("nope"))->config().rope_theta, 0.0);
}

TEST(Rope, RejectsBadConfigurations) {
  EXPECT_TRUE(throws_error_containing([] { rope_frequencies(7, 10000.0); }, "even"));
  EXPECT_TRUE(throws_error_containing([] { rope_frequencies(8, 0.0); }, "positive"));
  auto odd = small(10000.0);
  odd.head_dim = 7;
  EXPECT_TRUE(throws_error_containing([&] { make_model(odd); }, "even head_dim"));
  auto json = fivefold::ch03::config_to_json(small(10000.0));
  json["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_TRUE(throws_error_containing([&] { make_model(fivefold::ch03::config_from_json(json)); },
                                      "chapter 05"));
}
