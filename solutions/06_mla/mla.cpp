// Chapter 06 plumbing: MLA's config, its cache formulas, the module around forward_naive, the
// absorbed inference path, and the model recipe.

#include <cmath>
#include <tuple>

#include "03_transformer/checkpoint.h"
#include "04_rope/rope.h"
#include "05_yarn/yarn.h"
#include "06_mla/mla.h"
#include "fivefold/error.h"

namespace fivefold::ch06 {

namespace {
int64_t integer_or(const nlohmann::json& json, const char* key, int64_t fallback,
                   bool may_be_zero) {
  if (!json.contains(key) || json[key].is_null()) return fallback;
  FIVEFOLD_CHECK(json[key].is_number_integer() && json[key].get<int64_t>() >= (may_be_zero ? 0 : 1),
                 "config: '", key, "' must be a ", may_be_zero ? "non-negative" : "positive",
                 " integer, got ", json[key].dump());
  return json[key].get<int64_t>();
}

}  // namespace

MlaConfig MlaConfig::from_json(const nlohmann::json& e) {
  FIVEFOLD_CHECK(e.is_object(), "config: MLA needs the deepseek_v3 keys (kv_lora_rank, ...)");
  MlaConfig m;
  // null means "no query compression" (Hugging Face's q_lora_rank: null).
  m.q_lora_rank = e.contains("q_lora_rank") && e["q_lora_rank"].is_null()
                      ? 0
                      : integer_or(e, "q_lora_rank", m.q_lora_rank, true);
  m.kv_lora_rank = integer_or(e, "kv_lora_rank", m.kv_lora_rank, false);
  m.qk_nope_head_dim = integer_or(e, "qk_nope_head_dim", m.qk_nope_head_dim, false);
  m.qk_rope_head_dim = integer_or(e, "qk_rope_head_dim", m.qk_rope_head_dim, true);
  m.v_head_dim = integer_or(e, "v_head_dim", m.v_head_dim, false);
  if (e.contains("rope_interleave") && !e["rope_interleave"].is_null()) {
    FIVEFOLD_CHECK(e["rope_interleave"].is_boolean(),
                   "config: 'rope_interleave' must be true or "
                   "false, got ",
                   e["rope_interleave"].dump());
    m.rope_interleave = e["rope_interleave"];
  }
  FIVEFOLD_CHECK(m.qk_rope_head_dim % 2 == 0,
                 "config: 'qk_rope_head_dim' must be even (pairs "
                 "rotate), got ",
                 m.qk_rope_head_dim);
  return m;
}

nlohmann::json MlaConfig::to_json() const {
  return {{"q_lora_rank", q_lora_rank > 0 ? nlohmann::json(q_lora_rank) : nlohmann::json()},
          {"kv_lora_rank", kv_lora_rank},
          {"qk_nope_head_dim", qk_nope_head_dim},
          {"qk_rope_head_dim", qk_rope_head_dim},
          {"v_head_dim", v_head_dim},
          {"rope_interleave", rope_interleave}};
}

int64_t kv_cache_elements_gqa(int64_t kv_heads, int64_t head_dim) {
  return 2 * kv_heads * head_dim;
}

int64_t kv_cache_elements_mla(const MlaConfig& mla) {
  return mla.kv_lora_rank + mla.qk_rope_head_dim;
}

double softmax_scale(const ch03::ModelConfig& model, const MlaConfig& mla) {
  double scale = 1.0 / std::sqrt(static_cast<double>(mla.qk_nope_head_dim + mla.qk_rope_head_dim));
  const auto scaling =
      ch05::RopeScaling::from_json(model.rope_scaling, model.max_position_embeddings);
  if (scaling.type == "yarn" && scaling.mscale_all_dim > 0) {
    const double m = ch05::yarn_get_mscale(scaling.factor, scaling.mscale_all_dim);
    scale *= m * m;
  }
  return scale;
}

MultiHeadLatentAttentionImpl::MultiHeadLatentAttentionImpl(const ch03::ModelConfig& c,
                                                           const MlaConfig& mla)
    : n_heads_(c.n_heads), mla_(mla), scale_(softmax_scale(c, mla)) {
  const int64_t q_width = n_heads_ * (mla.qk_nope_head_dim + mla.qk_rope_head_dim);
  if (mla.q_lora_rank > 0) {
    q_a_proj = register_module("q_a_proj", ch03::Linear(c.d_model, mla.q_lora_rank));
    q_a_layernorm = register_module("q_a_layernorm", ch03::RMSNorm(mla.q_lora_rank, 1e-6));
    q_b_proj = register_module("q_b_proj", ch03::Linear(mla.q_lora_rank, q_width));
  } else {
    q_proj = register_module("q_proj", ch03::Linear(c.d_model, q_width));
  }
  kv_a_proj_with_mqa = register_module(
      "kv_a_proj_with_mqa", ch03::Linear(c.d_model, mla.kv_lora_rank + mla.qk_rope_head_dim));
  kv_a_layernorm = register_module("kv_a_layernorm", ch03::RMSNorm(mla.kv_lora_rank, 1e-6));
  kv_b_proj = register_module(
      "kv_b_proj",
      ch03::Linear(mla.kv_lora_rank, n_heads_ * (mla.qk_nope_head_dim + mla.v_head_dim)));
  o_proj = register_module("o_proj", ch03::Linear(n_heads_ * mla.v_head_dim, c.d_model));
}

torch::Tensor MultiHeadLatentAttentionImpl::queries(const torch::Tensor& x) {
  auto q = mla_.q_lora_rank > 0 ? q_b_proj(q_a_layernorm(q_a_proj(x))) : q_proj(x);
  return q.view({x.size(0), x.size(1), n_heads_, -1}).transpose(1, 2);
}

torch::Tensor MultiHeadLatentAttentionImpl::attend(const torch::Tensor& q, const torch::Tensor& k,
                                                   const torch::Tensor& v,
                                                   const torch::Tensor& positions, int64_t cached) {
  return kernel->attend(q, k, v, positions, key_positions(positions, cached), scale_).output;
}

torch::Tensor MultiHeadLatentAttentionImpl::forward(const torch::Tensor& x,
                                                    const torch::Tensor& positions,
                                                    ch03::LayerCache* cache) {
  return cache == nullptr ? forward_naive(x, positions) : forward_absorbed(x, positions, *cache);
}

torch::Tensor MultiHeadLatentAttentionImpl::forward_absorbed(const torch::Tensor& x,
                                                             const torch::Tensor& positions,
                                                             ch03::LayerCache& cache) {
  const int64_t batch = x.size(0), seq = x.size(1), heads = n_heads_;
  const int64_t nope = mla_.qk_nope_head_dim, rope = mla_.qk_rope_head_dim, dv = mla_.v_head_dim;
  const int64_t d_c = mla_.kv_lora_rank;
  const int64_t cached = cache.keys.defined() ? cache.keys.size(2) : 0;
  auto q = queries(x);
  auto q_nope = q.narrow(-1, 0, nope), q_rope = q.narrow(-1, nope, rope);
  auto down = kv_a_proj_with_mqa(x);
  auto latent = kv_a_layernorm(down.narrow(-1, 0, d_c)).unsqueeze(1);  // [b, 1, s, d_c]
  auto k_rope = down.narrow(-1, d_c, rope).unsqueeze(1);               // [b, 1, s, rope]
  if (encoding) std::tie(q_rope, k_rope) = encoding->encode(q_rope, k_rope, positions);
  // The cache: per position [c_KV | k^R], one key shared by every head (d_c + rope numbers).
  auto entry = torch::cat({latent, k_rope}, -1);
  cache.keys = cache.keys.defined() ? torch::cat({cache.keys, entry}, 2) : entry;
  // kv_b_proj's weight per head: rows [W^UK (nope) ; W^UV (dv)], each over the d_c latent.
  auto w = kv_b_proj->weight.to(q_nope.scalar_type()).view({heads, nope + dv, d_c});
  auto w_uk = w.narrow(1, 0, nope), w_uv = w.narrow(1, nope, dv);
  // Absorb W^UK: q_nope·(W^UK c) = (q_nope·W^UK)·c, a query over the latent, [b, h, s, d_c].
  auto q_latent = torch::matmul(q_nope, w_uk);
  // Multi-query attention over the cache: keys [c | k^R], values c.
  auto out_latent = attend(torch::cat({q_latent, q_rope}, -1), cache.keys,
                           cache.keys.narrow(-1, 0, d_c), positions, cached);  // [b, h, s, d_c]
  // W^UV after attention (softmax weights sum the latents; W^UV is linear): [b, h, s, dv], in
  // the attention output's type (fp32 at least, where chapter 14's products hand on bf16).
  auto out = torch::matmul(out_latent, w_uv.transpose(1, 2).to(out_latent.scalar_type()));
  return o_proj(out.transpose(1, 2).reshape({batch, seq, heads * dv}));
}

ch03::ModelRecipe recipe(const ch03::ModelConfig& config) {
  config.validate();  // the config first: its errors name the config, not a module
  if (config.extensions.is_null()) return ch05::recipe(config);
  const MlaConfig mla = MlaConfig::from_json(config.extensions);
  FIVEFOLD_CHECK(config.rope_theta == 0 || mla.qk_rope_head_dim > 0,
                 "config: rope_theta needs qk_rope_head_dim > 0 (the rotated part of MLA)");
  ch03::ModelRecipe r;
  r.attention = [mla](const ch03::ModelConfig& c, int64_t) {
    return std::make_shared<MultiHeadLatentAttentionImpl>(c, mla);
  };
  if (config.rope_theta > 0) {
    const auto layout =
        mla.rope_interleave ? ch04::RopeLayout::Interleaved : ch04::RopeLayout::HalfSplit;
    const auto scaling =
        ch05::RopeScaling::from_json(config.rope_scaling, config.max_position_embeddings);
    if (scaling.type == "none") {
      r.position_encoding =
          std::make_shared<ch04::RotaryEmbedding>(mla.qk_rope_head_dim, config.rope_theta, layout);
    } else {
      r.position_encoding = std::make_shared<ch05::ScaledRotaryEmbedding>(
          mla.qk_rope_head_dim, config.rope_theta, scaling, layout);
    }
  }
  return r;
}

ch03::Transformer make_model(const ch03::ModelConfig& config, const ch03::ModelPart& part) {
  if (!config.extensions.is_null()) {
    for (const char* key : {"n_routed_experts", "moe_intermediate_size", "n_shared_experts"}) {
      FIVEFOLD_CHECK(!config.extensions.contains(key) || config.extensions[key].is_null(),
                     "config: '", key, "' (Mixture-of-Experts) needs chapter 07's make_model");
    }
  }
  return ch03::Transformer(config, recipe(config), part);
}

ch03::Transformer load_model(const std::string& dir) { return ch03::load_model(dir, make_model); }

}  // namespace fivefold::ch06
