// Chapter 07 plumbing: the MoE config, the router module, the layer around route(), balancing,
// statistics, parameter counts and the model recipe.

#include <cmath>

#include "03_transformer/checkpoint.h"
#include "03_transformer/train.h"
#include "06_mla/mla.h"
#include "07_moe/moe.h"
#include "fivefold/error.h"

namespace fivefold::ch07 {

namespace {
int64_t integer_or(const nlohmann::json& json, const char* key, int64_t fallback, int64_t minimum) {
  if (!json.contains(key) || json[key].is_null()) return fallback;
  FIVEFOLD_CHECK(json[key].is_number_integer() && json[key].get<int64_t>() >= minimum, "config: '",
                 key, "' must be an integer >= ", minimum, ", got ", json[key].dump());
  return json[key].get<int64_t>();
}

double number_or(const nlohmann::json& json, const char* key, double fallback) {
  if (!json.contains(key) || json[key].is_null()) return fallback;
  FIVEFOLD_CHECK(json[key].is_number() && json[key].get<double>() >= 0, "config: '", key,
                 "' must be a number >= 0, got ", json[key].dump());
  return json[key].get<double>();
}

// Autograd's way to add a loss that is not part of the model's output: forward passes `output`
// through; backward also hands `aux` a gradient of w, as if w·aux had been added to the final
// loss, w the weight of this forward's micro-batch in the step (ch03::LossWeightScope; 1 alone).
class AddAuxiliaryLoss : public torch::autograd::Function<AddAuxiliaryLoss> {
 public:
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor output,
                               torch::Tensor aux) {
    ctx->saved_data["weight"] = ch03::LossWeightScope::current();
    return output.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    return {grads[0], torch::full({}, ctx->saved_data["weight"].toDouble())};
  }
};

ch03::ModelConfig with_width(const ch03::ModelConfig& model, int64_t d_ff) {
  ch03::ModelConfig c = model;
  c.d_ff = d_ff;
  return c;
}
}  // namespace

MoeConfig MoeConfig::from_json(const nlohmann::json& e) {
  FIVEFOLD_CHECK(e.is_object(), "config: MoE needs the deepseek_v3 keys (n_routed_experts, ...)");
  MoeConfig c;
  c.n_routed_experts = integer_or(e, "n_routed_experts", c.n_routed_experts, 1);
  c.num_experts_per_tok = integer_or(e, "num_experts_per_tok", c.num_experts_per_tok, 1);
  c.n_shared_experts = integer_or(e, "n_shared_experts", c.n_shared_experts, 0);
  c.moe_intermediate_size = integer_or(e, "moe_intermediate_size", c.moe_intermediate_size, 1);
  if (e.contains("scoring_func") && !e["scoring_func"].is_null()) {
    FIVEFOLD_CHECK(e["scoring_func"] == "sigmoid" || e["scoring_func"] == "softmax",
                   "config: 'scoring_func' must be \"sigmoid\" or \"softmax\", got ",
                   e["scoring_func"].dump());
    c.scoring_func = e["scoring_func"];
  }
  if (e.contains("norm_topk_prob") && !e["norm_topk_prob"].is_null()) {
    FIVEFOLD_CHECK(e["norm_topk_prob"].is_boolean(),
                   "config: 'norm_topk_prob' must be true or "
                   "false");
    c.norm_topk_prob = e["norm_topk_prob"];
  }
  c.routed_scaling_factor = number_or(e, "routed_scaling_factor", c.routed_scaling_factor);
  c.n_group = integer_or(e, "n_group", c.n_group, 1);
  c.topk_group = integer_or(e, "topk_group", c.topk_group, 1);
  c.first_k_dense_replace = integer_or(e, "first_k_dense_replace", c.first_k_dense_replace, 0);
  c.moe_layer_freq = integer_or(e, "moe_layer_freq", c.moe_layer_freq, 1);
  c.aux_loss_alpha = number_or(e, "aux_loss_alpha", c.aux_loss_alpha);
  c.bias_update_speed = number_or(e, "fivefold_bias_update_speed", c.bias_update_speed);
  c.capacity_factor = number_or(e, "fivefold_capacity_factor", c.capacity_factor);
  FIVEFOLD_CHECK(c.num_experts_per_tok <= c.n_routed_experts, "config: num_experts_per_tok (",
                 c.num_experts_per_tok, ") exceeds n_routed_experts (", c.n_routed_experts, ")");
  FIVEFOLD_CHECK(c.n_routed_experts % c.n_group == 0, "config: n_group (", c.n_group,
                 ") must divide n_routed_experts (", c.n_routed_experts, ")");
  FIVEFOLD_CHECK(c.topk_group <= c.n_group, "config: topk_group (", c.topk_group,
                 ") exceeds n_group (", c.n_group, ")");
  FIVEFOLD_CHECK(c.num_experts_per_tok <= c.topk_group * (c.n_routed_experts / c.n_group),
                 "config: num_experts_per_tok (", c.num_experts_per_tok,
                 ") exceeds the experts in topk_group groups");
  return c;
}

bool has_routed_experts(const ch03::ModelConfig& config) {
  const auto& e = config.extensions;
  return e.is_object() && e.contains("n_routed_experts") && !e["n_routed_experts"].is_null();
}

bool MoeConfig::is_moe_layer(int64_t layer) const {
  return layer >= first_k_dense_replace && layer % moe_layer_freq == 0;
}

int64_t MoeConfig::capacity(int64_t tokens) const {
  if (capacity_factor <= 0) return -1;
  return static_cast<int64_t>(
      std::ceil(capacity_factor * static_cast<double>(num_experts_per_tok * tokens) /
                static_cast<double>(n_routed_experts)));
}

TopkRouterImpl::TopkRouterImpl(int64_t d_model, const MoeConfig& config)
    : scoring_func_(config.scoring_func) {
  // N(0, 0.02²) from the global generator; a model redraws it by name (chapter 01's init).
  weight = register_parameter("weight", 0.02 * torch::randn({config.n_routed_experts, d_model}));
  e_score_correction_bias = register_parameter(
      "e_score_correction_bias", torch::zeros({config.n_routed_experts}), /*requires_grad=*/false);
}

torch::Tensor TopkRouterImpl::scores(const torch::Tensor& x) {
  // [tokens, E], in x's type (fp32): a router weight kept in bf16 is widened.
  auto logits = torch::nn::functional::linear(x, weight.to(x.scalar_type()));
  return scoring_func_ == "sigmoid" ? torch::sigmoid(logits) : torch::softmax(logits, -1);
}

MoeImpl::MoeImpl(const ch03::ModelConfig& model, const MoeConfig& config,
                 std::shared_ptr<ch03::FeedForwardLayer> shared, ExpertRange held)
    : config_(config), held_(held) {
  if (held_.count < 0) held_.count = config.n_routed_experts - held_.first;
  FIVEFOLD_CHECK(
      held_.first >= 0 && held_.count >= 0 && held_.first + held_.count <= config.n_routed_experts,
      "MoE: experts [", held_.first, ", ", held_.first + held_.count,
      ") are not within the layer's ", config.n_routed_experts);
  gate = register_module("gate", TopkRouter(model.d_model, config));
  experts = register_module("experts", torch::nn::ModuleDict());
  const auto expert = with_width(model, config.moe_intermediate_size);
  for (int64_t j = held_.first; j < held_.first + held_.count; ++j) {
    // Registered as experts.{j}, the global index, whichever experts this layer holds.
    experts->update(std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>>{
        {std::to_string(j), ch03::Mlp(expert).ptr()}});
  }
  if (config.n_shared_experts > 0) {
    if (!shared) {
      shared = std::make_shared<ch03::MlpImpl>(
          with_width(model, config.n_shared_experts * config.moe_intermediate_size));
    }
    shared_experts = register_module("shared_experts", std::move(shared));
  }
  load_.counts = torch::zeros({config.n_routed_experts}, torch::kLong);
}

torch::Tensor MoeImpl::forward(const torch::Tensor& input) {
  const auto& c = config_;
  const int64_t d = input.size(-1), k = c.num_experts_per_tok;
  const auto x = input.reshape({-1, d});  // [tokens, d]
  const int64_t tokens = x.size(0);
  const auto scores = gate->scores(x);  // [tokens, E]
  const Routing routing = route(scores, gate->e_score_correction_bias, c);
  last_routing_ = {routing.experts, routing.gates.detach()};  // kept without the graph
  auto experts_of = routing.experts.reshape(-1);              // [tokens·k], token-major
  auto gates = routing.gates.reshape(-1);

  // Capacity: each expert takes its assignments in token order until it is full; the rest are
  // dropped (their gate's output is lost; the residual stream carries the token on).
  auto kept = torch::ones({tokens * k}, torch::kBool);
  const int64_t capacity = c.capacity(tokens);
  if (capacity >= 0) {
    auto one_hot = torch::one_hot(experts_of, c.n_routed_experts);  // [tokens·k, E]
    auto place = (one_hot.cumsum(0) * one_hot).sum(-1) - 1;         // rank within its expert
    kept = place < capacity;
  }

  // Dispatch the kept assignments to their experts, run them, combine the gated outputs.
  const DispatchedTokens dispatched = dispatcher->dispatch(x, experts_of, kept, c.n_routed_experts);
  auto out = dispatcher->combine(run_experts(dispatched), dispatched, gates, tokens, k);
  // The shared experts see every token, in the input's own shape ([batch, seq, d]: a
  // tensor-parallel shared expert gathers the sequence).
  if (shared_experts) out = out + shared_experts->forward(input).reshape({-1, d});

  if (torch::GradMode::is_enabled()) {  // training: count the load, balance
    const auto counts = torch::bincount(experts_of, {}, c.n_routed_experts);
    load_.counts += counts;
    load_.assignments += tokens * k;
    load_.dropped += (tokens * k) - kept.sum().item<int64_t>();
    if (c.aux_loss_alpha > 0) {
      // Switch: α·E·Σ f_i·P_i, f_i the share of assignments expert i got (not differentiable),
      // P_i its mean probability (scores normalised per token, as DeepSeek normalises sigmoids).
      const auto f = counts.to(torch::kFloat) / static_cast<double>(tokens * k);
      const auto p = (scores / scores.sum(-1, true)).mean(0);
      const auto aux = c.aux_loss_alpha * c.n_routed_experts * (f * p).sum();
      load_.aux_loss = aux.item<double>();
      out = AddAuxiliaryLoss::apply(out, aux);
    }
  }
  return out.view(input.sizes());
}

torch::Tensor MoeImpl::run_experts(const DispatchedTokens& dispatched) {
  FIVEFOLD_CHECK(static_cast<int64_t>(dispatched.rows_per_expert.size()) == held_.count,
                 "MoE: the dispatcher grouped tokens for ", dispatched.rows_per_expert.size(),
                 " experts, this layer holds ", held_.count, " (experts [", held_.first, ", ",
                 held_.first + held_.count,
                 "): a layer holding some experts needs an expert-parallel dispatcher)");
  const auto pieces = dispatched.tokens.split_with_sizes(dispatched.rows_per_expert);
  std::vector<torch::Tensor> outputs;
  for (size_t i = 0; i < pieces.size(); ++i) {
    // An expert that received no token computes nothing (and gets no gradient).
    if (pieces[i].size(0) > 0)
      outputs.push_back(expert(held_.first + static_cast<int64_t>(i)).forward(pieces[i]));
  }
  return outputs.empty() ? dispatched.tokens : torch::cat(outputs);  // [rows, d_model]
}

ch03::MlpImpl& MoeImpl::expert(int64_t j) {
  const std::string key = std::to_string(j);
  FIVEFOLD_CHECK(experts->contains(key), "MoE: expert ", j, " is not held here (experts [",
                 held_.first, ", ", held_.first + held_.count, "))");
  return *experts[key]->as<ch03::MlpImpl>();
}

DispatchedTokens LocalDispatcher::dispatch(const torch::Tensor& x, const torch::Tensor& experts,
                                           const torch::Tensor& kept, int64_t n_experts) {
  const int64_t k = x.size(0) > 0 ? experts.size(0) / x.size(0) : 1;  // assignments per token
  DispatchedTokens d;
  const auto kept_slots = kept.nonzero().squeeze(1);  // [kept], in token order
  // Stable: within an expert the assignments keep their token order.
  const auto order =
      std::get<1>(experts.index_select(0, kept_slots).sort(c10::optional<bool>(true), 0));
  d.slots = kept_slots.index_select(0, order);
  d.tokens = x.index_select(0, d.slots.div(k, "floor"));  // [rows, d_model]
  const auto counts = torch::bincount(experts.index_select(0, d.slots), {}, n_experts);
  d.rows_per_expert.assign(counts.data_ptr<int64_t>(), counts.data_ptr<int64_t>() + n_experts);
  return d;
}

torch::Tensor LocalDispatcher::combine(const torch::Tensor& outputs,
                                       const DispatchedTokens& dispatched,
                                       const torch::Tensor& gates, int64_t tokens, int64_t k) {
  const auto token_of = dispatched.slots.div(k, "floor");
  const auto weighted = outputs * gates.index_select(0, dispatched.slots).unsqueeze(1);
  return torch::zeros({tokens, outputs.size(1)}, weighted.options())  // the gates' type
      .index_add(0, token_of, weighted);
}

ExpertLoad MoeImpl::update_bias(dist::Communicator* comm) {
  ExpertLoad used = load_;
  if (comm != nullptr && comm->size() > 1) {  // the global batch's load, on every rank
    auto totals = torch::cat({used.counts, torch::tensor({used.assignments, used.dropped})});
    comm->all_reduce(totals);
    used.counts = totals.narrow(0, 0, config_.n_routed_experts).clone();
    used.assignments = totals[config_.n_routed_experts].item<int64_t>();
    used.dropped = totals[config_.n_routed_experts + 1].item<int64_t>();
  }
  if (config_.bias_update_speed > 0 && used.assignments > 0) {
    torch::NoGradGuard no_grad;
    const auto load = used.counts.to(torch::kFloat);
    // Overloaded experts become less attractive, underloaded ones more, by γ each step.
    gate->e_score_correction_bias.add_(config_.bias_update_speed * torch::sign(load.mean() - load));
  }
  load_ = ExpertLoad{};
  load_.counts = torch::zeros({config_.n_routed_experts}, torch::kLong);
  return used;
}

BlockParameters block_parameters(const ch03::ModelConfig& c, int64_t layer) {
  const int64_t d = c.d_model, h = c.n_heads;
  BlockParameters b;
  b.vectors = 2 * d;                                                       // the two norms
  if (!c.extensions.is_null() && c.extensions.contains("kv_lora_rank")) {  // MLA (chapter 06)
    const auto m = ch06::MlaConfig::from_json(c.extensions);
    b.query_key = m.qk_nope_head_dim + m.qk_rope_head_dim;
    b.value = m.v_head_dim;
    const int64_t query = m.q_lora_rank > 0 ? d * m.q_lora_rank + m.q_lora_rank * h * b.query_key
                                            : d * h * b.query_key;
    b.output = h * m.v_head_dim * d;
    b.attention = query + d * (m.kv_lora_rank + m.qk_rope_head_dim) +
                  m.kv_lora_rank * h * (m.qk_nope_head_dim + m.v_head_dim) + b.output;
    b.vectors += m.q_lora_rank + m.kv_lora_rank;  // the latents' norms (none without q_lora)
  } else {                                        // chapter 03's grouped-query attention
    b.query_key = b.value = c.resolved_head_dim();
    b.output = h * b.value * d;
    b.attention = d * h * b.query_key + 2 * d * c.n_kv_heads * b.value + b.output;
  }
  const MoeConfig e = has_routed_experts(c) ? MoeConfig::from_json(c.extensions) : MoeConfig{};
  if (has_routed_experts(c) && e.is_moe_layer(layer)) {
    b.expert = 3 * d * e.moe_intermediate_size;
    b.experts = e.n_routed_experts;
    b.per_token = e.num_experts_per_tok;
    b.mlp = e.n_routed_experts * d + e.n_shared_experts * b.expert;  // router, shared experts
    b.vectors += e.n_routed_experts;                                 // the router's bias
    b.frozen = e.n_routed_experts;
  } else {
    b.mlp = 3 * d * c.d_ff;
  }
  return b;
}

MoeParameters count_parameters(const ch03::ModelConfig& c) {
  MoeParameters p;
  p.total = c.vocab_size * c.d_model * (c.tied_embeddings ? 1 : 2) + c.d_model;  // + final norm
  p.active = p.total;
  for (int64_t i = 0; i < c.n_layers; ++i) {
    const BlockParameters b = block_parameters(c, i);
    p.total += b.total();
    p.active += b.active();
  }
  return p;
}

ch02::FlopBreakdown block_forward_flops(const ch03::ModelConfig& c, int64_t layer,
                                        int64_t context) {
  const BlockParameters b = block_parameters(c, layer);
  ch02::FlopBreakdown f;
  f.qkv = 2.0 * (b.attention - b.output);
  f.output_projection = 2.0 * b.output;
  f.attention_scores = 2.0 * c.n_heads * b.query_key * context;
  f.attention_values = 2.0 * c.n_heads * b.value * context;
  f.mlp = 2.0 * (b.mlp + b.per_token * b.expert);
  return f;
}

nlohmann::json after_step(ch03::Transformer& model, dist::Communicator* comm) {
  nlohmann::json loads = nlohmann::json::array(), layers = nlohmann::json::array();
  double max_load = 0, dropped = 0, assignments = 0, aux = 0;
  for (int64_t i : model->layer_indices()) {
    auto moe = std::dynamic_pointer_cast<MoeImpl>(model->block(i).mlp);
    if (!moe) continue;
    const ExpertLoad load = moe->update_bias(comm);
    if (load.assignments == 0) continue;
    const auto counts = load.counts.to(torch::kDouble);
    max_load = std::max(max_load, (counts.max() / counts.mean()).item<double>());
    dropped += static_cast<double>(load.dropped);
    assignments += static_cast<double>(load.assignments);
    aux += load.aux_loss;
    loads.push_back(std::vector<int64_t>(load.counts.data_ptr<int64_t>(),
                                         load.counts.data_ptr<int64_t>() + load.counts.numel()));
    layers.push_back(i);
  }
  if (loads.empty()) return nlohmann::json::object();
  return {{"moe_load", loads},
          {"moe_layers", layers},
          {"moe_max_load", max_load},
          {"moe_dropped", dropped / assignments},
          {"moe_aux_loss", aux / static_cast<double>(loads.size())}};
}

ch03::ModelConfig deepseek_v3_config() {
  return ch03::config_from_json(nlohmann::json{{"model_type", "deepseek_v3"},
                                               {"vocab_size", 129280},
                                               {"hidden_size", 7168},
                                               {"intermediate_size", 18432},
                                               {"num_hidden_layers", 61},
                                               {"num_attention_heads", 128},
                                               {"num_key_value_heads", 128},
                                               {"q_lora_rank", 1536},
                                               {"kv_lora_rank", 512},
                                               {"qk_nope_head_dim", 128},
                                               {"qk_rope_head_dim", 64},
                                               {"v_head_dim", 128},
                                               {"n_routed_experts", 256},
                                               {"num_experts_per_tok", 8},
                                               {"n_shared_experts", 1},
                                               {"moe_intermediate_size", 2048},
                                               {"first_k_dense_replace", 3},
                                               {"n_group", 8},
                                               {"topk_group", 4},
                                               {"tie_word_embeddings", false}});
}

ch03::ModelRecipe recipe(const ch03::ModelConfig& config) {
  ch03::ModelRecipe r = ch06::recipe(config);
  if (!has_routed_experts(config)) return r;
  const MoeConfig moe = MoeConfig::from_json(config.extensions);
  r.mlp = [moe](const ch03::ModelConfig& c,
                int64_t layer) -> std::shared_ptr<ch03::FeedForwardLayer> {
    if (!moe.is_moe_layer(layer)) return nullptr;  // a dense layer: chapter 03's MLP
    return std::make_shared<MoeImpl>(c, moe);
  };
  return r;
}

ch03::Transformer make_model(const ch03::ModelConfig& config, const ch03::ModelPart& part) {
  return ch03::Transformer(config, recipe(config), part);
}

ch03::Transformer load_model(const std::string& dir) { return ch03::load_model(dir, make_model); }

}  // namespace fivefold::ch07
