#pragma once
/// @file mla.h
/// @brief Chapter 06: Multi-head Latent Attention (DeepSeek-V2 §2.1, as in DeepSeek-V3). Keys and
/// values are up-projected from one small latent per position, c_KV = norm(W^DKV·h), so a cache
/// needs only c_KV and one rotary key shared by all heads: (d_c + d_h^R) numbers per token per
/// layer instead of 2·n_h·d_h. Positions live in a separate, decoupled part of queries and keys;
/// the rest carries no rotation, which lets inference fold W^UK into the queries and attend over
/// the latent directly (weight absorption). Hugging Face's DeepseekV3 names and config keys.

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "03_transformer/model.h"

namespace fivefold::ch06 {

/// MLA's dimensions: DeepSeek-V3's config.json keys (kept in ch03::ModelConfig::extensions).
/// Defaults are Hugging Face's DeepseekV3Config defaults (DeepSeek-V3's own values).
struct MlaConfig {
  int64_t q_lora_rank = 1536;      ///< [q_lora_rank] d_c' of the query latent; 0 (null): q_proj
  int64_t kv_lora_rank = 512;      ///< [kv_lora_rank] d_c, the cached latent
  int64_t qk_nope_head_dim = 128;  ///< [qk_nope_head_dim] d_h, per head, no rotation
  int64_t qk_rope_head_dim = 64;   ///< [qk_rope_head_dim] d_h^R, rotated, key shared by all heads
  int64_t v_head_dim = 128;        ///< [v_head_dim] values per head
  bool rope_interleave = true;     ///< [rope_interleave] rotate adjacent pairs (DeepSeek's order)

  /// Reads the keys from `extensions`, Hugging Face's defaults for absent ones. Throws
  /// fivefold::Error naming a key of the wrong kind or an odd qk_rope_head_dim.
  static MlaConfig from_json(const nlohmann::json& extensions);
  /// The keys as config.json writes them (q_lora_rank 0 as null).
  nlohmann::json to_json() const;
};

/// Cache elements per token per layer (DeepSeek-V2, Table 1): multi-head attention keeps a key
/// and a value per head, 2·n_h·d_h; grouped-query 2·n_g·d_h; multi-query 2·d_h.
int64_t kv_cache_elements_gqa(int64_t kv_heads, int64_t head_dim);
/// MLA keeps the latent and the shared rotary key: d_c + d_h^R.
int64_t kv_cache_elements_mla(const MlaConfig& mla);

/// The softmax scale: 1/√(qk_nope_head_dim + qk_rope_head_dim), times mscale² when the model's
/// rope_scaling is yarn with mscale_all_dim (mscale = 0.1·mscale_all_dim·ln(factor) + 1), as
/// DeepSeek-V3 computes it.
double softmax_scale(const ch03::ModelConfig& model, const MlaConfig& mla);

/// Multi-head Latent Attention in chapter 03's attention slot. Parameters (Hugging Face names):
/// q_proj, or q_a_proj → q_a_layernorm → q_b_proj; kv_a_proj_with_mqa (output [latent | rotary
/// key]); kv_a_layernorm; kv_b_proj (output per head [k_nope | v]); o_proj.
class MultiHeadLatentAttentionImpl : public ch03::AttentionLayer {
 public:
  /// Sizes from the model (d_model, n_heads, rms eps, rope_scaling) and `mla`.
  MultiHeadLatentAttentionImpl(const ch03::ModelConfig& model, const MlaConfig& mla);

  /// Without a cache: forward_naive (training). With one: forward_absorbed (inference).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions,
                        ch03::LayerCache* cache = nullptr) override;

  /// The training path, x [batch, seq, d_model] at `positions` (int64 [seq]) -> [batch, seq,
  /// d_model]: keys
  /// and values up-projected from the latent for every head, the decoupled rotary key repeated
  /// for every head, causal attention with softmax_scale(), o_proj.
  /// **Exercise** (README, "The exercise").
  torch::Tensor forward_naive(const torch::Tensor& x, const torch::Tensor& positions);

  /// The inference path: W^UK folded into the queries and W^UV applied after attention, so
  /// attention runs over the latent itself: multi-query attention whose one key per position is
  /// [c_KV | k^R] (d_c + d_h^R wide) and whose value is c_KV. `cache.keys` keeps exactly that,
  /// [batch, 1, length, d_c + d_h^R]; x's `positions` follow the cached ones.
  torch::Tensor forward_absorbed(const torch::Tensor& x, const torch::Tensor& positions,
                                 ch03::LayerCache& cache);

  /// Queries before rotation, [batch, n_heads, seq, qk_nope_head_dim + qk_rope_head_dim].
  torch::Tensor queries(const torch::Tensor& x);
  /// This layer's softmax scale (softmax_scale of its configs).
  double scale() const { return scale_; }
  /// The MLA dimensions.
  const MlaConfig& mla() const { return mla_; }

  ch03::Linear q_proj{nullptr};          ///< d_model -> n_h·(d_h + d_h^R), when q_lora_rank is 0
  ch03::Linear q_a_proj{nullptr};        ///< d_model -> q_lora_rank (W^DQ)
  ch03::RMSNorm q_a_layernorm{nullptr};  ///< on the query latent (eps 1e-6)
  ch03::Linear q_b_proj{nullptr};        ///< q_lora_rank -> n_h·(d_h + d_h^R) (W^UQ, W^QR)
  ch03::Linear kv_a_proj_with_mqa{nullptr};  ///< d_model -> d_c + d_h^R (W^DKV, W^KR)
  ch03::RMSNorm kv_a_layernorm{nullptr};     ///< on the latent c_KV (eps 1e-6)
  ch03::Linear kv_b_proj{nullptr};           ///< d_c -> n_h·(d_h + v_head_dim) (W^UK, W^UV)
  ch03::Linear o_proj{nullptr};              ///< n_h·v_head_dim -> d_model

 private:
  /// The attention kernel (chapter 03's slot) with this layer's scale; queries at `positions`,
  /// keys at key_positions(positions, cached).
  torch::Tensor attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                       const torch::Tensor& positions, int64_t cached);

  int64_t n_heads_;
  MlaConfig mla_;
  double scale_;
};
TORCH_MODULE(MultiHeadLatentAttention);

/// Chapter 06's recipe: for a config with extensions (model_type deepseek_v3), MLA (from
/// config.extensions) in every block, with RoPE (chapter 05's scaling when rope_scaling is set) on
/// the qk_rope_head_dim features, interleaved as rope_interleave says; any other config gets
/// chapter 05's recipe.
ch03::ModelRecipe recipe(const ch03::ModelConfig& config);

/// The model (or `part` of it) from recipe(config); MoE keys are refused (chapter 07's make_model
/// builds those). A ch03::ModelBuilder.
ch03::Transformer make_model(const ch03::ModelConfig& config, const ch03::ModelPart& part = {});

/// ch03::load_model with this chapter's make_model.
ch03::Transformer load_model(const std::string& dir);

}  // namespace fivefold::ch06
