// Chapter 03 plumbing: the modules around attention, and the model's initialisation.

#include "03_transformer/model.h"

#include <tuple>

#include "01_weight_init/weight_init.h"
#include "fivefold/error.h"

namespace fivefold::ch03 {

int64_t KVCache::length() const {
  return layers.empty() || !layers[0].keys.defined() ? 0 : layers[0].keys.size(2);
}

int64_t KVCache::bytes() const {
  int64_t total = 0;
  for (const auto& layer : layers) {
    for (const auto& t : {layer.keys, layer.values})
      if (t.defined()) total += t.numel() * t.element_size();
  }
  return total;
}

int64_t ModelConfig::resolved_head_dim() const {
  return head_dim > 0 ? head_dim : d_model / n_heads;
}

void ModelConfig::validate() const {
  FIVEFOLD_CHECK(vocab_size > 0 && d_model > 0 && n_layers > 0 && n_heads > 0 && d_ff > 0,
                 "model config: vocab_size, d_model, n_layers, n_heads and d_ff must be positive");
  FIVEFOLD_CHECK(head_dim > 0 || d_model % n_heads == 0, "model config: n_heads (", n_heads,
                 ") does not divide d_model (", d_model, "); set head_dim explicitly");
  FIVEFOLD_CHECK(n_kv_heads > 0 && n_heads % n_kv_heads == 0, "model config: n_kv_heads (",
                 n_kv_heads, ") must divide n_heads (", n_heads, ")");
  FIVEFOLD_CHECK(rms_norm_eps > 0, "model config: rms_norm_eps must be positive");
  FIVEFOLD_CHECK(rope_theta >= 0, "model config: rope_theta must be >= 0 (0: no positions)");
  FIVEFOLD_CHECK(max_position_embeddings > 0, "model config: max_position_embeddings must be > 0");
  FIVEFOLD_CHECK(rope_scaling.is_null() || rope_scaling.is_object(),
                 "model config: rope_scaling must be an object or null");
  FIVEFOLD_CHECK(rope_theta == 0 || resolved_head_dim() % 2 == 0,
                 "model config: rotary positions need an even head_dim, got ", resolved_head_dim());
}

ch02::TransformerShape ModelConfig::shape() const {
  return {vocab_size,
          d_model,
          n_layers,
          n_heads,
          n_kv_heads,
          resolved_head_dim(),
          d_ff,
          /*gated_mlp=*/true,
          /*biases=*/false,
          /*layer_norm=*/false,
          /*learned_positions=*/0,
          tied_embeddings};
}

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_) * weight;
}

namespace {
torch::nn::Linear linear(int64_t in, int64_t out) {
  return torch::nn::Linear(torch::nn::LinearOptions(in, out).bias(false));
}
}  // namespace

AttentionImpl::AttentionImpl(const ModelConfig& c)
    : n_heads_(c.n_heads), n_kv_heads_(c.n_kv_heads), head_dim_(c.resolved_head_dim()) {
  q_proj = register_module("q_proj", linear(c.d_model, n_heads_ * head_dim_));
  k_proj = register_module("k_proj", linear(c.d_model, n_kv_heads_ * head_dim_));
  v_proj = register_module("v_proj", linear(c.d_model, n_kv_heads_ * head_dim_));
  o_proj = register_module("o_proj", linear(n_heads_ * head_dim_, c.d_model));
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, LayerCache* cache) {
  const int64_t batch = x.size(0), seq = x.size(1);
  // [batch, seq, heads * head_dim] -> [batch, heads, seq, head_dim]
  auto heads = [&](const torch::Tensor& t, int64_t n) {
    return t.view({batch, seq, n, head_dim_}).transpose(1, 2);
  };
  auto q = heads(q_proj(x), n_heads_);
  auto k = heads(k_proj(x), n_kv_heads_), v = heads(v_proj(x), n_kv_heads_);
  if (positions) {  // these tokens come after the cached ones
    const int64_t first = cache != nullptr && cache->keys.defined() ? cache->keys.size(2) : 0;
    std::tie(q, k) = positions->encode(q, k, first);
  }
  if (cache != nullptr) {  // prepend the cached positions: [batch, n_kv_heads, cached + seq, hd]
    if (cache->keys.defined()) {
      k = torch::cat({cache->keys, k}, 2);
      v = torch::cat({cache->values, v}, 2);
    }
    cache->keys = k;
    cache->values = v;
  }
  auto out = causal_attention(q, k, v);
  // [batch, heads, seq, head_dim] -> [batch, seq, heads * head_dim]
  return o_proj(out.transpose(1, 2).reshape({batch, seq, n_heads_ * head_dim_}));
}

MlpImpl::MlpImpl(const ModelConfig& c) {
  gate_proj = register_module("gate_proj", linear(c.d_model, c.d_ff));
  up_proj = register_module("up_proj", linear(c.d_model, c.d_ff));
  down_proj = register_module("down_proj", linear(c.d_ff, c.d_model));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  return down_proj(torch::silu(gate_proj(x)) * up_proj(x));  // SwiGLU (Shazeer 2020)
}

BlockImpl::BlockImpl(const ModelConfig& c) {
  input_layernorm = register_module("input_layernorm", RMSNorm(c.d_model, c.rms_norm_eps));
  self_attn = register_module<AttentionLayer>("self_attn", std::make_shared<AttentionImpl>(c));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.d_model, c.rms_norm_eps));
  mlp = register_module<FeedForwardLayer>("mlp", std::make_shared<MlpImpl>(c));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, LayerCache* cache) {
  // Pre-norm: the residual stream itself is never normalised.
  auto h = x + self_attn->forward(input_layernorm(x), cache);
  return h + mlp->forward(post_attention_layernorm(h));
}

void BlockImpl::set_attention(std::shared_ptr<AttentionLayer> attention) {
  self_attn = replace_module("self_attn", std::move(attention));
}

void BlockImpl::set_mlp(std::shared_ptr<FeedForwardLayer> feed_forward) {
  mlp = replace_module("mlp", std::move(feed_forward));
}

TrunkImpl::TrunkImpl(const ModelConfig& c) {
  embed_tokens = register_module("embed_tokens", torch::nn::Embedding(c.vocab_size, c.d_model));
  layers = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < c.n_layers; ++i) layers->push_back(Block(c));
  norm = register_module("norm", RMSNorm(c.d_model, c.rms_norm_eps));
}

TransformerImpl::TransformerImpl(ModelConfig config) : config_(std::move(config)) {
  config_.validate();
  model = register_module("model", Trunk(config_));
  if (!config_.tied_embeddings)
    lm_head = register_module("lm_head", linear(config_.d_model, config_.vocab_size));
  initialise_parameters();
}

void TransformerImpl::initialise_parameters() {
  // Chapter 01: every matrix from its own (seed, name) generator, GPT-2's scheme; norms are ones.
  torch::NoGradGuard no_grad;
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    torch::Tensor& p = item.value();
    if (p.dim() != 2) continue;  // norm weights keep their ones
    ch01::InitSpec spec{ch01::Scheme::Gpt2, ch01::Activation::Linear, 0.02, config_.n_layers};
    // The projections that write into the residual stream.
    spec.residual_projection =
        name.find("o_proj") != std::string::npos || name.find("down_proj") != std::string::npos;
    p.copy_(ch01::init_weight(name, p.size(0), p.size(1), spec, config_.seed));
  }
}

void TransformerImpl::set_position_encoding(std::shared_ptr<const PositionEncoding> encoding) {
  for (const auto& layer : *model->layers) layer->as<BlockImpl>()->self_attn->positions = encoding;
}

Transformer build_model(const ModelConfig& config) {
  FIVEFOLD_CHECK(config.extensions.is_null(),
                 "config: a deepseek_v3 model (MLA, MoE) needs chapter 06's make_model");
  return Transformer(config);
}

torch::Tensor TransformerImpl::forward(const torch::Tensor& tokens, KVCache* cache) {
  FIVEFOLD_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kLong,
                 "Transformer: tokens must be int64 [batch, seq], got ", tokens.sizes(), " ",
                 tokens.scalar_type());
  FIVEFOLD_CHECK(
      config_.rope_theta == 0 || model->layers[0]->as<BlockImpl>()->self_attn->positions != nullptr,
      "Transformer: the config has rope_theta = ", config_.rope_theta,
      " but no position encoding is installed: build the model with chapter 04's "
      "make_model (or load_model)");
  if (cache != nullptr) cache->layers.resize(config_.n_layers);
  auto x = model->embed_tokens(tokens);  // [batch, seq, d_model]
  for (int64_t i = 0; i < config_.n_layers; ++i) {
    x = model->layers[i]->as<BlockImpl>()->forward(x, cache ? &cache->layers[i] : nullptr);
  }
  x = model->norm(x);
  return config_.tied_embeddings ? torch::matmul(x, model->embed_tokens->weight.t()) : lm_head(x);
}

}  // namespace fivefold::ch03
