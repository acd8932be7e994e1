// Chapters 06-07 against Hugging Face: a line-by-line transcription of transformers'
// DeepseekV3ForCausalLM forward (modeling_deepseek_v3.py: RMSNorm in float32, the YaRN rotary
// embedding with its attention factor, apply_rotary_pos_emb_interleave's permutation then
// rotate_half, the query/key split and concatenation, eager attention with the mscale² scaling,
// the top-k router with group masking, the experts' loop and the shared experts), written with
// raw tensors from the checkpoint's named weights, must give the logits of fivefold's model
// loaded from the same files. transformers itself is not installed here; the transcription is
// as independent of chapters 03-07's code as a test in this repository can be.

#include <cmath>
#include <filesystem>

#include "03_transformer/checkpoint.h"
#include "07_moe/moe.h"
#include "fivefold/io.h"
#include "fivefold/seed.h"
#include "testing.h"

using namespace fivefold;
using fivefold::testing::ScratchDir;
using torch::Tensor;

namespace {
struct Reference {
  io::TensorMap w;
  nlohmann::json c;

  Tensor weight(const std::string& name) const { return w.at(name); }
  Tensor linear(const std::string& name, const Tensor& x) const {
    return torch::matmul(x, weight(name + ".weight").t());
  }
  Tensor rms_norm(const std::string& name, const Tensor& x, double eps) const {
    auto variance = x.to(torch::kFloat).pow(2).mean(-1, true);
    return weight(name + ".weight") * (x * torch::rsqrt(variance + eps));
  }
  static Tensor rotate_half(const Tensor& x) {
    const int64_t half = x.size(-1) / 2;
    return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
  }
  static double get_mscale(double scale, double mscale) {
    return scale <= 1 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
  }
  // _compute_yarn_parameters and DeepseekV3RotaryEmbedding.forward: cos, sin [seq, dim].
  std::pair<Tensor, Tensor> rotary(int64_t seq) const {
    const int64_t dim = c["qk_rope_head_dim"];
    const double base = c["rope_theta"];
    const auto& r = c["rope_scaling"];
    const double factor = r["factor"], mscale = r["mscale"], mscale_all_dim = r["mscale_all_dim"];
    const double attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim);
    const double beta_fast = r["beta_fast"], beta_slow = r["beta_slow"];
    const double original = r["original_max_position_embeddings"];
    auto correction_dim = [&](double rotations) {
      return (dim * std::log(original / (rotations * 2 * M_PI))) / (2 * std::log(base));
    };
    const double low = std::max(std::floor(correction_dim(beta_fast)), 0.0);
    const double high = std::min(std::ceil(correction_dim(beta_slow)), dim - 1.0);
    auto pos_freqs = torch::pow(base, torch::arange(0, dim, 2).to(torch::kFloat) / dim);
    auto extrapolation = 1.0 / pos_freqs, interpolation = 1.0 / (factor * pos_freqs);
    auto ramp = ((torch::arange(dim / 2).to(torch::kFloat) - low) / (high - low)).clamp(0, 1);
    auto extrapolation_factor = 1 - ramp;
    auto inv_freq =
        interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor;
    auto freqs = torch::outer(torch::arange(seq).to(torch::kFloat), inv_freq);
    auto emb = torch::cat({freqs, freqs}, -1);
    return {emb.cos() * attention_factor, emb.sin() * attention_factor};
  }
  // apply_rotary_pos_emb_interleave: de-interleave, then the half-split rotation.
  static Tensor rope_interleave(const Tensor& x, const Tensor& cos, const Tensor& sin) {
    const auto s = x.sizes();
    auto y = x.view({s[0], s[1], s[2], s[3] / 2, 2}).transpose(4, 3).reshape(s);
    return y * cos + rotate_half(y) * sin;
  }

  Tensor attention(const std::string& p, const Tensor& h) const {
    const int64_t b = h.size(0), s = h.size(1);
    const int64_t nope = c["qk_nope_head_dim"], rope = c["qk_rope_head_dim"],
                  v_dim = c["v_head_dim"], rank = c["kv_lora_rank"];
    auto q = linear(p + "q_b_proj", rms_norm(p + "q_a_layernorm", linear(p + "q_a_proj", h), 1e-6))
                 .view({b, s, -1, nope + rope})
                 .transpose(1, 2);
    auto q_pass = q.narrow(-1, 0, nope), q_rot = q.narrow(-1, nope, rope);
    auto compressed = linear(p + "kv_a_proj_with_mqa", h);
    auto k_pass = compressed.narrow(-1, 0, rank), k_rot = compressed.narrow(-1, rank, rope);
    k_pass = linear(p + "kv_b_proj", rms_norm(p + "kv_a_layernorm", k_pass, 1e-6))
                 .view({b, s, -1, nope + v_dim})
                 .transpose(1, 2);
    auto value = k_pass.narrow(-1, nope, v_dim);
    k_pass = k_pass.narrow(-1, 0, nope);
    k_rot = k_rot.view({b, 1, s, rope});
    auto [cos, sin] = rotary(s);
    q_rot = rope_interleave(q_rot, cos, sin);
    k_rot = rope_interleave(k_rot, cos, sin).expand({b, k_pass.size(1), s, rope});
    auto query = torch::cat({q_pass, q_rot}, -1), key = torch::cat({k_pass, k_rot}, -1);
    const auto& r = c["rope_scaling"];
    const double m = get_mscale(r["factor"], r["mscale_all_dim"]);
    const double scaling = std::pow(nope + rope, -0.5) * m * m;
    auto mask = torch::full({s, s}, -INFINITY).triu(1);
    auto weights = torch::softmax(torch::matmul(query, key.transpose(2, 3)) * scaling + mask, -1);
    auto out = torch::matmul(weights, value).transpose(1, 2).reshape({b, s, -1});
    return linear(p + "o_proj", out);
  }

  Tensor mlp(const std::string& p, const Tensor& x) const {
    return linear(p + "down_proj",
                  torch::silu(linear(p + "gate_proj", x)) * linear(p + "up_proj", x));
  }

  // DeepseekV3TopkRouter + DeepseekV3MoE.moe + shared experts.
  Tensor moe(const std::string& p, const Tensor& hidden) const {
    const int64_t experts = c["n_routed_experts"], k = c["num_experts_per_tok"];
    const int64_t groups = c["n_group"], topk_group = c["topk_group"];
    const auto x = hidden.view({-1, hidden.size(-1)});
    auto scores = torch::sigmoid(torch::matmul(x, weight(p + "gate.weight").t()));
    auto for_choice = scores + weight(p + "gate.e_score_correction_bias").unsqueeze(0);
    auto group_scores =
        std::get<0>(for_choice.view({-1, groups, experts / groups}).topk(2, -1)).sum(-1);
    auto group_idx = std::get<1>(group_scores.topk(topk_group, -1, true, false));
    auto group_mask = torch::zeros_like(group_scores).scatter_(1, group_idx, 1);
    auto score_mask =
        group_mask.unsqueeze(-1).expand({-1, groups, experts / groups}).reshape({-1, experts});
    for_choice = for_choice.masked_fill(score_mask.logical_not(), 0.0);
    auto topk_indices = std::get<1>(for_choice.topk(k, -1, true, false));
    auto topk_weights = scores.gather(1, topk_indices);
    topk_weights = topk_weights / (topk_weights.sum(-1, true) + 1e-20);
    topk_weights = topk_weights * c["routed_scaling_factor"].get<double>();
    auto out = torch::zeros_like(x);
    for (int64_t e = 0; e < experts; ++e) {
      auto mask = topk_indices == e;  // [tokens, k]
      auto token_idx = mask.any(-1).nonzero().squeeze(1);
      if (token_idx.numel() == 0) continue;
      auto weight_of = (topk_weights * mask).sum(-1).index_select(0, token_idx).unsqueeze(1);
      auto y = mlp(p + "experts." + std::to_string(e) + ".", x.index_select(0, token_idx));
      out.index_add_(0, token_idx, y * weight_of);
    }
    return out.view(hidden.sizes()) + mlp(p + "shared_experts.", hidden);
  }

  Tensor logits(const Tensor& tokens) const {
    auto h = torch::embedding(weight("model.embed_tokens.weight"), tokens);
    const double eps = c["rms_norm_eps"];
    for (int64_t i = 0; i < c["num_hidden_layers"].get<int64_t>(); ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      h = h + attention(p + "self_attn.", rms_norm(p + "input_layernorm", h, eps));
      auto normed = rms_norm(p + "post_attention_layernorm", h, eps);
      h = h + (i >= c["first_k_dense_replace"].get<int64_t>() ? moe(p + "mlp.", normed)
                                                              : mlp(p + "mlp.", normed));
    }
    return linear("lm_head", rms_norm("model.norm", h, eps));
  }
};
}  // namespace

TEST(HuggingFaceReference, DeepSeekV3InMiniatureComputesTheSameLogits) {
  ScratchDir scratch("hf_reference");
  const auto dir = scratch.path("checkpoint");
  const auto configs = std::filesystem::path(__FILE__).parent_path() / "configs";
  auto json = io::read_json((configs / "tiny-deepseek-v3-moe.json").string());
  {
    ch03::Transformer model = ch07::make_model(ch03::config_from_json(json));
    // Weights of order one (N(0, 1/fan_in)), norms around one and a positive balancing bias:
    // every difference in layout or order shows in the logits.
    torch::NoGradGuard no_grad;
    auto g = generator_for(11, "hf");
    for (auto& item : model->named_parameters()) {
      auto& p = item.value();
      if (p.dim() == 2) {
        p.copy_(torch::randn(p.sizes(), g) / std::sqrt(static_cast<double>(p.size(1))));
      } else if (item.key().find("e_score_correction_bias") != std::string::npos) {
        p.copy_(0.1 * torch::rand(p.sizes(), g));
      } else {
        p.copy_(1 + 0.2 * torch::randn(p.sizes(), g));
      }
    }
    ch03::save_model(dir, model);
  }
  const Reference reference{io::load_safetensors(dir + "/model.safetensors"),
                            io::read_json(dir + "/config.json")};
  ch03::Transformer ours = ch07::load_model(dir);
  const auto tokens = torch::randint(0, 259, {2, 24}, generator_for(12, "tokens"));
  torch::NoGradGuard no_grad;
  const auto expected = reference.logits(tokens);
  EXPECT_TENSOR_CLOSE(ours(tokens), expected, 1e-4, 1e-4);
  // And through the latent cache, one token at a time after a prompt of 16.
  ch03::KVCache cache;
  std::vector<Tensor> parts{ours(tokens.narrow(1, 0, 16), &cache)};
  for (int64_t t = 16; t < 24; ++t) parts.push_back(ours(tokens.narrow(1, t, 1), &cache));
  EXPECT_TENSOR_CLOSE(torch::cat(parts, 1), expected, 1e-4, 1e-4);
}
