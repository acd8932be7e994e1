#pragma once
/// @file checkpoint.h
/// @brief Model checkpoints as Hugging Face lays them out: a folder with `config.json`
/// (LlamaForCausalLM keys) and `model.safetensors` (the model's own parameter names, float32).
/// Such a folder loads in `transformers`; a Llama-style folder with those names loads here.

#include <nlohmann/json.hpp>
#include <string>

#include "03_transformer/model.h"
#include "03_transformer/train.h"

namespace fivefold::ch03 {

/// The config.json keys of `config` (architectures, model_type "llama", hidden_size, ...); with
/// extensions, model_type "deepseek_v3" and their keys.
nlohmann::json config_to_json(const ModelConfig& config);

/// A ModelConfig from config.json keys. Keys for architectures these chapters do not build yet are
/// refused by name (chapter 02's reader); informational keys are ignored. For model_type
/// "deepseek_v3" the MLA and MoE keys are kept in `extensions` for chapters 06 and 07.
ModelConfig config_from_json(const nlohmann::json& json);

/// Writes `dir`/config.json and `dir`/model.safetensors (creating `dir`), each file atomically: an
/// existing checkpoint is replaced whole or left as it was.
void save_model(const std::string& dir, Transformer& model);

/// Reads a checkpoint folder into a model (or `part` of it) made by `build` (default:
/// build_model, this chapter's). Every parameter the part holds must be present with its shape
/// (F32, F16 or BF16, converted to float32); a missing, misshaped tensor, a missing file or a
/// corrupt one is a fivefold::Error naming the folder and the problem. The whole model must also
/// use every tensor of the file (an unexpected one is an error); a part reads only its own.
Transformer load_model(const std::string& dir, const ModelBuilder& build = {},
                       const ModelPart& part = {});

/// Writes AdamW's state (by parameter name: fivefold/adamw_state.h) atomically to `path`, a
/// safetensors file.
void save_optimizer(const std::string& path, Transformer& model, torch::optim::AdamW& optimizer);

/// Restores the state written by save_optimizer (adamw::load_state).
void load_optimizer(const std::string& path, Transformer& model, torch::optim::AdamW& optimizer);

}  // namespace fivefold::ch03
