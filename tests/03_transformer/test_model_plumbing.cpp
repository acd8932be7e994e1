// Chapter 03's model plumbing (no exercise needed): Hugging Face parameter names, parameter count,
// seeded layout-independent initialisation, and configuration errors.

#include "01_weight_init/weight_init.h"
#include "03_transformer/model.h"
#include "fivefold/error.h"
#include "testing.h"

using namespace fivefold::ch03;

TEST(TransformerPlumbing, HuggingFaceNamesAndShapes) {
  ModelConfig c;
  c.vocab_size = 50;
  c.d_model = 16;
  c.n_layers = 1;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.d_ff = 24;
  Transformer model(c);
  std::map<std::string, std::vector<int64_t>> shapes;
  for (const auto& item : model->named_parameters())
    shapes[item.key()] = item.value().sizes().vec();
  const std::map<std::string, std::vector<int64_t>> expected = {
      {"model.embed_tokens.weight", {50, 16}},
      {"model.layers.0.input_layernorm.weight", {16}},
      {"model.layers.0.self_attn.q_proj.weight", {16, 16}},
      {"model.layers.0.self_attn.k_proj.weight", {8, 16}},
      {"model.layers.0.self_attn.v_proj.weight", {8, 16}},
      {"model.layers.0.self_attn.o_proj.weight", {16, 16}},
      {"model.layers.0.post_attention_layernorm.weight", {16}},
      {"model.layers.0.mlp.gate_proj.weight", {24, 16}},
      {"model.layers.0.mlp.up_proj.weight", {24, 16}},
      {"model.layers.0.mlp.down_proj.weight", {16, 24}},
      {"model.norm.weight", {16}},
      {"lm_head.weight", {50, 16}},
  };
  EXPECT_EQ(shapes, expected);
  int64_t numel = 0;
  for (const auto& p : model->parameters()) numel += p.numel();
  EXPECT_EQ(numel, fivefold::ch02::count_parameters(c.shape()).total);
  c.tied_embeddings = true;
  EXPECT_EQ(Transformer(c)->named_parameters().contains("lm_head.weight"), false);
}

TEST(TransformerPlumbing, InitialisationIsChapter01sPerNameDraw) {
  ModelConfig c;
  c.n_layers = 3;
  c.seed = 11;
  Transformer model(c);
  const auto params = model->named_parameters();
  using namespace fivefold::ch01;
  const InitSpec plain{Scheme::Gpt2, Activation::Linear, 0.02, 3};
  InitSpec residual = plain;
  residual.residual_projection = true;
  EXPECT_TENSOR_EQ(params["model.layers.1.self_attn.q_proj.weight"],
                   init_weight("model.layers.1.self_attn.q_proj.weight", 128, 128, plain, 11));
  EXPECT_TENSOR_EQ(params["model.layers.2.mlp.down_proj.weight"],
                   init_weight("model.layers.2.mlp.down_proj.weight", 128, 352, residual, 11));
  EXPECT_TENSOR_EQ(params["model.norm.weight"], torch::ones({128}));
  // Same seed, same model; another seed, another.
  c.seed = 11;
  EXPECT_TENSOR_EQ(Transformer(c)->named_parameters()["lm_head.weight"], params["lm_head.weight"]);
  c.seed = 12;
  EXPECT_FALSE(
      torch::equal(Transformer(c)->named_parameters()["lm_head.weight"], params["lm_head.weight"]));
}

TEST(TransformerPlumbing, BadConfigsAreClearErrors) {
  auto expect_error = [](ModelConfig c, const std::string& fragment) {
    EXPECT_TRUE(
        fivefold::testing::throws_error_containing([&] { Transformer model(c); }, fragment));
  };
  ModelConfig heads;
  heads.n_heads = 3;  // 128 is not divisible by 3
  heads.n_kv_heads = 3;
  expect_error(heads, "does not divide d_model");
  ModelConfig kv;
  kv.n_kv_heads = 3;
  expect_error(kv, "must divide n_heads");
  ModelConfig zero;
  zero.n_layers = 0;
  expect_error(zero, "must be positive");
  ModelConfig explicit_head_dim = heads;
  explicit_head_dim.head_dim = 40;  // allowed when given explicitly
  EXPECT_NO_THROW(Transformer{explicit_head_dim});
  Transformer model{ModelConfig{}};
  EXPECT_THROW(model(torch::zeros({4}, torch::kLong)), fivefold::Error);
  EXPECT_THROW(model(torch::zeros({1, 4}, torch::kInt)), fivefold::Error);
}
