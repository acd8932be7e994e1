// Chapter 06: MLA. The absorbed inference path equals the training path; the latent cache holds
// exactly the formula's bytes; the softmax scale follows DeepSeek-V3 under YaRN; without
// compression MLA is chapter 03's multi-head attention; checkpoints carry DeepSeek-V3's names and
// keys; and a small MLA model learns.

#include "03_transformer/checkpoint.h"
#include "03_transformer/data.h"
#include "03_transformer/generate.h"
#include "03_transformer/train.h"
#include "05_yarn/yarn.h"
#include "06_mla/mla.h"
#include "fivefold/io.h"
#include "fivefold/seed.h"
#include "testing.h"

using namespace fivefold;
using namespace fivefold::ch06;
using fivefold::ch03::ModelConfig;
using fivefold::ch03::Transformer;
using fivefold::testing::ScratchDir;
using fivefold::testing::throws_error_containing;

namespace {
// A DeepSeek-V3 in miniature: query compression, a 16-wide latent, 8 rotary features.
ModelConfig tiny(bool q_lora = true) {
  ModelConfig c;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 4;
  c.d_ff = 64;
  c.rope_theta = 10000;
  c.extensions = {{"q_lora_rank", q_lora ? nlohmann::json(24) : nlohmann::json()},
                  {"kv_lora_rank", 16},
                  {"qk_nope_head_dim", 8},
                  {"qk_rope_head_dim", 8},
                  {"v_head_dim", 12}};
  return c;
}

// Weights large enough that attention is sharp (initialisation's 0.02 makes every score about 0
// and softmax nearly uniform, which would hide a wrong score): each matrix N(0, 2/fan_in), each
// norm weight 1 + N(0, 0.3²).
Transformer sharpened(Transformer model) {
  torch::NoGradGuard no_grad;
  auto g = generator_for(7, "sharpen");
  for (auto& p : model->parameters()) {
    if (p.dim() == 2) {
      p.copy_(torch::randn(p.sizes(), g) * std::sqrt(2.0 / static_cast<double>(p.size(1))));
    } else {
      p.copy_(1 + 0.3 * torch::randn(p.sizes(), g));
    }
  }
  return model;
}

MultiHeadLatentAttentionImpl& attention(Transformer& model, int64_t layer) {
  return *model->block(layer).self_attn->as<MultiHeadLatentAttentionImpl>();
}

torch::Tensor tokens(int64_t batch, int64_t seq, uint64_t seed = 1) {
  return torch::randint(0, 259, {batch, seq}, generator_for(seed, "tokens"));
}
}  // namespace

TEST(Mla, AbsorbedPathEqualsTrainingPath) {
  for (bool q_lora : {true, false}) {
    SCOPED_TRACE(q_lora ? "q_lora_rank 24" : "q_lora_rank null");
    Transformer model = sharpened(make_model(tiny(q_lora)));
    auto& mla = attention(model, 0);
    const auto x = torch::randn({2, 10, 32}, generator_for(2, "x"));
    ch03::LayerCache cache;
    torch::NoGradGuard no_grad;
    const auto positions = ch03::position_range(0, 10);
    EXPECT_TENSOR_CLOSE(mla.forward_absorbed(x, positions, cache), mla.forward_naive(x, positions),
                        1e-5, 1e-5);
    // The cache holds one [latent | rotary key] per position, nothing per head.
    EXPECT_EQ(cache.keys.sizes(), (std::vector<int64_t>{2, 1, 10, 16 + 8}));
    EXPECT_FALSE(cache.values.defined());
  }
}

TEST(Mla, IncrementalDecodingEqualsTheFullForward) {
  // The whole model: a prompt of 6, then 4 tokens one at a time through the latent cache, against
  // one forward of all 10 positions on the training path.
  Transformer model = sharpened(make_model(tiny()));
  const auto all = tokens(2, 10);
  torch::NoGradGuard no_grad;
  const auto full = model(all);
  ch03::KVCache cache;
  std::vector<torch::Tensor> parts{model(all.narrow(1, 0, 6), &cache)};
  for (int64_t t = 6; t < 10; ++t) parts.push_back(model(all.narrow(1, t, 1), &cache));
  EXPECT_TENSOR_CLOSE(torch::cat(parts, 1), full, 1e-5, 1e-5);
  EXPECT_EQ(cache.length(), 10);
}

TEST(Mla, CacheBytesPerTokenEqualTheFormula) {
  const auto config = tiny();
  Transformer model = make_model(config);
  const MlaConfig mla = MlaConfig::from_json(config.extensions);
  ch03::KVCache cache;
  torch::NoGradGuard no_grad;
  model(tokens(3, 7), &cache);
  // (d_c + d_h^R) fp32 numbers per token per layer: 3 rows x 7 tokens x 2 layers x 24 x 4 bytes.
  EXPECT_EQ(cache.bytes(), 3 * 7 * config.n_layers * kv_cache_elements_mla(mla) * 4);
  EXPECT_EQ(kv_cache_elements_mla(mla), 24);
  // Against chapter 03's cache of the same model shape with multi-head attention: 2·n_h·d_h.
  ModelConfig llama = config;
  llama.extensions = nullptr;
  llama.head_dim = mla.qk_nope_head_dim + mla.qk_rope_head_dim;
  Transformer mha = make_model(llama);
  ch03::KVCache mha_cache;
  mha(tokens(3, 7), &mha_cache);
  EXPECT_EQ(mha_cache.bytes(), 3 * 7 * config.n_layers * kv_cache_elements_gqa(4, 16) * 4);
}

TEST(Mla, CacheFormulaWithDeepSeekDimensions) {
  // DeepSeek-V3: 128 heads of 128 (+64 rotary), d_c = 512. Per token per layer, MHA keeps
  // 2·128·128 = 32,768 numbers and MLA 512 + 64 = 576: 56.9x fewer. DeepSeek-V2's Table 1
  // compares MLA to GQA with 2.25 groups' worth: (d_c + d_h^R) = 4.5·d_h = 576.
  MlaConfig v3;
  EXPECT_EQ(kv_cache_elements_mla(v3), 576);
  EXPECT_EQ(kv_cache_elements_gqa(128, 128), 32768);
  EXPECT_EQ(kv_cache_elements_gqa(1, 128), 256);  // MQA
  EXPECT_EQ(kv_cache_elements_mla(v3) * 2, 9 * v3.qk_nope_head_dim);
  // notes/06 §1: times V3's 61 layers and 2 bytes (bf16), per token and over 131,072 tokens.
  const int64_t layers = 61, bytes = 2, context = 131072;
  EXPECT_EQ(kv_cache_elements_mla(v3) * layers * bytes, 70272);  // 70.3 KB
  EXPECT_NEAR(static_cast<double>(kv_cache_elements_mla(v3) * layers * bytes * context), 9.2e9,
              0.05e9);
  EXPECT_NEAR(static_cast<double>(kv_cache_elements_gqa(128, 128) * layers * bytes * context),
              524e9, 0.5e9);
}

TEST(Mla, SoftmaxScaleUnderYarnIsDeepSeekV3s) {
  // DeepSeek-V3's rope_scaling: yarn, factor 40, mscale = mscale_all_dim = 1.
  auto config = tiny();
  config.extensions["qk_nope_head_dim"] = 128;
  config.extensions["qk_rope_head_dim"] = 64;
  config.max_position_embeddings = 163840;
  config.rope_scaling = {
      {"type", "yarn"},       {"factor", 40},   {"original_max_position_embeddings", 4096},
      {"beta_fast", 32},      {"beta_slow", 1}, {"mscale", 1.0},
      {"mscale_all_dim", 1.0}};
  const double m = 0.1 * std::log(40.0) + 1.0;  // 1.3689
  const double expected = m * m / std::sqrt(192.0);
  Transformer model = sharpened(make_model(config));
  EXPECT_NEAR(attention(model, 1).scale(), expected, 1e-12);
  // cos and sin keep factor mscale/mscale_all_dim = 1: the temperature is all in the softmax.
  EXPECT_DOUBLE_EQ(ch05::attention_factor(ch05::RopeScaling::from_json(config.rope_scaling, 0)),
                   1.0);
  // The scale is used: the absorbed and training paths agree under it.
  const auto x = torch::randn({1, 5, 32}, generator_for(3, "x"));
  ch03::LayerCache cache;
  torch::NoGradGuard no_grad;
  auto& mla = attention(model, 1);
  const auto positions = ch03::position_range(0, 5);
  const auto scaled = mla.forward_naive(x, positions);
  EXPECT_TENSOR_CLOSE(mla.forward_absorbed(x, positions, cache), scaled, 1e-5, 1e-5);
  config.rope_scaling = nullptr;
  Transformer plain = make_model(config);
  EXPECT_NEAR(attention(plain, 1).scale(), 1 / std::sqrt(192.0), 1e-12);
}

TEST(Mla, ParametersMatchTheFormula) {
  for (bool q_lora : {true, false}) {
    const auto config = tiny(q_lora);
    const MlaConfig m = MlaConfig::from_json(config.extensions);
    Transformer model = make_model(config);
    int64_t numel = 0;
    for (const auto& p : attention(model, 0).parameters()) numel += p.numel();
    const int64_t d = config.d_model, h = config.n_heads,
                  qk = m.qk_nope_head_dim + m.qk_rope_head_dim;
    const int64_t q =
        q_lora ? d * m.q_lora_rank + m.q_lora_rank + m.q_lora_rank * h * qk : d * h * qk;
    EXPECT_EQ(numel, q + d * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank +
                         m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) +
                         h * m.v_head_dim * d);
  }
}

TEST(Mla, TheDemoModelsCountsAreTheNotesWorkedExample) {
  // notes/06 §6: the demo's model (d 128, 4 layers, 4 heads of 32, MLA latent 32, rotary 16,
  // query latent 64) has 51,296 attention parameters a layer against MHA's 65,536, and 813,312
  // in all against chapter 03's 870,272 for the same model with multi-head attention.
  ModelConfig c;
  c.d_model = 128;
  c.n_layers = 4;
  c.n_heads = c.n_kv_heads = 4;
  c.d_ff = 352;
  c.rope_theta = 10000;
  const auto count = [](const torch::nn::Module& module) {
    int64_t numel = 0;
    for (const auto& p : module.parameters()) numel += p.numel();
    return numel;
  };
  const int64_t mha_total = count(*ch03::build_model(c));
  c.extensions = {{"q_lora_rank", 64},
                  {"kv_lora_rank", 32},
                  {"qk_nope_head_dim", 32},
                  {"qk_rope_head_dim", 16},
                  {"v_head_dim", 32}};
  Transformer model = make_model(c);
  EXPECT_EQ(count(attention(model, 0)), 51296);
  EXPECT_EQ(mha_total, 870272);
  EXPECT_EQ(count(*model), 813312);
  EXPECT_EQ(mha_total - count(*model), 4 * (65536 - 51296));
}

TEST(Mla, WithoutCompressionIsMultiHeadAttention) {
  // MLA must be chapter 03's multi-head attention when nothing is compressed or decoupled:
  // q_lora_rank null (W^Q directly), qk_rope_head_dim 0 (no rotary part), kv_lora_rank = d_model
  // with W^DKV = I, and W^UK, W^UV = chapter 03's W^K, W^V per head. The one difference left is
  // kv_a_layernorm, which is the identity on inputs of unit RMS, what a block's input norm hands
  // attention at initialisation (up to its eps, 1e-6: 5e-7 relative).
  ModelConfig c = tiny(false);
  c.rope_theta = 0;
  c.extensions = {{"q_lora_rank", nullptr},
                  {"kv_lora_rank", 32},
                  {"qk_nope_head_dim", 8},
                  {"qk_rope_head_dim", 0},
                  {"v_head_dim", 8}};
  ModelConfig llama = c;
  llama.extensions = nullptr;
  Transformer mha_model = sharpened(Transformer(llama));
  auto& mha = *mha_model->block(0).self_attn->as<ch03::AttentionImpl>();
  MultiHeadLatentAttention mla(c, MlaConfig::from_json(c.extensions));
  {
    torch::NoGradGuard no_grad;
    mla->q_proj->weight.copy_(mha.q_proj->weight);
    mla->kv_a_proj_with_mqa->weight.copy_(torch::eye(32));
    mla->kv_b_proj->weight.copy_(
        torch::cat({mha.k_proj->weight.view({4, 8, 32}), mha.v_proj->weight.view({4, 8, 32})}, 1)
            .view({64, 32}));
    mla->o_proj->weight.copy_(mha.o_proj->weight);
  }
  auto x = torch::randn({2, 9, 32}, generator_for(4, "x"), torch::kDouble);
  x = (x / x.pow(2).mean(-1, true).sqrt()).to(torch::kFloat);  // unit RMS per position
  torch::NoGradGuard no_grad;
  const auto positions = ch03::position_range(0, 9);
  EXPECT_TENSOR_CLOSE(mla->forward_naive(x, positions), mha.forward(x, positions), 1e-5, 1e-5);
}

TEST(Mla, CheckpointsCarryDeepSeekV3NamesAndKeys) {
  ScratchDir scratch("mla");
  const auto dir = scratch.path("checkpoint");
  Transformer model = sharpened(make_model(tiny()));
  ch03::save_model(dir, model);
  const auto json = io::read_json(dir + "/config.json");
  EXPECT_EQ(json["model_type"], "deepseek_v3");
  EXPECT_EQ(json["architectures"][0], "DeepseekV3ForCausalLM");
  EXPECT_EQ(json["kv_lora_rank"], 16);
  EXPECT_EQ(json["q_lora_rank"], 24);
  EXPECT_FALSE(json.contains("head_dim"));
  const auto tensors = io::load_safetensors(dir + "/model.safetensors");
  for (const char* name : {"q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa",
                           "kv_a_layernorm", "kv_b_proj", "o_proj"}) {
    const std::string key = std::string("model.layers.1.self_attn.") + name + ".weight";
    EXPECT_TRUE(tensors.count(key)) << key;
  }
  EXPECT_EQ(tensors.at("model.layers.0.self_attn.kv_a_proj_with_mqa.weight").sizes(),
            (std::vector<int64_t>{16 + 8, 32}));
  EXPECT_EQ(tensors.at("model.layers.0.self_attn.kv_b_proj.weight").sizes(),
            (std::vector<int64_t>{4 * (8 + 12), 16}));
  Transformer loaded = load_model(dir);
  const auto t = tokens(1, 8);
  torch::NoGradGuard no_grad;
  EXPECT_TENSOR_EQ(loaded(t), model(t));
  // Generation with the latent cache (what `fivefold generate` runs) picks the tokens that
  // recomputing the whole sequence on the training path picks.
  const std::vector<int64_t> prompt{72, 101, 108, 108, 111};
  ch03::SamplingOptions recompute;
  recompute.use_cache = false;
  EXPECT_EQ(ch03::generate(loaded, prompt, 12), ch03::generate(loaded, prompt, 12, recompute));
}

TEST(Mla, RefusesWhatItDoesNotBuild) {
  auto moe = tiny();
  moe.extensions["n_routed_experts"] = 8;
  EXPECT_TRUE(throws_error_containing([&] { make_model(moe); }, "chapter 07"));
  auto odd = tiny();
  odd.extensions["qk_rope_head_dim"] = 7;
  EXPECT_TRUE(throws_error_containing([&] { make_model(odd); }, "qk_rope_head_dim"));
  auto no_rope = tiny();
  no_rope.extensions["qk_rope_head_dim"] = 0;
  EXPECT_TRUE(throws_error_containing([&] { make_model(no_rope); }, "rope_theta"));
  // Earlier chapters' recipes refuse a DeepSeek config rather than build a Llama model from it.
  EXPECT_TRUE(throws_error_containing([&] { ch05::make_model(tiny()); }, "chapter 06"));
  EXPECT_TRUE(throws_error_containing([&] { ch03::build_model(tiny()); }, "chapter 06"));
  // config.json round trip: the DeepSeek keys survive, model_type decides.
  const auto back = ch03::config_from_json(ch03::config_to_json(tiny()));
  EXPECT_EQ(back.extensions, tiny().extensions);
}

TEST(Mla, SmallModelLearns) {
  // 60 steps on the synthetic corpus: held-out loss falls well below the start (5.6, ln 259).
  auto config = tiny();
  Transformer model = make_model(config);
  ch03::TrainConfig t;
  t.lr = 3e-3;
  t.warmup_steps = 5;
  t.total_steps = 60;
  auto optimizer = ch03::make_optimizer(model, t);
  const ch03::TokenDataset data(
      ch03::ByteTokenizer::encode(ch03::synthetic_corpus(0, ch03::Split::Train, 400)));
  const ch03::BatchSampler sampler(data, 32, 8, 0);
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    const auto r = ch03::train_step(model, *optimizer, t, {sampler.batch(step)}, step);
    if (step == 0) first = r.loss;
    last = r.loss;
  }
  EXPECT_GT(first, 5.0);
  EXPECT_LT(last, 3.5);
}
