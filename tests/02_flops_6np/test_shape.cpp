// Chapter 02 plumbing: parameter counts against numel of a built model and against published
// totals, Hugging Face config parsing and its errors, compute-optimal budgets.

#include <cmath>

#include "fivefold/error.h"
#include "fivefold/memory.h"
#include "fivefold/seed.h"
#include "shapes.h"
#include "testing.h"

using namespace fivefold::ch02;

TEST(ParameterCount, EqualsNumelOfTheBuiltModel) {
  for (const auto& shape : ch02_test::small_shapes()) {
    int64_t numel = 0;
    for (const auto& [name, tensor] : make_weights(shape, 0)) numel += tensor.numel();
    EXPECT_EQ(count_parameters(shape).total, numel) << "d_model " << shape.d_model;
  }
}

TEST(ParameterCount, PublishedModels) {
  // Llama-2-7B: 6,738,415,616 parameters; GPT-2 small: 124,439,808 (both as their checkpoints
  // hold).
  EXPECT_EQ(count_parameters(shape_from_hf_config(ch02_test::llama2_7b())).total, 6738415616);
  EXPECT_EQ(count_parameters(shape_from_hf_config(ch02_test::gpt2_small())).total, 124439808);
  // GPT-3 175B (Brown et al. 2020, Table 2.1: 96 layers, d 12288, 96 heads, context 2048,
  // GPT-2's architecture and vocabulary): Table D.1 gives 174.6B.
  TransformerShape gpt3{50257, 12288, 96, 96, 96, 128, 4 * 12288, false, true, true, 2048, true};
  EXPECT_NEAR(count_parameters(gpt3).total / 1e9, 174.6, 0.1);
}

TEST(HfConfig, ReadsLlamaAndGpt2Keys) {
  const auto llama = shape_from_hf_config(ch02_test::llama2_7b());
  EXPECT_EQ(llama.d_model, 4096);
  EXPECT_EQ(llama.n_kv_heads, 32);
  EXPECT_EQ(llama.head_dim, 128);
  EXPECT_TRUE(llama.gated_mlp);
  EXPECT_FALSE(llama.tied_embeddings);
  const auto gpt2 = shape_from_hf_config(ch02_test::gpt2_small());
  EXPECT_EQ(gpt2.d_ff, 3072);  // n_inner absent: 4 * n_embd
  EXPECT_TRUE(gpt2.tied_embeddings);
  EXPECT_TRUE(gpt2.layer_norm);
  EXPECT_EQ(gpt2.learned_positions, 1024);
  auto gqa = ch02_test::llama2_7b();
  gqa["num_key_value_heads"] = 8;
  gqa["head_dim"] = 64;
  EXPECT_EQ(shape_from_hf_config(gqa).n_kv_heads, 8);
  EXPECT_EQ(shape_from_hf_config(gqa).head_dim, 64);
}

TEST(HfConfig, BadConfigsNameTheKey) {
  auto expect_error = [](nlohmann::json config, const std::string& fragment) {
    EXPECT_TRUE(fivefold::testing::throws_error_containing([&] { shape_from_hf_config(config); },
                                                           fragment));
  };
  auto missing = ch02_test::llama2_7b();
  missing.erase("intermediate_size");
  expect_error(missing, "'intermediate_size'");
  auto not_int = ch02_test::llama2_7b();
  not_int["hidden_size"] = "4096";
  expect_error(not_int, "'hidden_size' must be a positive integer");
  auto indivisible = ch02_test::llama2_7b();
  indivisible["num_key_value_heads"] = 5;
  expect_error(indivisible, "n_kv_heads (5)");
  auto heads = ch02_test::llama2_7b();
  heads["num_attention_heads"] = 30;
  expect_error(heads, "not divisible by num_attention_heads");
  auto moe = ch02_test::llama2_7b();
  moe["num_local_experts"] = 8;
  expect_error(moe, "'num_local_experts'");
  auto mla = ch02_test::llama2_7b();
  mla["kv_lora_rank"] = 512;
  expect_error(mla, "'kv_lora_rank'");
  auto bias = ch02_test::llama2_7b();
  bias["attention_bias"] = true;
  expect_error(bias, "'attention_bias'");
  auto act = ch02_test::llama2_7b();
  act["hidden_act"] = "gelu";
  expect_error(act, "'hidden_act'");
  auto type = ch02_test::llama2_7b();
  type["model_type"] = "deepseek_v3";
  expect_error(type, "model_type 'deepseek_v3'");
  expect_error(nlohmann::json::array(), "JSON object");
  // Keys that do not change the architecture are ignored, null ones too.
  auto informational = ch02_test::llama2_7b();
  informational["sliding_window"] = nullptr;
  informational["some_future_key"] = 3;
  EXPECT_NO_THROW(shape_from_hf_config(informational));
}

TEST(Budget, ChinchillaTable3) {
  // Hoffmann et al. 2022, Table 3 (approach 1): FLOPs -> (parameters, tokens).
  struct Row {
    double flops, parameters, tokens;
  };
  for (const Row& row :
       {Row{1.21e20, 1e9, 20.2e9}, Row{1.23e22, 10e9, 205.1e9}, Row{5.76e23, 67e9, 1.5e12}}) {
    const auto optimal = chinchilla_optimal(row.flops);
    EXPECT_NEAR(optimal.parameters / row.parameters, 1.0, 0.05) << row.flops;
    // The table rounds its tokens: for the 67B row 6·N·D = 6.03e23, not 5.76e23. 10% covers it.
    EXPECT_NEAR(optimal.tokens / row.tokens, 1.0, 0.10) << row.flops;
    // C = 6ND holds within the table's rounding (~5%).
    EXPECT_NEAR(6 * row.parameters * row.tokens / row.flops, 1.0, 0.05);
  }
  EXPECT_THROW(chinchilla_optimal(0), fivefold::Error);
}

TEST(Budget, Gpt3TrainingCompute) {
  // Brown et al. 2020, Table D.1: 174.6B parameters x 300B tokens -> 3.14e23 FLOPs (6ND).
  EXPECT_NEAR(6 * 174.6e9 * 300e9 / 3.14e23, 1.0, 0.005);
}

TEST(Utilization, Definition) {
  // 1000 tokens/s at 6e9 FLOPs/token on a 1e13 FLOP/s device: 60% MFU.
  EXPECT_DOUBLE_EQ(model_flops_utilization(1000, 6e9, 1e13), 0.6);
  EXPECT_THROW(model_flops_utilization(1, 1, 0), fivefold::Error);
}

TEST(Model, RejectsBadTokens) {
  const auto gpt2 = ch02_test::small_shapes().back();
  const auto weights = make_weights(gpt2, 0);
  EXPECT_THROW(forward(gpt2, weights, torch::zeros({1, gpt2.learned_positions + 1}, torch::kLong)),
               fivefold::Error);
  EXPECT_THROW(forward(gpt2, weights, torch::zeros({4}, torch::kLong)), fivefold::Error);
}

TEST(ActivationMemory, MlpKeepsOneOutputPerLayer) {
  // y = relu(x W^T) per layer: mm keeps its input (the previous ReLU output, already counted),
  // ReLU keeps its own output. So backward holds exactly one [batch, width] tensor per layer.
  const int64_t batch = 16;
  std::vector<torch::Tensor> weights = {torch::randn({40, 24}).requires_grad_(true),
                                        torch::randn({40, 40}).requires_grad_(true),
                                        torch::randn({8, 40}).requires_grad_(true)};
  auto x = torch::randn({batch, 24});
  fivefold::MemoryTracker tracker;
  auto y = x;
  for (const auto& w : weights) y = torch::relu(torch::linear(y, w));
  EXPECT_EQ(tracker.current_bytes(), 4 * batch * (40 + 40 + 8));
}

namespace {
// Activation bytes of one layer: the difference between 2-layer and 1-layer models.
int64_t per_layer_bytes(TransformerShape shape, int64_t batch, int64_t seq) {
  auto tokens =
      torch::randint(shape.vocab_size, {batch, seq}, fivefold::generator_for(1, "tokens"));
  shape.n_layers = 1;
  const int64_t one = measure_activation_bytes(shape, make_weights(shape, 0), tokens);
  shape.n_layers = 2;
  return measure_activation_bytes(shape, make_weights(shape, 0), tokens) - one;
}
}  // namespace

TEST(ActivationMemory, TransformerLayerIsLinearInTokensPlusOneScoreMatrix) {
  for (const auto& shape : ch02_test::small_shapes()) {
    for (int64_t batch : {1, 2}) {
      // P(s) = a·s + c + b·s²: the second difference over s = 8, 16, 24 isolates b.
      const int64_t p8 = per_layer_bytes(shape, batch, 8), p16 = per_layer_bytes(shape, batch, 16),
                    p24 = per_layer_bytes(shape, batch, 24),
                    p32 = per_layer_bytes(shape, batch, 32);
      const int64_t quadratic = (p24 - 2 * p16 + p8) / (2 * 8 * 8);
      EXPECT_EQ(p24 - 2 * p16 + p8, p32 - 2 * p24 + p16) << "not quadratic in seq";
      // Exactly one fp32 [batch, heads, seq, seq] tensor: the softmax output.
      EXPECT_EQ(quadratic, 4 * batch * shape.n_heads) << "d_model " << shape.d_model;
      if (batch == 2) {
        EXPECT_EQ(per_layer_bytes(shape, 2, 16) - per_layer_bytes(shape, 1, 16),
                  per_layer_bytes(shape, 1, 16) - (shape.n_kv_heads < shape.n_heads ? 64 : 0))
            << "not linear in batch";
      }
    }
  }
}
