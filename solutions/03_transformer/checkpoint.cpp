// Chapter 03 checkpoints: config.json + model.safetensors, Hugging Face's layout.

#include "03_transformer/checkpoint.h"

#include <filesystem>
#include <set>

#include "fivefold/adamw_state.h"
#include "fivefold/error.h"
#include "fivefold/io.h"

namespace fs = std::filesystem;

namespace fivefold::ch03 {

nlohmann::json config_to_json(const ModelConfig& c) {
  nlohmann::json json = {{"architectures", {"LlamaForCausalLM"}},
                         {"model_type", "llama"},
                         {"vocab_size", c.vocab_size},
                         {"hidden_size", c.d_model},
                         {"num_hidden_layers", c.n_layers},
                         {"num_attention_heads", c.n_heads},
                         {"num_key_value_heads", c.n_kv_heads},
                         {"head_dim", c.resolved_head_dim()},
                         {"intermediate_size", c.d_ff},
                         {"hidden_act", "silu"},
                         {"tie_word_embeddings", c.tied_embeddings},
                         {"rms_norm_eps", c.rms_norm_eps},
                         {"attention_bias", false},
                         {"mlp_bias", false},
                         {"torch_dtype", "float32"},
                         {"fivefold_seed", c.seed}};
  // Always written: absent means transformers' default, 10000. A model without positions
  // (chapter 03's, rope_theta 0) is one transformers cannot express; 0 makes it fail loudly there
  // rather than load as another function.
  json["rope_theta"] = c.rope_theta;
  json["max_position_embeddings"] = c.max_position_embeddings;
  if (!c.rope_scaling.is_null()) json["rope_scaling"] = c.rope_scaling;
  if (!c.extensions.is_null()) {  // a later chapter's architecture: DeepSeek-V3's names
    json["architectures"] = {"DeepseekV3ForCausalLM"};
    json["model_type"] = "deepseek_v3";
    json.erase("head_dim");  // transformers derives it from qk_rope_head_dim for this type
    json.update(c.extensions);
  }
  return json;
}

namespace {
// DeepSeek-V3's config.json keys that chapters 06 (MLA) and 07 (MoE) interpret.
const char* const kDeepSeekKeys[] = {
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "rope_interleave", "n_routed_experts", "num_experts_per_tok", "n_shared_experts",
    "moe_intermediate_size", "scoring_func", "norm_topk_prob", "routed_scaling_factor", "n_group",
    "topk_group", "topk_method", "first_k_dense_replace", "moe_layer_freq", "aux_loss_alpha",
    "seq_aux",
    // fivefold's own training settings for chapter 07 (transformers ignores unknown keys)
    "fivefold_bias_update_speed", "fivefold_capacity_factor"};
}  // namespace

ModelConfig config_from_json(const nlohmann::json& original) {
  // A DeepSeek-V3 config: its own keys go to `extensions`, the rest reads as Llama's.
  nlohmann::json json = original, extensions;
  if (json.is_object() && json.value("model_type", "") == "deepseek_v3") {
    for (const char* key : kDeepSeekKeys) {
      if (!json.contains(key)) continue;
      extensions[key] = json[key];
      json.erase(key);
    }
    json["model_type"] = "llama";
    json.erase("head_dim");
    FIVEFOLD_CHECK(extensions.contains("kv_lora_rank"),
                   "config: a deepseek_v3 config needs 'kv_lora_rank'");
  }
  const ch02::TransformerShape shape = ch02::shape_from_hf_config(json);  // validates the keys
  FIVEFOLD_CHECK(!shape.layer_norm && shape.gated_mlp, "config: model_type must be llama here");
  ModelConfig c;
  c.vocab_size = shape.vocab_size;
  c.d_model = shape.d_model;
  c.n_layers = shape.n_layers;
  c.n_heads = shape.n_heads;
  c.n_kv_heads = shape.n_kv_heads;
  c.head_dim = shape.head_dim;
  c.d_ff = shape.d_ff;
  c.tied_embeddings = shape.tied_embeddings;
  if (json.contains("rms_norm_eps")) {
    FIVEFOLD_CHECK(json["rms_norm_eps"].is_number() && json["rms_norm_eps"].get<double>() > 0,
                   "config: 'rms_norm_eps' must be a positive number");
    c.rms_norm_eps = json["rms_norm_eps"];
  }
  // Absent: Hugging Face's default for Llama and DeepSeek-V3, 10000 (rotary positions).
  c.rope_theta = 10000.0;
  if (json.contains("rope_theta") && !json["rope_theta"].is_null()) {
    FIVEFOLD_CHECK(json["rope_theta"].is_number() && json["rope_theta"].get<double>() >= 0,
                   "config: 'rope_theta' must be a number >= 0 (0: no positions)");
    c.rope_theta = json["rope_theta"];
  }
  if (json.contains("max_position_embeddings")) {
    FIVEFOLD_CHECK(json["max_position_embeddings"].is_number_integer() &&
                       json["max_position_embeddings"].get<int64_t>() > 0,
                   "config: 'max_position_embeddings' must be a positive integer");
    c.max_position_embeddings = json["max_position_embeddings"];
  }
  if (json.contains("rope_scaling")) {
    FIVEFOLD_CHECK(json["rope_scaling"].is_null() || json["rope_scaling"].is_object(),
                   "config: 'rope_scaling' must be an object or null");
    c.rope_scaling = json["rope_scaling"];  // chapter 05 reads it
  }
  if (json.contains("fivefold_seed") && json["fivefold_seed"].is_number_unsigned())
    c.seed = json["fivefold_seed"];
  c.extensions = extensions;
  c.validate();
  return c;
}

void save_model(const std::string& dir, Transformer& model) {
  std::filesystem::create_directories(dir);
  io::TensorMap tensors;
  for (const auto& item : model->named_parameters()) tensors[item.key()] = item.value().detach();
  // Weights first, config last: a folder with a new config.json always has matching weights.
  io::save_safetensors(dir + "/model.safetensors", tensors, {{"format", "pt"}});
  io::write_json(dir + "/config.json", config_to_json(model->config()));
}

Transformer load_model(const std::string& dir, const ModelBuilder& build, const ModelPart& part) {
  FIVEFOLD_CHECK(std::filesystem::is_directory(dir), "checkpoint '", dir, "' is not a folder");
  ModelConfig config;
  try {
    config = config_from_json(io::read_json(dir + "/config.json"));
  } catch (const Error& e) {
    throw Error("checkpoint '" + dir + "': " + e.what());
  }
  const io::TensorMap tensors = io::load_safetensors(dir + "/model.safetensors");
  Transformer model = build ? build(config, part) : build_model(config, part);
  torch::NoGradGuard no_grad;
  std::set<std::string> expected;
  for (auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    expected.insert(name);
    auto found = tensors.find(name);
    FIVEFOLD_CHECK(found != tensors.end(), "checkpoint '", dir, "': tensor '", name,
                   "' is missing");
    const torch::Tensor& t = found->second;
    FIVEFOLD_CHECK(t.sizes() == item.value().sizes(), "checkpoint '", dir, "': tensor '", name,
                   "' has shape ", t.sizes(), " but config.json implies ", item.value().sizes());
    FIVEFOLD_CHECK(t.is_floating_point(), "checkpoint '", dir, "': tensor '", name,
                   "' is not floating point (", t.scalar_type(), ")");
    FIVEFOLD_CHECK(torch::isfinite(t).all().item<bool>(), "checkpoint '", dir, "': tensor '", name,
                   "' holds NaN or infinite values (a diverged run?)");
    item.value().copy_(t);
  }
  // The whole model must use every tensor; a part reads its own and leaves the others.
  if (part.whole(config.n_layers)) {
    for (const auto& [name, tensor] : tensors) {
      FIVEFOLD_CHECK(expected.count(name), "checkpoint '", dir, "': unexpected tensor '", name,
                     "' (a different architecture?)");
    }
  }
  return model;
}

void save_optimizer(const std::string& path, Transformer& model, torch::optim::AdamW& optimizer) {
  io::save_safetensors(path, adamw::state_by_name(adamw::parameters_by_name(*model), optimizer),
                       {{"format", "fivefold-adamw"}});
}

void load_optimizer(const std::string& path, Transformer& model, torch::optim::AdamW& optimizer) {
  adamw::load_state(io::load_safetensors(path), path, adamw::parameters_by_name(*model), optimizer);
}

}  // namespace fivefold::ch03
