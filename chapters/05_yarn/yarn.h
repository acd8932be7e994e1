#pragma once
/// @file yarn.h
/// @brief Chapter 05: extending a RoPE model's context beyond the length it was trained at.
/// Position Interpolation (rope_type "linear"), NTK-aware base scaling (static, and "dynamic" as
/// Hugging Face computes it), and YaRN ("yarn": NTK-by-parts frequencies plus an attention
/// temperature), configured with Hugging Face's `rope_scaling` keys.

#include <torch/torch.h>

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>

#include "03_transformer/model.h"
#include "04_rope/rope.h"

namespace fivefold::ch05 {

/// A `rope_scaling` entry of config.json, validated.
struct RopeScaling {
  std::string type = "none";           ///< none, linear, dynamic or yarn ([rope_type] or [type])
  double factor = 1.0;                 ///< [factor] s = new context / original context, >= 1
  int64_t original_max_positions = 0;  ///< [original_max_position_embeddings] L
  double beta_fast = 32;        ///< [beta_fast] yarn: pairs turning >= this often over L keep θ
  double beta_slow = 1;         ///< [beta_slow] yarn: pairs turning <= this often are interpolated
  double mscale = 0;            ///< [mscale] yarn: 0 when absent
  double mscale_all_dim = 0;    ///< [mscale_all_dim] yarn: 0 when absent
  double attention_factor = 0;  ///< [attention_factor] yarn: explicit; 0: computed

  /// Reads `rope_scaling` (null: type "none"); `max_position_embeddings` is L when the entry has
  /// no original_max_position_embeddings. Throws fivefold::Error for an unknown type, a factor
  /// below 1, or a value of the wrong kind, naming the key.
  static RopeScaling from_json(const nlohmann::json& rope_scaling, int64_t max_position_embeddings);
  /// The entry as config.json writes it (null for "none").
  nlohmann::json to_json() const;
};

/// 0.1·m·ln(s) + 1 for s > 1, else 1 (YaRN's attention temperature, √(1/t) in the paper).
double yarn_get_mscale(double scale, double m = 1.0);

/// The factor cos and sin are multiplied by: explicit attention_factor; else, with mscale and
/// mscale_all_dim, get_mscale(s, mscale) / get_mscale(s, mscale_all_dim); else get_mscale(s).
/// 1 for every type but yarn.
double attention_factor(const RopeScaling& scaling);

/// The pair indices (low, high) between which YaRN's ramp runs: the pair that turns beta_fast
/// times over the original context, floored, and the one that turns beta_slow times, ceiled,
/// clamped to [0, d − 1]: d·ln(L / (2π·n)) / (2·ln base) for n = beta_fast, beta_slow.
std::pair<double, double> yarn_correction_range(int64_t head_dim, double base,
                                                int64_t original_max_positions, double beta_fast,
                                                double beta_slow);

/// YaRN's frequencies, float64 [d/2]: with θ_i = base^(−2i/d) and the ramp
/// γ_i = clamp((i − low) / (high − low), 0, 1) between yarn_correction_range's pair indices,
/// θ'_i = θ_i/s · γ_i + θ_i · (1 − γ_i) = θ_i·(1 − γ_i·(1 − 1/s)), exactly θ_i when s = 1:
/// pairs below `low` (fast, many turns over L) keep θ_i,
/// pairs above `high` (slow) are interpolated by s, those between are blended.
/// **Exercise** (README, "The exercise").
torch::Tensor yarn_frequencies(int64_t head_dim, double base, double factor,
                               int64_t original_max_positions, double beta_fast, double beta_slow);

/// The frequencies of any scaling, float64 [d/2]. `sequence_length` (positions covered so far)
/// matters only for "dynamic", whose base grows once it exceeds the original context:
/// base·(s·n/L − (s − 1))^(d/(d−2)).
torch::Tensor scaled_frequencies(const RopeScaling& scaling, int64_t head_dim, double base,
                                 int64_t sequence_length);

/// RoPE with context extension, as chapter 03's position encoding: chapter 04's rotation with the
/// scaled frequencies, cos and sin multiplied by the attention factor.
class ScaledRotaryEmbedding : public ch03::PositionEncoding {
 public:
  /// Throws fivefold::Error for an odd head_dim. `layout`: which features pair up (DeepSeek's
  /// MLA rotates interleaved pairs, chapter 06).
  ScaledRotaryEmbedding(int64_t head_dim, double base, RopeScaling scaling,
                        ch04::RopeLayout layout = ch04::RopeLayout::HalfSplit);
  /// q, k [batch, heads, seq, head_dim] at `positions` (int64 [seq]) -> rotated (q, k).
  std::pair<torch::Tensor, torch::Tensor> encode(const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& positions) const override;

 private:
  int64_t head_dim_;
  double base_;
  RopeScaling scaling_;
  ch04::RopeLayout layout_;
  double attention_factor_;
  torch::Tensor frequencies_;  // for every type but dynamic
};

/// Chapter 05's recipe: chapter 04's, with the scaled rotation when config.rope_scaling is set (its
/// type not "none").
ch03::ModelRecipe recipe(const ch03::ModelConfig& config);

/// The model (or `part` of it) from recipe(config); a ch03::ModelBuilder.
ch03::Transformer make_model(const ch03::ModelConfig& config, const ch03::ModelPart& part = {});

/// ch03::load_model with this chapter's make_model.
ch03::Transformer load_model(const std::string& dir);

}  // namespace fivefold::ch05
