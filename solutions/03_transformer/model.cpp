// Chapter 03 plumbing: the modules around attention, and the model's initialisation (the linear map
// every weight matrix goes through is in linear.cpp).

#include "03_transformer/model.h"

#include <cmath>
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

torch::Tensor position_range(int64_t first, int64_t count) {
  return torch::arange(first, first + count, torch::kLong);
}

bool CausalAttentionKernel::causal_layout(const torch::Tensor& q_positions,
                                          const torch::Tensor& k_positions) {
  const auto q = q_positions.contiguous(), k = k_positions.contiguous();
  const int64_t seq_q = q.numel(), seq_k = k.numel();
  if (seq_q > seq_k) return false;
  const int64_t* keys = k.data_ptr<int64_t>();
  const int64_t* queries = q.data_ptr<int64_t>();
  for (int64_t i = 0; i < seq_k; ++i) {
    if (keys[i] != keys[0] + i) return false;
  }
  for (int64_t i = 0; i < seq_q; ++i) {
    if (queries[i] != keys[seq_k - seq_q + i]) return false;
  }
  return true;
}

AttentionOutput AttentionKernel::attend(const torch::Tensor& q, const torch::Tensor& k,
                                        const torch::Tensor& v, const torch::Tensor& q_positions,
                                        const torch::Tensor& k_positions, double scale) const {
  if (takes_narrow_inputs()) return compute(q, k, v, q_positions, k_positions, scale);
  const auto type = at::promote_types(at::promote_types(q.scalar_type(), k.scalar_type()),
                                      at::promote_types(v.scalar_type(), torch::kFloat));
  return compute(q.to(type), k.to(type), v.to(type), q_positions, k_positions, scale);
}

AttentionOutput CausalAttentionKernel::compute(const torch::Tensor& q, const torch::Tensor& k,
                                               const torch::Tensor& v,
                                               const torch::Tensor& q_positions,
                                               const torch::Tensor& k_positions,
                                               double scale) const {
  FIVEFOLD_CHECK(q_positions.size(0) == q.size(2) && k_positions.size(0) == k.size(2) &&
                     causal_layout(q_positions, k_positions),
                 "chapter 03's attention kernel needs keys at consecutive positions and queries "
                 "at the last of them; other layouts need another kernel (chapter 12)");
  AttentionOutput result;
  // causal_attention divides q by √(its width); multiplying by √width · scale leaves `scale`.
  const double width = static_cast<double>(q.size(-1));
  const double factor = scale * std::sqrt(width);
  result.output =
      causal_attention(std::abs(factor - 1.0) < 1e-12 ? q : q * factor, k, v, &result.lse);
  return result;
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

torch::Tensor RMSNormImpl::forward(const torch::Tensor& input) {
  // In at least fp32, whatever the input's type (a bf16 product's result) or the weight's (a bf16
  // table, chapter 14): a mean of squares in bf16 loses the small components.
  const auto x = input.to(at::promote_types(
      at::promote_types(input.scalar_type(), weight.scalar_type()), torch::kFloat));
  if (kernel) return kernel->normalize(x, weight, eps_);
  return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + eps_) * weight;
}

AttentionImpl::AttentionImpl(const ModelConfig& c)
    : n_heads_(c.n_heads), n_kv_heads_(c.n_kv_heads), head_dim_(c.resolved_head_dim()) {
  q_proj = register_module("q_proj", Linear(c.d_model, n_heads_ * head_dim_));
  k_proj = register_module("k_proj", Linear(c.d_model, n_kv_heads_ * head_dim_));
  v_proj = register_module("v_proj", Linear(c.d_model, n_kv_heads_ * head_dim_));
  o_proj = register_module("o_proj", Linear(n_heads_ * head_dim_, c.d_model));
}

torch::Tensor AttentionLayer::key_positions(const torch::Tensor& positions, int64_t cached) {
  return cached == 0 ? positions : torch::cat({position_range(0, cached), positions});
}

torch::Tensor AttentionLayer::attend_heads(const torch::Tensor& q_rows, const torch::Tensor& k_rows,
                                           const torch::Tensor& v_rows, int64_t heads,
                                           int64_t kv_heads, int64_t head_dim,
                                           const torch::Tensor& positions,
                                           LayerCache* cache) const {
  const int64_t batch = q_rows.size(0), seq = q_rows.size(1);
  // [batch, seq, heads * head_dim] -> [batch, heads, seq, head_dim]
  auto split = [&](const torch::Tensor& t, int64_t n) {
    return t.view({batch, seq, n, head_dim}).transpose(1, 2);
  };
  auto q = split(q_rows, heads), k = split(k_rows, kv_heads), v = split(v_rows, kv_heads);
  if (encoding) std::tie(q, k) = encoding->encode(q, k, positions);
  const int64_t cached = cache != nullptr && cache->keys.defined() ? cache->keys.size(2) : 0;
  if (cache != nullptr) {  // prepend the cached positions: [batch, kv_heads, cached + seq, hd]
    if (cached > 0) {
      k = torch::cat({cache->keys, k}, 2);
      v = torch::cat({cache->values, v}, 2);
    }
    cache->keys = k;
    cache->values = v;
  }
  const double scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  auto out = kernel->attend(q, k, v, positions, key_positions(positions, cached), scale).output;
  // [batch, heads, seq, head_dim] -> [batch, seq, heads * head_dim]
  return out.transpose(1, 2).reshape({batch, seq, heads * head_dim});
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& positions,
                                     LayerCache* cache) {
  return o_proj(attend_heads(q_proj(x), k_proj(x), v_proj(x), n_heads_, n_kv_heads_, head_dim_,
                             positions, cache));
}

MlpImpl::MlpImpl(const ModelConfig& c) {
  gate_proj = register_module("gate_proj", Linear(c.d_model, c.d_ff));
  up_proj = register_module("up_proj", Linear(c.d_model, c.d_ff));
  down_proj = register_module("down_proj", Linear(c.d_ff, c.d_model));
}

torch::Tensor MlpImpl::forward(const torch::Tensor& x) {
  return down_proj(torch::silu(gate_proj(x)) * up_proj(x));  // SwiGLU (Shazeer 2020)
}

BlockImpl::BlockImpl(const ModelConfig& c, std::shared_ptr<AttentionLayer> attention,
                     std::shared_ptr<FeedForwardLayer> feed_forward) {
  if (!attention) attention = std::make_shared<AttentionImpl>(c);
  if (!feed_forward) feed_forward = std::make_shared<MlpImpl>(c);
  input_layernorm = register_module("input_layernorm", RMSNorm(c.d_model, c.rms_norm_eps));
  self_attn = register_module("self_attn", std::move(attention));
  post_attention_layernorm =
      register_module("post_attention_layernorm", RMSNorm(c.d_model, c.rms_norm_eps));
  mlp = register_module("mlp", std::move(feed_forward));
}

torch::Tensor BlockImpl::forward(const torch::Tensor& x, const torch::Tensor& positions,
                                 LayerCache* cache) {
  // Pre-norm: the residual stream itself is never normalised.
  auto h = x + self_attn->forward(input_layernorm(x), positions, cache);
  return h + mlp->forward(post_attention_layernorm(h));
}

void BlockImpl::set_attention(std::shared_ptr<AttentionLayer> attention) {
  self_attn = replace_module("self_attn", std::move(attention));
}

void BlockImpl::set_mlp(std::shared_ptr<FeedForwardLayer> feed_forward) {
  mlp = replace_module("mlp", std::move(feed_forward));
}

EmbeddingImpl::EmbeddingImpl(int64_t vocab, int64_t d_model) {
  weight = register_parameter("weight", torch::empty({vocab, d_model}));
}

torch::Tensor EmbeddingImpl::forward(const torch::Tensor& tokens) {
  // Row tokens[b, s] of the table, in at least fp32: the residual stream stays fp32 when the
  // table is kept in bf16 (chapter 14's master weights).
  return at_least_fp32(torch::embedding(weight, tokens));
}

torch::Tensor OutputLayer::loss(const torch::Tensor& hidden, const torch::Tensor& targets) {
  auto scores = logits(hidden);  // [batch, seq, vocab]
  return torch::cross_entropy_loss(scores.view({-1, scores.size(-1)}), targets.reshape({-1}));
}

LanguageModelHeadImpl::LanguageModelHeadImpl(int64_t vocab, int64_t d_model,
                                             torch::Tensor tied_weight)
    : weight(tied_weight.defined() ? tied_weight
                                   : register_parameter("weight", torch::empty({vocab, d_model}))) {
}

torch::Tensor LanguageModelHeadImpl::logits(const torch::Tensor& hidden) {
  // [..., d_model] x [d_model, vocab] through `linear`, as every weight matrix (bf16 products
  // under chapter 14's kernel); the logits at least in fp32, where softmax and the loss run.
  return at_least_fp32(ch03::linear(hidden, weight));
}

int64_t ModelPart::end(int64_t n_layers) const {
  const int64_t last = last_layer < 0 ? n_layers : last_layer;
  FIVEFOLD_CHECK(0 <= first_layer && first_layer <= last && last <= n_layers,
                 "model part: layers [", first_layer, ", ", last, ") are not within the model's ",
                 n_layers);
  return last;
}

bool ModelPart::whole(int64_t n_layers) const {
  return static_cast<int64_t>(layers(n_layers).size()) == n_layers && embedding && head;
}

std::vector<int64_t> ModelPart::layers(int64_t n_layers) const {
  std::vector<int64_t> held;
  for (int64_t i = first_layer; i < end(n_layers); ++i) held.push_back(i);
  for (const auto& [first, last] : more_layers) {
    FIVEFOLD_CHECK(first <= last && last <= n_layers && (held.empty() || first > held.back()),
                   "model part: layers [", first, ", ", last,
                   ") must follow the ranges before them, within the model's ", n_layers);
    for (int64_t i = first; i < last; ++i) held.push_back(i);
  }
  return held;
}

TrunkImpl::TrunkImpl(const ModelConfig& c, const ModelRecipe& recipe, const ModelPart& part) {
  if (part.embedding || (part.head && c.tied_embeddings)) {
    embed_tokens = register_module<TokenEmbedding>(
        "embed_tokens",
        recipe.embedding ? recipe.embedding(c) : Embedding(c.vocab_size, c.d_model).ptr());
  }
  layers = register_module("layers", torch::nn::ModuleDict());
  for (int64_t i : part.layers(c.n_layers)) {
    Block block(c, recipe.attention ? recipe.attention(c, i) : nullptr,
                recipe.mlp ? recipe.mlp(c, i) : nullptr);
    block->self_attn->encoding = recipe.position_encoding;
    // Registered as model.layers.{i}, the global index, whichever layers this part holds.
    layers->update(std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{
        {std::to_string(i), block.ptr()}});
  }
  if (part.head) norm = register_module("norm", RMSNorm(c.d_model, c.rms_norm_eps));
}

TransformerImpl::TransformerImpl(ModelConfig config, const ModelRecipe& recipe,
                                 const ModelPart& part)
    : config_(std::move(config)), part_(part) {
  config_.validate();
  part_.last_layer = part_.end(config_.n_layers);
  model = register_module("model", Trunk(config_, recipe, part_));
  if (part_.head) {
    torch::Tensor tied;
    if (config_.tied_embeddings) tied = model->embed_tokens->named_parameters(false)["weight"];
    lm_head = register_module<OutputLayer>(
        "lm_head", recipe.output
                       ? recipe.output(config_, tied)
                       : LanguageModelHead(config_.vocab_size, config_.d_model, tied).ptr());
  }
  initialise_parameters();
}

BlockImpl& TransformerImpl::block(int64_t layer) {
  const std::string key = std::to_string(layer);
  FIVEFOLD_CHECK(model->layers->contains(key), "Transformer: layer ", layer,
                 " is not held by this part");
  return *model->layers[key]->as<BlockImpl>();
}

std::vector<int64_t> TransformerImpl::layer_indices() const {
  return part_.layers(config_.n_layers);
}

void TransformerImpl::initialise_parameters() {
  // Chapter 01: every matrix from its own (seed, name) generator, GPT-2's scheme; norms are ones.
  // A slice is drawn as its part of the full matrix, so every layout starts from the same model.
  torch::NoGradGuard no_grad;
  const auto shards = parameter_shards();
  for (auto& item : named_parameters()) {
    const std::string& name = item.key();
    torch::Tensor& p = item.value();
    if (p.dim() != 2) continue;  // norm weights keep their ones
    ch01::InitSpec spec{ch01::Scheme::Gpt2, ch01::Activation::Linear, 0.02, config_.n_layers};
    // The projections that write into the residual stream.
    spec.residual_projection =
        name.find("o_proj") != std::string::npos || name.find("down_proj") != std::string::npos;
    const auto found = shards.find(name);
    if (found == shards.end()) {
      p.copy_(ch01::init_weight(name, p.size(0), p.size(1), spec, config_.seed));
      continue;
    }
    const TensorShard& piece = found->second;
    auto full = p.sizes().vec();
    full[static_cast<size_t>(piece.dim)] = piece.full_size;
    p.copy_(ch01::init_weight_shard(name, full[0], full[1], spec, config_.seed, piece.dim,
                                    piece.index, piece.count));
  }
}

std::map<std::string, TensorShard> TransformerImpl::parameter_shards() const {
  std::map<std::string, TensorShard> shards;
  // Not including the model itself: the constructor calls this before a shared_ptr holds it.
  for (const auto& item : named_modules("", /*include_self=*/false)) {
    const auto* sharded = dynamic_cast<const ShardedModule*>(item.value().get());
    if (sharded == nullptr) continue;
    for (const auto& [name, piece] : sharded->shards()) shards[item.key() + "." + name] = piece;
  }
  return shards;
}

void TransformerImpl::set_position_encoding(std::shared_ptr<const PositionEncoding> encoding) {
  for (int64_t i : layer_indices()) block(i).self_attn->encoding = encoding;
}

void TransformerImpl::set_attention_kernel(std::shared_ptr<const AttentionKernel> kernel) {
  FIVEFOLD_CHECK(kernel != nullptr, "set_attention_kernel: no kernel");
  for (int64_t i : layer_indices()) block(i).self_attn->kernel = kernel;
}

void TransformerImpl::set_embedding(std::shared_ptr<TokenEmbedding> embedding) {
  model->embed_tokens = model->replace_module("embed_tokens", std::move(embedding));
}

void TransformerImpl::set_output_layer(std::shared_ptr<OutputLayer> output) {
  lm_head = replace_module("lm_head", std::move(output));
}

Transformer build_model(const ModelConfig& config, const ModelPart& part) {
  FIVEFOLD_CHECK(config.extensions.is_null(),
                 "config: a deepseek_v3 model (MLA, MoE) needs chapter 06's make_model");
  return Transformer(config, ModelRecipe{}, part);
}

torch::Tensor TransformerImpl::embed(const torch::Tensor& tokens) {
  FIVEFOLD_CHECK(part_.embedding, "Transformer: this part holds no embedding");
  FIVEFOLD_CHECK(tokens.dim() == 2 && tokens.scalar_type() == torch::kLong,
                 "Transformer: tokens must be int64 [batch, seq], got ", tokens.sizes(), " ",
                 tokens.scalar_type());
  return model->embed_tokens->forward(tokens);  // [batch, seq, d_model]
}

torch::Tensor TransformerImpl::forward_layers(torch::Tensor x, const torch::Tensor& positions,
                                              int64_t first, int64_t last, KVCache* cache) {
  FIVEFOLD_CHECK(0 <= first && first <= last && last <= config_.n_layers, "Transformer: layers [",
                 first, ", ", last, ") are not within the model's ", config_.n_layers);
  // Under sequence parallelism (chapter 10) x holds a slice of the sequence that `positions`
  // spans in full; otherwise the two have the same length.
  FIVEFOLD_CHECK(positions.dim() == 1 && positions.scalar_type() == torch::kLong &&
                     positions.size(0) >= x.size(1),
                 "Transformer: positions must be int64 [seq] with seq >= ", x.size(1));
  if (cache != nullptr) cache->layers.resize(static_cast<size_t>(config_.n_layers));
  for (int64_t i = first; i < last; ++i) {
    BlockImpl& layer = block(i);
    FIVEFOLD_CHECK(config_.rope_theta == 0 || layer.self_attn->encoding != nullptr,
                   "Transformer: the config has rope_theta = ", config_.rope_theta,
                   " but no position encoding is installed: build the model with chapter 04's "
                   "make_model (or load_model)");
    if (cache != nullptr) {
      x = layer.forward(x, positions, &cache->layers[static_cast<size_t>(i)]);
    } else {
      x = run_layer_ ? run_layer_(layer, i, x, positions) : layer.forward(x, positions);
    }
  }
  return x;
}

torch::Tensor TransformerImpl::logits(const torch::Tensor& hidden) {
  FIVEFOLD_CHECK(part_.head, "Transformer: this part holds no head");
  return lm_head->logits(model->norm(hidden));
}

torch::Tensor TransformerImpl::loss(const torch::Tensor& hidden, const torch::Tensor& targets) {
  FIVEFOLD_CHECK(part_.head, "Transformer: this part holds no head");
  return lm_head->loss(model->norm(hidden), targets);
}

torch::Tensor TransformerImpl::forward(const torch::Tensor& tokens, KVCache* cache) {
  auto x = embed(tokens);
  const int64_t first = cache != nullptr ? cache->length() : 0;
  x = forward_layers(x, position_range(first, tokens.size(1)), 0, config_.n_layers, cache);
  return logits(x);
}

}  // namespace fivefold::ch03
