// Chapter 01 plumbing: each scheme's std, GPT-2's residual scaling measured on a residual stack,
// and layout independence (a shard is the same slice of the single-device tensor).

#include <cmath>

#include "01_weight_init/weight_init.h"
#include "fivefold/error.h"
#include "testing.h"

using namespace fivefold::ch01;

TEST(Schemes, MeasuredStdMatchesEachFormula) {
  const int64_t out = 512, in = 768;
  struct Case {
    InitSpec spec;
    double expected;
  };
  const Case cases[] = {
      {{Scheme::LibTorchDefault}, 1.0 / std::sqrt(3.0 * in)},
      {{Scheme::Xavier}, std::sqrt(2.0 / (in + out))},
      {{Scheme::Gpt2, Activation::Linear, 0.02, 12}, 0.02},
      {{Scheme::Gpt2, Activation::Linear, 0.02, 12, true}, 0.02 / std::sqrt(24.0)},
      {{Scheme::FixedStd, Activation::Linear, 0.5}, 0.5},
  };
  for (const auto& c : cases) {
    EXPECT_NEAR(init_std(c.spec, in, out), c.expected, 1e-12);
    const double measured = init_weight("w", out, in, c.spec, 5).std().item<double>();
    EXPECT_NEAR(measured, c.expected, 0.01 * c.expected);  // 393K samples: ~0.1% spread
  }
  auto uniform = init_weight("u", out, in, {Scheme::LibTorchDefault}, 5);
  EXPECT_LE(uniform.abs().max().item<double>(), 1.0 / std::sqrt(static_cast<double>(in)));
}

TEST(Schemes, BadShapesAreErrors) {
  EXPECT_THROW(init_std({Scheme::Xavier}, 0, 4), fivefold::Error);
  EXPECT_THROW(init_std({Scheme::Gpt2, Activation::Linear, 0.02, 0}, 4, 4), fivefold::Error);
}

TEST(ResidualStream, VarianceGrowsAsDerivedAndGpt2ScalingContainsIt) {
  // Each pre-norm branch adds 2·w²·σ_in²·σ_out² to the stream's variance (notes/01_weight_init.md):
  // after L branches Var = 1 + L · 2·w²·σ_in²·σ_out². Checked here for every scheme in the demo
  // but Kaiming, which needs the exercise (test_variance.cpp checks it).
  const int64_t depth = 48, width = 256, batch = 512;
  const InitSpec gpt2{Scheme::Gpt2, Activation::ReLU, 0.02, depth / 2};
  InitSpec gpt2_scaled = gpt2;
  gpt2_scaled.residual_projection = true;
  const std::pair<InitSpec, InitSpec> stacks[] = {
      {{Scheme::LibTorchDefault}, {Scheme::LibTorchDefault}},
      {{Scheme::Xavier}, {Scheme::Xavier}},
      {gpt2, gpt2},
      {gpt2, gpt2_scaled},
  };
  std::vector<double> final_std;
  for (const auto& [in_spec, out_spec] : stacks) {
    const auto profile = residual_profile(depth, width, batch, in_spec, out_spec, 13);
    final_std.push_back(profile.activation_std.back());
    const double s_in = init_std(in_spec, width, 4 * width);
    const double s_out = init_std(out_spec, 4 * width, width);
    for (int64_t l : {1L, depth / 2, depth}) {
      const double predicted = 1.0 + l * 2.0 * width * width * s_in * s_in * s_out * s_out;
      const double measured = std::pow(profile.activation_std[l - 1], 2);
      // The realised weights and the finite batch add a few percent of spread.
      EXPECT_NEAR(measured, predicted, 0.08 * predicted)
          << "after " << l << " branches, scheme " << static_cast<int>(in_spec.scheme);
    }
  }
  EXPECT_LT(final_std[3], final_std[2]);  // GPT-2's scaling contains the growth
}

TEST(LayoutIndependence, ShardsAreSlicesOfTheFullTensor) {
  const InitSpec spec{Scheme::Gpt2, Activation::Linear, 0.02, 4, true};
  const auto full = init_weight("model.layers.0.mlp.down_proj.weight", 64, 96, spec, 42);
  for (int64_t dim : {0, 1}) {
    for (int64_t count : {1, 2, 4, 5, 8}) {  // 5: uneven parts (64 = 13 + 13 + 13 + 13 + 12)
      std::vector<torch::Tensor> parts;
      for (int64_t i = 0; i < count; ++i) {
        parts.push_back(init_weight_shard("model.layers.0.mlp.down_proj.weight", 64, 96, spec, 42,
                                          dim, i, count));
      }
      EXPECT_TENSOR_EQ(torch::cat(parts, dim), full);
    }
  }
  // Another name or seed gives other numbers; the same ones give the same numbers.
  EXPECT_FALSE(
      torch::equal(full, init_weight("model.layers.1.mlp.down_proj.weight", 64, 96, spec, 42)));
  EXPECT_FALSE(
      torch::equal(full, init_weight("model.layers.0.mlp.down_proj.weight", 64, 96, spec, 43)));
  EXPECT_THROW(init_weight_shard("w", 64, 96, spec, 42, 0, 5, 5), fivefold::Error);  // no part 5
}
