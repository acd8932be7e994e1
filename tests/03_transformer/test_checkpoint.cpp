// Chapter 03 checkpoints: round trip, a folder written by "another implementation" (Hugging Face
// keys, bfloat16 weights, tied head), and every kind of bad folder rejected with a clear error,
// leaving the files as they were.

#include <filesystem>
#include <fstream>

#include "03_transformer/checkpoint.h"
#include "fivefold/error.h"
#include "fivefold/io.h"
#include "testing.h"

namespace fs = std::filesystem;
using namespace fivefold::ch03;

namespace {
class Checkpoints : public ::testing::Test {
 protected:
  std::string dir(const std::string& name) const { return scratch_.path(name); }
  fivefold::testing::ScratchDir scratch_{"ckpt"};
};

ModelConfig small() {
  ModelConfig c;
  c.vocab_size = 61;
  c.d_model = 16;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.d_ff = 40;
  c.seed = 3;
  return c;
}

void expect_same_parameters(Transformer& a, Transformer& b) {
  const auto pa = a->named_parameters(), pb = b->named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& item : pa) EXPECT_TENSOR_EQ(pb[item.key()], item.value());
}

void expect_error(const std::function<void()>& f, const std::string& fragment) {
  EXPECT_TRUE(fivefold::testing::throws_error_containing(f, fragment));
}
}  // namespace

TEST_F(Checkpoints, RoundTrip) {
  Transformer model(small());
  save_model(dir("a"), model);
  EXPECT_TRUE(fs::exists(dir("a") + "/config.json"));
  EXPECT_TRUE(fs::exists(dir("a") + "/model.safetensors"));
  Transformer loaded = load_model(dir("a"));
  EXPECT_EQ(loaded->config().n_kv_heads, 2);
  EXPECT_EQ(loaded->config().head_dim, 4);
  expect_same_parameters(model, loaded);
  // Saving again over the folder replaces it whole and leaves no temporary files.
  auto c = small();
  c.seed = 4;
  Transformer other(c);
  save_model(dir("a"), other);
  Transformer reloaded = load_model(dir("a"));
  expect_same_parameters(other, reloaded);
  for (const auto& entry : fs::directory_iterator(dir("a"))) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos) << entry.path();
  }
}

TEST_F(Checkpoints, LoadsAFolderWrittenElsewhere) {
  // As transformers would write a tiny tied Llama in bfloat16: HF keys, no lm_head tensor.
  auto c = small();
  c.tied_embeddings = true;
  Transformer reference(c);
  fs::create_directories(dir("hf"));
  fivefold::io::TensorMap tensors;
  for (const auto& item : reference->named_parameters())
    tensors[item.key()] = item.value().to(torch::kBFloat16);
  fivefold::io::save_safetensors(dir("hf") + "/model.safetensors", tensors, {{"format", "pt"}});
  std::ofstream(dir("hf") + "/config.json") << R"({"architectures": ["LlamaForCausalLM"],
    "model_type": "llama", "vocab_size": 61, "hidden_size": 16, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 40,
    "hidden_act": "silu", "tie_word_embeddings": true, "rms_norm_eps": 1e-06, "bos_token_id": 1,
    "torch_dtype": "bfloat16", "rope_theta": 10000.0, "max_position_embeddings": 128})";
  Transformer loaded = load_model(dir("hf"));
  EXPECT_TRUE(loaded->config().tied_embeddings);
  EXPECT_DOUBLE_EQ(loaded->config().rms_norm_eps, 1e-6);
  for (const auto& item : reference->named_parameters()) {
    EXPECT_TENSOR_EQ(loaded->named_parameters()[item.key()],
                     item.value().to(torch::kBFloat16).to(torch::kFloat));
  }
}

TEST_F(Checkpoints, BadFoldersAreClearErrorsAndStayUntouched) {
  Transformer model(small());
  save_model(dir("good"), model);
  const std::string weights = fivefold::io::read_file(dir("good") + "/model.safetensors");
  const std::string config = fivefold::io::read_file(dir("good") + "/config.json");

  expect_error([&] { load_model(dir("absent")); }, "is not a folder");
  fs::create_directories(dir("no_config"));
  fs::copy(dir("good") + "/model.safetensors", dir("no_config"));
  expect_error([&] { load_model(dir("no_config")); }, "config.json");

  auto rewrite = [&](const std::string& name,
                     const std::function<void(nlohmann::json&, fivefold::io::TensorMap&)>& edit) {
    fs::create_directories(dir(name));
    auto json = nlohmann::json::parse(config);
    auto tensors = fivefold::io::parse_safetensors(weights, "good");
    edit(json, tensors);
    fivefold::io::write_json(dir(name) + "/config.json", json);
    fivefold::io::save_safetensors(dir(name) + "/model.safetensors", tensors);
  };
  rewrite("missing", [](auto&, auto& t) { t.erase("model.layers.1.mlp.up_proj.weight"); });
  expect_error([&] { load_model(dir("missing")); },
               "'model.layers.1.mlp.up_proj.weight' is missing");
  rewrite("shape",
          [](auto& j, auto&) { j["intermediate_size"] = 48; });  // config no longer matches
  expect_error([&] { load_model(dir("shape")); }, "implies");
  rewrite("extra",
          [](auto&, auto& t) { t["model.layers.9.mlp.up_proj.weight"] = torch::zeros({1}); });
  expect_error([&] { load_model(dir("extra")); },
               "unexpected tensor 'model.layers.9.mlp.up_proj.weight'");
  rewrite("experts", [](auto& j, auto&) { j["num_local_experts"] = 8; });
  expect_error([&] { load_model(dir("experts")); }, "'num_local_experts'");
  rewrite("heads", [](auto& j, auto&) { j["num_key_value_heads"] = 3; });
  expect_error([&] { load_model(dir("heads")); }, "n_kv_heads (3)");

  fs::create_directories(dir("corrupt"));
  fs::copy(dir("good") + "/config.json", dir("corrupt"));
  std::ofstream(dir("corrupt") + "/model.safetensors", std::ios::binary)
      << weights.substr(0, weights.size() / 2);
  expect_error([&] { load_model(dir("corrupt")); }, "model.safetensors");

  // Failed loads changed nothing on disk.
  EXPECT_EQ(fivefold::io::read_file(dir("good") + "/model.safetensors"), weights);
  EXPECT_EQ(fivefold::io::read_file(dir("good") + "/config.json"), config);
}

TEST_F(Checkpoints, WeightsThatAreNotFiniteAreRefused) {
  Transformer model(small());
  {
    torch::NoGradGuard no_grad;
    model->named_parameters()["model.norm.weight"][3] = NAN;
  }
  save_model(dir("nan"), model);
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [&] { load_model(dir("nan")); }, "'model.norm.weight' holds NaN or infinite values"));
}

TEST(ConfigKeys, AnAbsentRopeThetaIsHuggingFacesDefault) {
  // transformers' LlamaConfig: rope_theta = 10000 when absent; fivefold writes it always (0: a
  // model without positions).
  auto json = config_to_json(ModelConfig{});
  EXPECT_EQ(json.at("rope_theta").get<double>(), 0.0);
  json.erase("rope_theta");
  EXPECT_EQ(config_from_json(json).rope_theta, 10000.0);
  // So an odd head_dim is refused from a config file as from the flags: rotary pairs need it even.
  json["head_dim"] = 7;
  json["hidden_size"] = 28;
  EXPECT_TRUE(fivefold::testing::throws_error_containing([&] { config_from_json(json).validate(); },
                                                         "even head_dim"));
}
