// Chapter 05: context-extension frequencies and temperatures against hand-computed values, the
// identities (factor 1 is plain RoPE), the rope_scaling keys and their errors, and the model.

#include <cmath>
#include <set>

#include "03_transformer/checkpoint.h"
#include "05_yarn/passkey.h"
#include "05_yarn/yarn.h"
#include "fivefold/io.h"
#include "fivefold/seed.h"
#include "testing.h"

using namespace fivefold::ch05;
using fivefold::ch04::rope_frequencies;
using fivefold::testing::ScratchDir;
using fivefold::testing::throws_error_containing;

namespace {
RopeScaling yarn(double factor, int64_t original = 4096) {
  return RopeScaling::from_json(
      {{"rope_type", "yarn"}, {"factor", factor}, {"original_max_position_embeddings", original}},
      original);
}
}  // namespace

TEST(Yarn, CorrectionRangeByHand) {
  // d = 64, base 10^4, L = 4096: pair i turns L / (2π·10^(8i/64)) times over the context.
  // 32 turns: i = 64·ln(4096 / (64π)) / (2·ln 10^4) = 10.47 -> floor 10;
  // 1 turn:   i = 64·ln(4096 / (2π)) / (2·ln 10^4)  = 22.51 -> ceil 23.
  const double lo = 64 * std::log(4096 / (32 * 2 * M_PI)) / (2 * std::log(1e4));
  const double hi = 64 * std::log(4096 / (2 * M_PI)) / (2 * std::log(1e4));
  EXPECT_NEAR(lo, 10.47, 0.01);
  EXPECT_NEAR(hi, 22.51, 0.01);
  EXPECT_EQ(yarn_correction_range(64, 1e4, 4096, 32, 1), std::make_pair(10.0, 23.0));
  // Clamped to [0, d − 1]: a tiny context puts both ends below pair 0.
  EXPECT_EQ(yarn_correction_range(64, 1e4, 8, 32, 1).first, 0.0);
}

TEST(Yarn, FrequenciesByHand) {
  const double s = 16;
  auto theta = rope_frequencies(64, 1e4);
  auto got = yarn_frequencies(64, 1e4, s, 4096, 32, 1);
  ASSERT_EQ(got.size(0), 32);
  for (int64_t i = 0; i < 32; ++i) {
    const double gamma = std::clamp((static_cast<double>(i) - 10.0) / 13.0, 0.0, 1.0);
    const double t = theta[i].item<double>();
    EXPECT_NEAR(got[i].item<double>(), t * (1 - gamma) + t / s * gamma, 1e-15) << "pair " << i;
  }
  EXPECT_EQ(got[3].item<double>(), theta[3].item<double>());        // fast: kept
  EXPECT_EQ(got[30].item<double>(), theta[30].item<double>() / s);  // slow: interpolated
}

TEST(Yarn, TemperatureByHand) {
  EXPECT_DOUBLE_EQ(yarn_get_mscale(1.0), 1.0);
  EXPECT_DOUBLE_EQ(yarn_get_mscale(0.5), 1.0);
  EXPECT_NEAR(yarn_get_mscale(16.0), 0.1 * std::log(16.0) + 1, 1e-15);  // 1.2773
  EXPECT_NEAR(attention_factor(yarn(16)), 1.27726, 1e-5);
  // DeepSeek-V3: factor 40, mscale = mscale_all_dim = 1: the factor on cos/sin cancels to 1 (its
  // temperature moves into the softmax scale instead, chapter 06).
  auto v3 = RopeScaling::from_json({{"type", "yarn"},
                                    {"factor", 40},
                                    {"original_max_position_embeddings", 4096},
                                    {"beta_fast", 32},
                                    {"beta_slow", 1},
                                    {"mscale", 1.0},
                                    {"mscale_all_dim", 1.0}},
                                   163840);
  EXPECT_DOUBLE_EQ(attention_factor(v3), 1.0);
  EXPECT_NEAR(std::pow(yarn_get_mscale(40, 1.0), 2), 1.8739, 1e-4);
  auto explicit_factor = yarn(4);
  explicit_factor.attention_factor = 0.9;
  EXPECT_DOUBLE_EQ(attention_factor(explicit_factor), 0.9);
  EXPECT_DOUBLE_EQ(
      attention_factor(RopeScaling::from_json({{"rope_type", "linear"}, {"factor", 4}}, 64)), 1.0);
}

TEST(Yarn, OtherScalingsByHand) {
  auto theta = rope_frequencies(16, 1e4);
  auto linear = RopeScaling::from_json({{"rope_type", "linear"}, {"factor", 4.0}}, 128);
  EXPECT_TENSOR_CLOSE(scaled_frequencies(linear, 16, 1e4, 0), theta / 4, 0.0, 1e-15);
  auto dynamic = RopeScaling::from_json({{"rope_type", "dynamic"}, {"factor", 2.0}}, 128);
  // Within the original context: plain RoPE. At n = 512: base·(2·512/128 − 1)^(16/14).
  EXPECT_TENSOR_EQ(scaled_frequencies(dynamic, 16, 1e4, 128), theta);
  EXPECT_TENSOR_CLOSE(scaled_frequencies(dynamic, 16, 1e4, 512),
                      rope_frequencies(16, 1e4 * std::pow(7.0, 16.0 / 14.0)), 0.0, 1e-13);
}

TEST(Yarn, FactorOneIsPlainRope) {
  auto theta = rope_frequencies(32, 1e4);
  for (const char* type : {"linear", "dynamic", "yarn"}) {
    auto s = RopeScaling::from_json({{"rope_type", type}, {"factor", 1.0}}, 256);
    EXPECT_TENSOR_EQ(scaled_frequencies(s, 32, 1e4, 256), theta);
    EXPECT_EQ(attention_factor(s), 1.0) << type;
  }
  // Dynamic scaling grows the base with the length itself: even at factor 1 it departs from
  // plain RoPE beyond the original context (base·(n/L)^(d/(d−2)), as Hugging Face computes it).
  auto dynamic = RopeScaling::from_json({{"rope_type", "dynamic"}, {"factor", 1.0}}, 256);
  EXPECT_TENSOR_CLOSE(scaled_frequencies(dynamic, 32, 1e4, 1024),
                      rope_frequencies(32, 1e4 * std::pow(4.0, 32.0 / 30.0)), 0.0, 1e-13);
  // And the models compute the same function, bit for bit.
  fivefold::ch03::ModelConfig c;
  c.vocab_size = 50;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 2;
  c.n_kv_heads = 2;
  c.d_ff = 48;
  c.rope_theta = 1e4;
  auto plain = fivefold::ch04::make_model(c);
  c.rope_scaling = {
      {"rope_type", "yarn"}, {"factor", 1.0}, {"original_max_position_embeddings", 64}};
  auto scaled = make_model(c);
  auto tokens = torch::randint(50, {2, 20}, fivefold::generator_for(5, "tokens"));
  torch::NoGradGuard no_grad;
  EXPECT_TENSOR_EQ(scaled(tokens), plain(tokens));
}

TEST(Yarn, RejectsBadScalingWithTheKeyNamed) {
  auto bad = [](nlohmann::json json, const std::string& fragment) {
    EXPECT_TRUE(throws_error_containing([&] { RopeScaling::from_json(json, 4096); }, fragment))
        << json.dump();
  };
  bad({{"rope_type", "longrope"}, {"factor", 4}}, "unknown rope_type 'longrope'");
  bad({{"rope_type", "yarn"}, {"factor", 0.5}}, "'factor' must be >= 1");
  bad({{"rope_type", "yarn"}, {"factor", "4"}}, "'factor' must be a number");
  bad({{"rope_type", "yarn"}}, "needs 'factor'");
  bad({{"factor", 4}}, "'rope_type' (or 'type') is required");
  bad({{"rope_type", "yarn"}, {"factor", 4}, {"beta_fast", 1}, {"beta_slow", 32}}, "beta_fast >");
  bad({{"rope_type", "yarn"}, {"factor", 4}, {"original_max_position_embeddings", -1}},
      "positive integer");
  EXPECT_EQ(RopeScaling::from_json(nullptr, 4096).type, "none");
  EXPECT_EQ(RopeScaling::from_json({{"rope_type", "default"}}, 4096).type, "none");
}

TEST(YarnModel, CheckpointRoundTripAndKVCache) {
  ScratchDir dir("yarn");
  fivefold::ch03::ModelConfig c;
  c.vocab_size = 50;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.d_ff = 48;
  c.rope_theta = 1e4;
  c.max_position_embeddings = 64;
  c.rope_scaling = yarn(4.0, 16).to_json();
  auto model = make_model(c);
  fivefold::ch03::save_model(dir.path("m"), model);
  const auto json = fivefold::io::read_json(dir.path("m") + "/config.json");
  EXPECT_EQ(json["rope_scaling"]["rope_type"], "yarn");
  EXPECT_EQ(json["rope_scaling"]["factor"], 4.0);
  EXPECT_EQ(json["rope_scaling"]["original_max_position_embeddings"], 16);
  EXPECT_EQ(json["max_position_embeddings"], 64);
  auto loaded = load_model(dir.path("m"));
  auto tokens = torch::randint(50, {1, 40}, fivefold::generator_for(5, "tokens"));
  torch::NoGradGuard no_grad;
  auto full = model(tokens);
  EXPECT_TENSOR_EQ(loaded(tokens), full);
  fivefold::ch03::KVCache cache;
  auto a = loaded->forward(tokens.narrow(1, 0, 25), &cache);
  auto b = loaded->forward(tokens.narrow(1, 25, 15), &cache);
  EXPECT_TENSOR_CLOSE(torch::cat({a, b}, 1), full, 1e-5, 1e-5);
  // Chapter 04's recipe refuses the scaled config instead of ignoring it.
  EXPECT_TRUE(
      throws_error_containing([&] { fivefold::ch04::load_model(dir.path("m")); }, "chapter 05"));
}

TEST(Passkey, RowsHideTheKeyAndScoreOnlyTheAnswer) {
  const int64_t length = 80;
  const auto b = passkey_batch(3, 0, 6, length);
  ASSERT_EQ(b.inputs.sizes(), (std::vector<int64_t>{6, length}));
  std::set<int64_t> key_places;
  for (int64_t r = 0; r < 6; ++r) {
    auto row = b.inputs[r];
    std::vector<int64_t> ids(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + length);
    ids.push_back(b.targets[r][length - 1].item<int64_t>());
    const std::string text = fivefold::ch03::ByteTokenizer::decode(ids);
    const auto question = text.rfind(" key? ");
    ASSERT_EQ(question, text.size() - 10) << text;
    const std::string key = text.substr(question + 6);
    const auto needle = text.find("key " + key + ". ");
    ASSERT_NE(needle, std::string::npos) << text;
    key_places.insert(static_cast<int64_t>(needle));
    // Only the four answer digits are scored.
    auto scored = (b.targets[r] != -100).nonzero().view({-1});
    EXPECT_TENSOR_EQ(scored, torch::arange(length - 4, length, torch::kLong));
  }
  EXPECT_GT(key_places.size(), 3u);  // the key moves from row to row
  EXPECT_TENSOR_EQ(passkey_batch(3, 0, 6, length).inputs, b.inputs);  // deterministic
  EXPECT_FALSE(torch::equal(passkey_batch(3, 1, 6, length).inputs, b.inputs));
}
