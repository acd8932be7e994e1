// A transformer small enough to read in one screen, to measure FLOPs on and count parameters of.
// Chapter 03 builds the real model (with modules, checkpoints and a training loop); this one is a
// function of a map of weights.

#include <cmath>

#include "01_weight_init/weight_init.h"
#include "02_flops_6np/flops.h"
#include "fivefold/error.h"
#include "fivefold/memory.h"

namespace fivefold::ch02 {
namespace {

torch::Tensor norm(const TransformerShape& s, const std::map<std::string, torch::Tensor>& w,
                   const std::string& name, const torch::Tensor& x) {
  if (s.layer_norm) {
    return torch::layer_norm(x, {s.d_model}, w.at(name + ".weight"), w.at(name + ".bias"), 1e-5);
  }
  return x * torch::rsqrt(x.pow(2).mean(-1, /*keepdim=*/true) + 1e-6) * w.at(name + ".weight");
}

torch::Tensor linear(const std::map<std::string, torch::Tensor>& w, const std::string& name,
                     const torch::Tensor& x) {
  auto bias = w.find(name + ".bias");
  return torch::linear(x, w.at(name + ".weight"), bias == w.end() ? torch::Tensor() : bias->second);
}

}  // namespace

std::map<std::string, torch::Tensor> make_weights(const TransformerShape& s, uint64_t seed) {
  s.validate();
  std::map<std::string, torch::Tensor> w;
  const ch01::InitSpec spec{ch01::Scheme::Gpt2, ch01::Activation::Linear, 0.02, s.n_layers};
  auto matrix = [&](const std::string& name, int64_t out, int64_t in) {
    w[name + ".weight"] = ch01::init_weight(name + ".weight", out, in, spec, seed);
    if (s.biases) w[name + ".bias"] = torch::zeros({out});
  };
  auto add_norm = [&](const std::string& name) {
    w[name + ".weight"] = torch::ones({s.d_model});
    if (s.layer_norm) w[name + ".bias"] = torch::zeros({s.d_model});
  };
  const int64_t q = s.n_heads * s.head_dim, kv = s.n_kv_heads * s.head_dim;
  w["model.embed_tokens.weight"] =
      ch01::init_weight("model.embed_tokens.weight", s.vocab_size, s.d_model, spec, seed);
  if (s.learned_positions > 0) {
    w["model.embed_positions.weight"] = ch01::init_weight(
        "model.embed_positions.weight", s.learned_positions, s.d_model, spec, seed);
  }
  for (int64_t i = 0; i < s.n_layers; ++i) {
    const std::string layer = "model.layers." + std::to_string(i);
    add_norm(layer + ".input_layernorm");
    matrix(layer + ".self_attn.q_proj", q, s.d_model);
    matrix(layer + ".self_attn.k_proj", kv, s.d_model);
    matrix(layer + ".self_attn.v_proj", kv, s.d_model);
    matrix(layer + ".self_attn.o_proj", s.d_model, q);
    add_norm(layer + ".post_attention_layernorm");
    if (s.gated_mlp) matrix(layer + ".mlp.gate_proj", s.d_ff, s.d_model);
    matrix(layer + ".mlp.up_proj", s.d_ff, s.d_model);
    matrix(layer + ".mlp.down_proj", s.d_model, s.d_ff);
  }
  add_norm("model.norm");
  if (!s.tied_embeddings) {  // LM heads have no bias, in either family
    w["lm_head.weight"] = ch01::init_weight("lm_head.weight", s.vocab_size, s.d_model, spec, seed);
  }
  for (auto& [name, tensor] : w) tensor.requires_grad_(true);
  return w;
}

torch::Tensor forward(const TransformerShape& s, const std::map<std::string, torch::Tensor>& w,
                      const torch::Tensor& tokens) {
  FIVEFOLD_CHECK(tokens.dim() == 2, "forward: tokens must be [batch, seq], got ", tokens.sizes());
  const int64_t batch = tokens.size(0), seq = tokens.size(1);
  FIVEFOLD_CHECK(s.learned_positions == 0 || seq <= s.learned_positions, "forward: ", seq,
                 " tokens but the model has ", s.learned_positions, " learned positions");
  torch::Tensor x = torch::embedding(w.at("model.embed_tokens.weight"), tokens);  // [batch, seq, d]
  if (s.learned_positions > 0) {
    x = x + torch::embedding(w.at("model.embed_positions.weight"), torch::arange(seq));
  }
  const auto causal = torch::ones({seq, seq}, torch::kBool).triu(1);  // true above the diagonal
  for (int64_t i = 0; i < s.n_layers; ++i) {
    const std::string layer = "model.layers." + std::to_string(i);
    auto h = norm(s, w, layer + ".input_layernorm", x);
    // [batch, seq, heads * head_dim] -> [batch, heads, seq, head_dim]
    auto heads = [&](const torch::Tensor& t, int64_t n) {
      return t.view({batch, seq, n, s.head_dim}).transpose(1, 2);
    };
    auto q = heads(linear(w, layer + ".self_attn.q_proj", h), s.n_heads);
    auto k = heads(linear(w, layer + ".self_attn.k_proj", h), s.n_kv_heads);
    auto v = heads(linear(w, layer + ".self_attn.v_proj", h), s.n_kv_heads);
    if (s.n_kv_heads <
        s.n_heads) {  // grouped-query attention: each kv head serves a group of q heads
      k = k.repeat_interleave(s.n_heads / s.n_kv_heads, 1);
      v = v.repeat_interleave(s.n_heads / s.n_kv_heads, 1);
    }
    auto scores =
        torch::matmul(q, k.transpose(-2, -1)) / std::sqrt(static_cast<double>(s.head_dim));
    auto probs =
        torch::softmax(scores.masked_fill(causal, -INFINITY), -1);  // [batch, heads, seq, seq]
    auto attended =
        torch::matmul(probs, v).transpose(1, 2).reshape({batch, seq, s.n_heads * s.head_dim});
    x = x + linear(w, layer + ".self_attn.o_proj", attended);
    h = norm(s, w, layer + ".post_attention_layernorm", x);
    auto hidden = s.gated_mlp ? torch::silu(linear(w, layer + ".mlp.gate_proj", h)) *
                                    linear(w, layer + ".mlp.up_proj", h)
                              : torch::gelu(linear(w, layer + ".mlp.up_proj", h));
    x = x + linear(w, layer + ".mlp.down_proj", hidden);
  }
  x = norm(s, w, "model.norm", x);
  return torch::linear(
      x, s.tied_embeddings ? w.at("model.embed_tokens.weight") : w.at("lm_head.weight"));
}

int64_t measure_activation_bytes(const TransformerShape& s,
                                 const std::map<std::string, torch::Tensor>& weights,
                                 const torch::Tensor& tokens) {
  MemoryTracker tracker;
  torch::Tensor loss;
  {
    auto logits = forward(s, weights, tokens);  // freed at the end of this scope unless saved
    loss = torch::cross_entropy_loss(logits.view({-1, s.vocab_size}), tokens.view({-1}));
  }
  return tracker.current_bytes();  // what the autograd graph holds for backward (and the loss)
}

}  // namespace fivefold::ch02
