// Chapter 05 plumbing: the rope_scaling keys, the other scalings, the attention factor, and the
// scaled rotation installed in the model.

#include <cmath>

#include "03_transformer/checkpoint.h"
#include "05_yarn/yarn.h"
#include "fivefold/error.h"

namespace fivefold::ch05 {

namespace {
double number(const nlohmann::json& json, const char* key, double fallback) {
  if (!json.contains(key) || json[key].is_null()) return fallback;
  FIVEFOLD_CHECK(json[key].is_number(), "rope_scaling: '", key, "' must be a number, got ",
                 json[key].dump());
  return json[key].get<double>();
}
}  // namespace

RopeScaling RopeScaling::from_json(const nlohmann::json& json, int64_t max_position_embeddings) {
  RopeScaling s;
  if (json.is_null()) return s;
  FIVEFOLD_CHECK(json.is_object(), "rope_scaling: expected an object or null");
  // Hugging Face's key is rope_type; older configs (DeepSeek-V3's among them) say type.
  const char* key = json.contains("rope_type") ? "rope_type" : "type";
  FIVEFOLD_CHECK(json.contains(key) && json[key].is_string(),
                 "rope_scaling: 'rope_type' (or 'type') is required");
  s.type = json[key].get<std::string>();
  if (s.type == "default") s.type = "none";
  FIVEFOLD_CHECK(s.type == "none" || s.type == "linear" || s.type == "dynamic" || s.type == "yarn",
                 "rope_scaling: unknown rope_type '", s.type,
                 "' (known: default, linear, dynamic, yarn)");
  if (s.type == "none") return s;
  FIVEFOLD_CHECK(json.contains("factor"), "rope_scaling: '", s.type, "' needs 'factor'");
  s.factor = number(json, "factor", 1.0);
  FIVEFOLD_CHECK(s.factor >= 1.0, "rope_scaling: 'factor' must be >= 1 (the new context over the ",
                 "original), got ", s.factor);
  s.original_max_positions = max_position_embeddings;
  if (json.contains("original_max_position_embeddings")) {
    FIVEFOLD_CHECK(json["original_max_position_embeddings"].is_number_integer() &&
                       json["original_max_position_embeddings"].get<int64_t>() > 0,
                   "rope_scaling: 'original_max_position_embeddings' must be a positive integer");
    s.original_max_positions = json["original_max_position_embeddings"];
  }
  s.beta_fast = number(json, "beta_fast", 32.0);
  s.beta_slow = number(json, "beta_slow", 1.0);
  s.mscale = number(json, "mscale", 0.0);
  s.mscale_all_dim = number(json, "mscale_all_dim", 0.0);
  s.attention_factor = number(json, "attention_factor", 0.0);
  FIVEFOLD_CHECK(s.beta_fast > s.beta_slow && s.beta_slow > 0,
                 "rope_scaling: need beta_fast > beta_slow > 0, got ", s.beta_fast, " and ",
                 s.beta_slow);
  FIVEFOLD_CHECK(s.mscale >= 0 && s.mscale_all_dim >= 0 && s.attention_factor >= 0,
                 "rope_scaling: mscale, mscale_all_dim and attention_factor must be >= 0");
  return s;
}

nlohmann::json RopeScaling::to_json() const {
  if (type == "none") return nullptr;
  nlohmann::json json = {{"rope_type", type},
                         {"factor", factor},
                         {"original_max_position_embeddings", original_max_positions}};
  if (type == "yarn") {
    json["beta_fast"] = beta_fast;
    json["beta_slow"] = beta_slow;
    if (mscale > 0) json["mscale"] = mscale;
    if (mscale_all_dim > 0) json["mscale_all_dim"] = mscale_all_dim;
    if (attention_factor > 0) json["attention_factor"] = attention_factor;
  }
  return json;
}

double yarn_get_mscale(double scale, double m) {
  return scale <= 1.0 ? 1.0 : 0.1 * m * std::log(scale) + 1.0;
}

double attention_factor(const RopeScaling& s) {
  if (s.type != "yarn") return 1.0;
  if (s.attention_factor > 0) return s.attention_factor;
  if (s.mscale > 0 && s.mscale_all_dim > 0)
    return yarn_get_mscale(s.factor, s.mscale) / yarn_get_mscale(s.factor, s.mscale_all_dim);
  return yarn_get_mscale(s.factor);
}

std::pair<double, double> yarn_correction_range(int64_t head_dim, double base,
                                                int64_t original_max_positions, double beta_fast,
                                                double beta_slow) {
  // The pair index whose wavelength fits `turns` times into the original context:
  // L / (2π·base^(2i/d)) = turns  <=>  i = d·ln(L / (2π·turns)) / (2·ln base).
  auto pair_turning = [&](double turns) {
    return static_cast<double>(head_dim) *
           std::log(static_cast<double>(original_max_positions) / (turns * 2.0 * M_PI)) /
           (2.0 * std::log(base));
  };
  const double low = std::floor(pair_turning(beta_fast));
  const double high = std::ceil(pair_turning(beta_slow));
  return {std::max(low, 0.0), std::min(high, static_cast<double>(head_dim - 1))};
}

torch::Tensor scaled_frequencies(const RopeScaling& s, int64_t head_dim, double base,
                                 int64_t sequence_length) {
  if (s.type == "linear") return ch04::rope_frequencies(head_dim, base) / s.factor;
  if (s.type == "yarn")
    return yarn_frequencies(head_dim, base, s.factor, s.original_max_positions, s.beta_fast,
                            s.beta_slow);
  if (s.type == "dynamic" && sequence_length > s.original_max_positions) {
    // NTK-aware: a larger base stretches the slow pairs most and leaves pair 0 as it was.
    const double d = static_cast<double>(head_dim);
    const double n = static_cast<double>(sequence_length);
    const double L = static_cast<double>(s.original_max_positions);
    return ch04::rope_frequencies(
        head_dim, base * std::pow(s.factor * n / L - (s.factor - 1.0), d / (d - 2.0)));
  }
  return ch04::rope_frequencies(head_dim, base);  // none, or dynamic within the original context
}

ScaledRotaryEmbedding::ScaledRotaryEmbedding(int64_t head_dim, double base, RopeScaling scaling,
                                             ch04::RopeLayout layout)
    : head_dim_(head_dim),
      base_(base),
      scaling_(std::move(scaling)),
      layout_(layout),
      attention_factor_(attention_factor(scaling_)),
      frequencies_(scaled_frequencies(scaling_, head_dim, base, 0)) {}

std::pair<torch::Tensor, torch::Tensor> ScaledRotaryEmbedding::encode(
    const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& positions) const {
  // Dynamic scaling follows the length covered so far (as Hugging Face does; keys cached at a
  // shorter length keep their older rotation).
  const auto frequencies =
      scaling_.type == "dynamic"
          ? scaled_frequencies(scaling_, head_dim_, base_, positions.max().item<int64_t>() + 1)
          : frequencies_;
  auto [cos, sin] = ch04::rope_angles(frequencies, positions);  // [seq, d/2]
  cos = cos * attention_factor_;  // YaRN's temperature, folded into both q and k
  sin = sin * attention_factor_;
  return {ch04::apply_rope(q, cos, sin, layout_), ch04::apply_rope(k, cos, sin, layout_)};
}

ch03::ModelRecipe recipe(const ch03::ModelConfig& config) {
  config.validate();  // the config first: its errors name the config, not a module
  FIVEFOLD_CHECK(config.extensions.is_null(),
                 "config: a deepseek_v3 model (MLA, MoE) needs chapter 06's make_model");
  const RopeScaling scaling =
      RopeScaling::from_json(config.rope_scaling, config.max_position_embeddings);
  if (scaling.type == "none") {  // chapter 04's model (it accepts no rope_scaling entry)
    ch03::ModelConfig plain = config;
    plain.rope_scaling = nullptr;
    return ch04::recipe(plain);
  }
  FIVEFOLD_CHECK(config.rope_theta > 0,
                 "config: 'rope_scaling' needs rotary positions (rope_theta)");
  ch03::ModelRecipe r;
  r.position_encoding = std::make_shared<ScaledRotaryEmbedding>(config.resolved_head_dim(),
                                                                config.rope_theta, scaling);
  return r;
}

ch03::Transformer make_model(const ch03::ModelConfig& config, const ch03::ModelPart& part) {
  return ch03::Transformer(config, recipe(config), part);
}

ch03::Transformer load_model(const std::string& dir) { return ch03::load_model(dir, make_model); }

}  // namespace fivefold::ch05
