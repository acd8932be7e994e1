#pragma once
/// @file checkpoint.h
/// @brief Model checkpoints as Hugging Face lays them out: a folder with `config.json`
/// (LlamaForCausalLM keys) and `model.safetensors` (the model's own parameter names, float32).
/// Such a folder loads in `transformers`; a Llama-style folder with those names loads here.

#include <nlohmann/json.hpp>
#include <string>

#include "03_transformer/model.h"

namespace fivefold::ch03 {

/// The config.json keys of `config` (architectures, model_type "llama", hidden_size, ...).
nlohmann::json config_to_json(const ModelConfig& config);

/// A ModelConfig from config.json keys. Keys for architectures these chapters do not build yet are
/// refused by name (chapter 02's reader); informational keys are ignored.
ModelConfig config_from_json(const nlohmann::json& json);

/// Writes `dir`/config.json and `dir`/model.safetensors (creating `dir`), each file atomically: an
/// existing checkpoint is replaced whole or left as it was.
void save_model(const std::string& dir, Transformer& model);

/// Reads a checkpoint folder. Every parameter must be present with its shape (F32, F16 or BF16,
/// converted to float32); a missing, misshaped or unexpected tensor, a missing file or a corrupt
/// one is a fivefold::Error naming the folder and the problem.
Transformer load_model(const std::string& dir);

}  // namespace fivefold::ch03
