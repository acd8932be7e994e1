// Chapter 02 plumbing: shapes from Hugging Face configs, parameter counts, the 6N rule, budgets,
// and the figures `fivefold plan` prints.

#include <cmath>

#include "02_flops_6np/flops.h"
#include "fivefold/error.h"

namespace fivefold::ch02 {

void TransformerShape::validate() const {
  FIVEFOLD_CHECK(vocab_size > 0, "vocab_size must be positive, got ", vocab_size);
  FIVEFOLD_CHECK(d_model > 0, "d_model (hidden_size) must be positive, got ", d_model);
  FIVEFOLD_CHECK(n_layers > 0, "n_layers must be positive, got ", n_layers);
  FIVEFOLD_CHECK(n_heads > 0, "n_heads must be positive, got ", n_heads);
  FIVEFOLD_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "n_kv_heads (", n_kv_heads,
                 ") must be positive and divide n_heads (", n_heads, ")");
  FIVEFOLD_CHECK(head_dim > 0, "head_dim must be positive, got ", head_dim);
  FIVEFOLD_CHECK(d_ff > 0, "d_ff (intermediate_size) must be positive, got ", d_ff);
  FIVEFOLD_CHECK(learned_positions >= 0, "learned_positions must be >= 0");
}

ParameterCount count_parameters(const TransformerShape& s) {
  s.validate();
  const int64_t d = s.d_model, q = s.n_heads * s.head_dim, kv = s.n_kv_heads * s.head_dim;
  const int64_t bias = s.biases ? 1 : 0;
  const int64_t norm = s.layer_norm ? 2 * d : d;  // LayerNorm has a weight and a bias
  ParameterCount p;
  p.embedding = s.vocab_size * d + s.learned_positions * d;
  p.attention = s.n_layers * (d * (q + 2 * kv) + q * d + bias * (q + 2 * kv + d));
  const int64_t matrices = s.gated_mlp ? 3 : 2;
  p.mlp = s.n_layers * (matrices * d * s.d_ff + bias * ((matrices - 1) * s.d_ff + d));
  p.norms = (2 * s.n_layers + 1) * norm;
  p.lm_head = s.tied_embeddings ? 0 : s.vocab_size * d;
  p.total = p.embedding + p.attention + p.mlp + p.norms + p.lm_head;
  p.matmul_weights =
      s.n_layers * (d * (q + 2 * kv) + q * d + matrices * d * s.d_ff) + s.vocab_size * d;
  return p;
}

double six_n_flops_per_token(const TransformerShape& s) {
  return 6.0 * static_cast<double>(count_parameters(s).matmul_weights);
}

ComputeOptimal chinchilla_optimal(double budget_flops) {
  FIVEFOLD_CHECK(budget_flops > 0, "the FLOP budget must be positive, got ", budget_flops);
  // C = 6 N D with D = 20 N  =>  C = 120 N²  (Hoffmann et al. 2022, Table 3: ~20 tokens/parameter).
  const double n = std::sqrt(budget_flops / 120.0);
  return {n, 20.0 * n};
}

double model_flops_utilization(double tokens_per_second, double flops_per_token,
                               double peak_flops) {
  FIVEFOLD_CHECK(peak_flops > 0, "peak FLOP/s must be positive");
  return tokens_per_second * flops_per_token / peak_flops;
}

namespace {

int64_t positive_int(const nlohmann::json& config, const char* key) {
  FIVEFOLD_CHECK(config.contains(key), "config: missing '", key, "'");
  const auto& value = config[key];
  FIVEFOLD_CHECK(value.is_number_integer() && value.get<int64_t>() > 0, "config: '", key,
                 "' must be a positive integer, got ", value.dump());
  return value.get<int64_t>();
}

int64_t positive_int_or(const nlohmann::json& config, const char* key, int64_t fallback) {
  if (!config.contains(key) || config[key].is_null()) return fallback;
  return positive_int(config, key);
}

bool flag_or(const nlohmann::json& config, const char* key, bool fallback) {
  if (!config.contains(key) || config[key].is_null()) return fallback;
  FIVEFOLD_CHECK(config[key].is_boolean(), "config: '", key, "' must be true or false, got ",
                 config[key].dump());
  return config[key].get<bool>();
}

// Keys that change the architecture in ways these chapters do not build (yet).
void reject_unsupported(const nlohmann::json& config) {
  const char* never_null[] = {"n_routed_experts",      "num_local_experts", "num_experts",
                              "moe_intermediate_size", "n_shared_experts",  "q_lora_rank",
                              "kv_lora_rank",          "sliding_window"};
  for (const char* key : never_null) {
    FIVEFOLD_CHECK(!config.contains(key) || config[key].is_null(), "config: '", key,
                   "' changes the architecture in a way fivefold does not build yet");
  }
  for (const char* key :
       {"attention_bias", "mlp_bias", "use_sliding_window", "add_cross_attention"}) {
    FIVEFOLD_CHECK(!flag_or(config, key, false), "config: '", key,
                   "' = true changes the architecture in a way fivefold does not build yet");
  }
}

}  // namespace

TransformerShape shape_from_hf_config(const nlohmann::json& config) {
  FIVEFOLD_CHECK(config.is_object(), "config: expected a JSON object");
  std::string type;
  if (config.contains("model_type")) {
    FIVEFOLD_CHECK(config["model_type"].is_string(), "config: 'model_type' must be a string");
    type = config["model_type"];
  } else {
    type = config.contains("n_embd") ? "gpt2" : "llama";  // infer from the key family
  }
  reject_unsupported(config);
  TransformerShape s;
  if (type == "gpt2") {
    s.d_model = positive_int(config, "n_embd");
    s.n_layers = positive_int(config, "n_layer");
    s.n_heads = positive_int(config, "n_head");
    s.n_kv_heads = s.n_heads;
    FIVEFOLD_CHECK(s.d_model % s.n_heads == 0, "config: n_embd (", s.d_model,
                   ") is not divisible by n_head (", s.n_heads, ")");
    s.head_dim = s.d_model / s.n_heads;
    s.d_ff = positive_int_or(config, "n_inner", 4 * s.d_model);
    s.vocab_size = positive_int(config, "vocab_size");
    s.learned_positions = positive_int(config, "n_positions");
    s.gated_mlp = false;
    s.biases = true;
    s.layer_norm = true;
    s.tied_embeddings = flag_or(config, "tie_word_embeddings", true);
  } else if (type == "llama") {
    s.d_model = positive_int(config, "hidden_size");
    s.n_layers = positive_int(config, "num_hidden_layers");
    s.n_heads = positive_int(config, "num_attention_heads");
    s.n_kv_heads = positive_int_or(config, "num_key_value_heads", s.n_heads);
    if (!config.contains("head_dim") || config["head_dim"].is_null()) {
      FIVEFOLD_CHECK(s.d_model % s.n_heads == 0, "config: hidden_size (", s.d_model,
                     ") is not divisible by num_attention_heads (", s.n_heads, ")");
    }
    s.head_dim = positive_int_or(config, "head_dim", s.d_model / s.n_heads);
    s.d_ff = positive_int(config, "intermediate_size");
    s.vocab_size = positive_int(config, "vocab_size");
    if (config.contains("hidden_act")) {
      FIVEFOLD_CHECK(config["hidden_act"] == "silu", "config: 'hidden_act' ",
                     config["hidden_act"].dump(), " is not supported (SwiGLU needs silu)");
    }
    s.gated_mlp = true;
    s.tied_embeddings = flag_or(config, "tie_word_embeddings", false);
  } else {
    throw Error("config: model_type '" + type + "' is not supported yet (supported: llama, gpt2)");
  }
  s.validate();
  return s;
}

nlohmann::json plan(const TransformerShape& s, int64_t context, double tokens, double budget,
                    double peak_flops, double mfu, int64_t devices) {
  FIVEFOLD_CHECK(context > 0, "plan: the context length must be positive, got ", context);
  FIVEFOLD_CHECK(tokens >= 0 && budget >= 0, "plan: tokens and budget must be >= 0");
  const ParameterCount p = count_parameters(s);
  const FlopBreakdown f = forward_flops_per_token(s, context);
  const double training = training_flops_per_token(s, context);
  const double six_n = six_n_flops_per_token(s);
  nlohmann::json out;
  out["parameters"] = {{"total", p.total},
                       {"embedding", p.embedding},
                       {"non_embedding", p.non_embedding()},
                       {"attention", p.attention},
                       {"mlp", p.mlp},
                       {"norms", p.norms},
                       {"lm_head", p.lm_head},
                       {"matmul_weights", p.matmul_weights},
                       {"active", p.total}};
  out["context"] = context;
  out["flops_per_token"] = {{"forward", f.total()},
                            {"training", training},
                            {"six_n", six_n},
                            {"training_over_six_n", training / six_n},
                            {"forward_components",
                             {{"qkv", f.qkv},
                              {"attention_scores", f.attention_scores},
                              {"attention_values", f.attention_values},
                              {"output_projection", f.output_projection},
                              {"mlp", f.mlp},
                              {"lm_head", f.lm_head}}}};
  // fp32 training with Adam, nothing sharded: weights 4 + gradients 4 + two moments 8 bytes.
  const double params = static_cast<double>(p.total);
  out["memory_per_device_bytes"] = {{"weights", 4 * params},
                                    {"gradients", 4 * params},
                                    {"adam_moments", 8 * params},
                                    {"total_without_activations", 16 * params}};
  if (tokens > 0) {
    FIVEFOLD_CHECK(peak_flops > 0 && mfu > 0 && mfu <= 1 && devices > 0,
                   "plan: need peak FLOP/s > 0, 0 < MFU <= 1 and devices > 0 to estimate time");
    const double total = tokens * training;
    const double seconds = total / (static_cast<double>(devices) * peak_flops * mfu);
    out["training"] = {{"tokens", tokens},
                       {"flops", total},
                       {"flops_six_n", tokens * six_n},
                       {"devices", devices},
                       {"peak_flops_per_device", peak_flops},
                       {"mfu", mfu},
                       {"seconds", seconds},
                       {"days", seconds / 86400}};
  }
  if (budget > 0) {
    const ComputeOptimal optimal = chinchilla_optimal(budget);
    out["budget"] = {{"flops", budget},
                     {"chinchilla_parameters", optimal.parameters},
                     {"chinchilla_tokens", optimal.tokens},
                     {"tokens_for_this_model", budget / training}};
  }
  return out;
}

}  // namespace fivefold::ch02
