// Chapter 07: Mixture-of-Experts. Routing by hand; with every expert chosen at equal weight the
// layer is the dense average; gradients (and the auxiliary loss's) reach the router; the bias
// update balances a skewed load; dropped tokens are counted exactly; forward FLOPs are those of
// the active parameters; parameter counts match numel and DeepSeek-V3's published figures;
// checkpoints carry DeepSeek-V3's names; a small MoE model trains with load statistics.

#include <cmath>
#include <fstream>

#include "02_flops_6np/flops.h"
#include "03_transformer/checkpoint.h"
#include "runtime/run.h"
#include "07_moe/moe.h"
#include "fivefold/error.h"
#include "fivefold/io.h"
#include "fivefold/seed.h"
#include "testing.h"

using namespace fivefold;
using namespace fivefold::ch07;
using fivefold::ch03::ModelConfig;
using fivefold::ch03::Transformer;
using fivefold::testing::ScratchDir;

namespace {
ModelConfig model_config() {
  ModelConfig c;
  c.d_model = 16;
  c.n_heads = c.n_kv_heads = 2;
  c.d_ff = 48;
  return c;
}

// A layer with E experts of width 8, k of them per token, no groups, no shared expert unless asked.
MoeConfig layer_config(int64_t experts, int64_t k) {
  MoeConfig c;
  c.n_routed_experts = experts;
  c.num_experts_per_tok = k;
  c.n_shared_experts = 0;
  c.moe_intermediate_size = 8;
  c.n_group = c.topk_group = 1;
  c.routed_scaling_factor = 1.0;
  c.first_k_dense_replace = 0;
  return c;
}

// Every matrix N(0, 1/fan_in): outputs of order one, so that a wrong gate shows.
Moe make_layer(const MoeConfig& config, uint64_t seed = 1) {
  Moe layer(model_config(), config);
  torch::NoGradGuard no_grad;
  auto g = generator_for(seed, "moe");
  for (auto& p : layer->parameters()) {
    if (p.dim() == 2)
      p.copy_(torch::randn(p.sizes(), g) / std::sqrt(static_cast<double>(p.size(1))));
  }
  return layer;
}

torch::Tensor inputs(int64_t tokens, uint64_t seed = 2) {
  return torch::randn({1, tokens, 16}, generator_for(seed, "x"));
}

// A DeepSeek-V3 in miniature: MLA, layer 0 dense, layers 1-2 with 8 experts (2 groups of 4,
// 1 group per token), 2 per token, one shared expert, sigmoid scores, gates scaled by 2.5.
ModelConfig tiny_model() {
  ModelConfig c;
  c.d_model = 32;
  c.n_layers = 3;
  c.n_heads = c.n_kv_heads = 4;
  c.d_ff = 64;
  c.rope_theta = 10000;
  c.extensions = {{"q_lora_rank", nullptr},
                  {"kv_lora_rank", 16},
                  {"qk_nope_head_dim", 8},
                  {"qk_rope_head_dim", 8},
                  {"v_head_dim", 8},
                  {"n_routed_experts", 8},
                  {"num_experts_per_tok", 2},
                  {"n_shared_experts", 1},
                  {"moe_intermediate_size", 16},
                  {"n_group", 2},
                  {"topk_group", 1},
                  {"first_k_dense_replace", 1},
                  {"routed_scaling_factor", 2.5},
                  {"fivefold_bias_update_speed", 0.001}};
  return c;
}
}  // namespace

TEST(Moe, RoutesByHand) {
  // One token, 8 experts in 4 groups of 2; keep 2 groups, choose 2 experts.
  auto c = layer_config(8, 2);
  c.n_group = 4;
  c.topk_group = 2;
  c.routed_scaling_factor = 2.0;
  const auto scores = torch::tensor({{0.9f, 0.1f, 0.5f, 0.45f, 0.8f, 0.0f, 0.3f, 0.3f}});
  // Group sums of the two best: 1.0, 0.95, 0.8, 0.6: groups 0 and 1 stay. Best two in them:
  // experts 0 (0.9) and 2 (0.5); expert 4 (0.8) is in a dropped group.
  auto r = route(scores, torch::zeros({8}), c);
  auto chosen = std::get<0>(r.experts.sort(-1));
  EXPECT_TENSOR_EQ(chosen, torch::tensor({{0L, 2L}}));
  // Gates: unbiased scores renormalised over the chosen, times 2: 0.9/1.4·2, 0.5/1.4·2.
  const auto order =
      r.experts[0][0].item<int64_t>() == 0 ? torch::tensor({0L, 1L}) : torch::tensor({1L, 0L});
  EXPECT_TENSOR_CLOSE(r.gates[0].index_select(0, order),
                      torch::tensor({0.9f / 1.4f * 2, 0.5f / 1.4f * 2}), 1e-6, 1e-6);
  // A bias changes the choice, not the weights: +0.5 on expert 3 puts group 1 first and makes
  // expert 3 (0.45 + 0.5) the best; its gate still uses 0.45.
  auto bias = torch::zeros({8});
  bias[3] = 0.5;
  r = route(scores, bias, c);
  chosen = std::get<0>(r.experts.sort(-1));
  EXPECT_TENSOR_EQ(chosen, torch::tensor({{0L, 3L}}));
  EXPECT_NEAR(r.gates.sum().item<double>(), 2.0, 1e-6);
  EXPECT_NEAR(r.gates.max().item<double>(), 0.9 / 1.35 * 2, 1e-6);
}

TEST(Moe, EveryExpertAtEqualWeightIsTheDenseAverage) {
  for (const char* scoring : {"sigmoid", "softmax"}) {
    SCOPED_TRACE(scoring);
    auto c = layer_config(4, 4);
    c.scoring_func = scoring;
    Moe layer = make_layer(c);
    torch::NoGradGuard no_grad;
    layer->gate->weight.zero_();  // every score equal: gates 1/4 each after renormalising
    const auto x = inputs(6);
    auto average = torch::zeros_like(x);
    for (const auto& expert : layer->experts->values())
      average += expert->as<ch03::MlpImpl>()->forward(x);
    EXPECT_TENSOR_CLOSE(layer->forward(x), average / 4, 1e-6, 1e-5);
  }
}

TEST(Moe, GradientsReachTheRouter) {
  // In float64, the router's gradient from autograd against central differences: the gates carry
  // the router's gradient (the choice itself is piecewise constant).
  auto c = layer_config(6, 2);
  Moe layer = make_layer(c);
  layer->to(torch::kDouble);
  const auto x = inputs(5).to(torch::kDouble);
  auto loss = [&] { return layer->forward(x).pow(2).sum(); };
  loss().backward();
  const auto grad = layer->gate->weight.grad().clone();
  EXPECT_GT(grad.abs().sum().item<double>(), 0);
  EXPECT_FALSE(layer->gate->e_score_correction_bias.grad().defined());
  torch::NoGradGuard no_grad;
  auto w = layer->gate->weight;
  for (int64_t i : {0, 7, 20, 33}) {
    const double eps = 1e-6, saved = w.view(-1)[i].item<double>();
    w.view(-1)[i] = saved + eps;
    const double up = loss().item<double>();
    w.view(-1)[i] = saved - eps;
    const double down = loss().item<double>();
    w.view(-1)[i] = saved;
    EXPECT_NEAR(grad.view(-1)[i].item<double>(), (up - down) / (2 * eps), 1e-6) << "element " << i;
  }
}

TEST(Moe, AuxiliaryLossAddsItsGradientToTheRouter) {
  // With α > 0 the router's gradient is the task's plus that of α·E·Σ f_i·P_i, computed here
  // separately from the same routing.
  auto c = layer_config(6, 2);
  c.aux_loss_alpha = 0.1;
  Moe with = make_layer(c);
  c.aux_loss_alpha = 0;
  Moe without = make_layer(c);
  const auto x = inputs(7);
  with->forward(x).pow(2).sum().backward();
  without->forward(x).pow(2).sum().backward();
  auto w = without->gate->weight.detach().clone().requires_grad_(true);
  const auto scores = torch::sigmoid(torch::nn::functional::linear(x.view({-1, 16}), w));
  const auto f =
      torch::bincount(without->last_routing().experts.reshape(-1), {}, 6).to(torch::kFloat) /
      (7.0 * 2);
  const auto aux = 0.1 * 6 * (f * (scores / scores.sum(-1, true)).mean(0)).sum();
  aux.backward();
  EXPECT_NEAR(with->load().aux_loss, aux.item<double>(), 1e-6);
  EXPECT_TENSOR_CLOSE(with->gate->weight.grad(), without->gate->weight.grad() + w.grad(), 1e-5,
                      1e-5);
}

TEST(Moe, AuxiliaryLossCountsAsItsMicroBatchDoes) {
  // Inside a step the auxiliary loss is weighted as the forward's micro-batch is
  // (ch03::LossWeightScope: its share of the rows times its loss weight), so that with m
  // micro-batches it counts as their mean, as the language-model loss does. The weight is the
  // one of the scope open at forward; backward may run after it closes. Shown to fail: a
  // gradient of 1 whatever the scope (chapter 07's first version, which counted it m times).
  auto c = layer_config(6, 2);
  c.aux_loss_alpha = 0.1;
  Moe with = make_layer(c);
  c.aux_loss_alpha = 0;
  Moe without = make_layer(c);
  const auto x = inputs(7);
  torch::Tensor loss;
  {
    ch03::LossWeightScope scope(0.25);
    loss = with->forward(x).pow(2).sum() * 0.25;
  }
  loss.backward();
  (without->forward(x).pow(2).sum() * 0.25).backward();
  auto w = without->gate->weight.detach().clone().requires_grad_(true);
  const auto scores = torch::sigmoid(torch::nn::functional::linear(x.view({-1, 16}), w));
  const auto f =
      torch::bincount(without->last_routing().experts.reshape(-1), {}, 6).to(torch::kFloat) /
      (7.0 * 2);
  (0.1 * 6 * (f * (scores / scores.sum(-1, true)).mean(0)).sum()).backward();
  EXPECT_TENSOR_CLOSE(with->gate->weight.grad(), without->gate->weight.grad() + 0.25 * w.grad(),
                      1e-5, 1e-5);
  EXPECT_EQ(ch03::LossWeightScope::current(), 1.0);  // closed: 1 again
}

TEST(Moe, BiasUpdateBalancesASkewedLoad) {
  // A router tilted towards experts 0 and 1 (their rows aligned with the inputs' mean), and no
  // learning: only DeepSeek-V3's bias update acts, once per batch of 64 tokens. Returns the max /
  // mean load of the first batch and the average over the last 50 of 300.
  auto run = [](double gamma) {
    auto c = layer_config(8, 2);
    c.bias_update_speed = gamma;
    Moe layer = make_layer(c);
    auto g = generator_for(5, "skew");
    const auto direction = torch::randn({16}, g);
    {
      torch::NoGradGuard no_grad;
      layer->gate->weight[0] += 2 * direction / direction.norm();
      layer->gate->weight[1] += 2 * direction / direction.norm();
    }
    auto imbalance = [&] {
      const auto x = torch::randn({1, 64, 16}, g) + direction / direction.norm();
      layer->forward(x);
      const auto load = layer->update_bias().counts.to(torch::kDouble);
      return (load.max() / load.mean()).item<double>();
    };
    const double first = imbalance();
    double last = 0;
    for (int step = 0; step < 300; ++step) {
      const double r = imbalance();
      if (step >= 250) last += r / 50;
    }
    return std::pair(first, last);
  };
  const auto [first, balanced] = run(0.01);
  const auto [same_first, unbalanced] = run(0);
  std::printf(
      "max/mean load: %.2f at the start; after 300 updates %.2f with the bias update, "
      "%.2f without\n",
      first, balanced, unbalanced);
  EXPECT_DOUBLE_EQ(first, same_first);
  EXPECT_GT(first, 2.5);  // skewed: 4 would be everything on two of eight experts
  EXPECT_LT(balanced, 1.5);
  EXPECT_GT(unbalanced, 2.5);
}

TEST(Moe, DroppedTokensAreCountedExactly) {
  for (double factor : {1.0, 1.25}) {
    SCOPED_TRACE("capacity factor " + std::to_string(factor));
    auto c = layer_config(4, 2);
    c.capacity_factor = factor;
    Moe layer = make_layer(c, 3);
    // Tilt the router towards expert 0 (its row along the inputs' mean) so that it overflows.
    const auto direction = torch::ones({16}) / 4.0;  // unit length
    {
      torch::NoGradGuard no_grad;
      layer->gate->weight[0] += 3 * direction;
    }
    const auto x = inputs(20, 4) + direction;
    auto out = layer->forward(x);
    const int64_t capacity = static_cast<int64_t>(std::ceil(factor * 2 * 20 / 4.0));
    EXPECT_EQ(c.capacity(20), capacity);
    const auto experts = layer->last_routing().experts;  // [20, 2]
    const auto counts = torch::bincount(experts.reshape(-1), {}, 4);
    const int64_t expected = (counts - capacity).clamp_min(0).sum().item<int64_t>();
    EXPECT_GT(expected, 0);  // the test means something only if something overflows
    EXPECT_EQ(layer->load().dropped, expected);
    // By hand: assignments in token order, each expert keeps its first `capacity`.
    torch::NoGradGuard no_grad;
    auto manual = torch::zeros({20, 16});
    std::vector<int64_t> taken(4, 0);
    const auto flat = x.view({20, 16});
    for (int64_t t = 0; t < 20; ++t) {
      for (int64_t s = 0; s < 2; ++s) {
        const int64_t e = experts[t][s].item<int64_t>();
        if (taken[e]++ >= capacity) continue;
        manual[t] +=
            layer->expert(e).forward(flat[t].unsqueeze(0))[0] * layer->last_routing().gates[t][s];
      }
    }
    EXPECT_TENSOR_CLOSE(out.view({20, 16}), manual, 1e-5, 1e-5);
  }
  Moe dropless = make_layer(layer_config(4, 2));
  dropless->forward(inputs(20, 4));
  EXPECT_EQ(dropless->load().dropped, 0);
}

TEST(Moe, ForwardFlopsAreThoseOfTheActiveParameters) {
  // Per token: 2 FLOPs per active matmul weight: the router (E·d), k routed experts and the
  // shared ones (3·d·width each), whatever E is.
  for (int64_t experts : {4, 16}) {
    auto c = layer_config(experts, 2);
    c.n_shared_experts = 1;
    Moe layer = make_layer(c);
    const int64_t tokens = 24, d = 16;
    torch::NoGradGuard no_grad;
    ch02::FlopCounter counter;
    layer->forward(inputs(tokens));
    const double active = experts * d + (2 + 1) * 3 * d * 8;
    EXPECT_DOUBLE_EQ(counter.flops(), 2.0 * tokens * active) << experts << " experts";
  }
}

TEST(Moe, ParameterCountsMatchNumelAndDeepSeekV3) {
  const auto config = tiny_model();
  Transformer model = make_model(config);
  int64_t numel = 0, unused = 0;
  for (const auto& p : model->parameters()) numel += p.numel();
  for (int64_t layer : {1, 2}) {  // the MoE layers: 8 experts, 2 used per token
    auto& moe = *model->block(layer).mlp->as<MoeImpl>();
    for (int64_t j = 2; j < 8; ++j)
      for (const auto& p : moe.expert(j).parameters()) unused += p.numel();
  }
  const auto counted = count_parameters(config);
  EXPECT_EQ(counted.total, numel);
  EXPECT_EQ(counted.active, numel - unused);
  // DeepSeek-V3's config.json (the keys that change parameters): 671 B total, 37 B active
  // (the paper's figures, without the 14 B multi-token-prediction module).
  const auto v3 = deepseek_v3_config();
  const auto p = count_parameters(v3);
  std::printf("DeepSeek-V3: %.1f B parameters, %.1f B active\n", p.total / 1e9, p.active / 1e9);
  EXPECT_NEAR(p.total / 1e9, 671, 1);
  EXPECT_NEAR(p.active / 1e9, 37, 1);
}

// block_forward_flops against chapter 02's counter on the whole model (MLA with and without the
// query latent, a dense first block, two MoE blocks, dropless): the forward is the blocks' sum
// plus the head, and a training step (forward and backward) three times that. A Llama config
// gives chapter 02's count, part by part.
TEST(Moe, BlockFlopsAreWhatTheModelMultiplies) {
  for (const nlohmann::json& q_lora : {nlohmann::json(nullptr), nlohmann::json(12)}) {
    auto config = tiny_model();
    config.extensions["q_lora_rank"] = q_lora;
    const int64_t batch = 2, seq = 6;
    SCOPED_TRACE("q_lora_rank " + q_lora.dump());
    double forward = 2.0 * config.d_model * config.vocab_size;  // the head
    for (int64_t layer = 0; layer < config.n_layers; ++layer)
      forward += block_forward_flops(config, layer, seq).total();
    Transformer model = make_model(config);
    auto tokens = torch::randint(0, config.vocab_size, {batch, seq}, generator_for(3, "tokens"));
    {
      torch::NoGradGuard no_grad;
      ch02::FlopCounter counter;
      model->forward(tokens);
      EXPECT_EQ(counter.flops(), batch * seq * forward);
    }
    ch02::FlopCounter counter;
    ch03::loss_of(model, {tokens, tokens}).backward();
    EXPECT_EQ(counter.flops(), 3 * batch * seq * forward);
  }
  ModelConfig llama;
  llama.vocab_size = 100;
  llama.d_model = 64;
  llama.n_layers = 3;
  llama.n_heads = 8;
  llama.n_kv_heads = 2;
  llama.d_ff = 96;
  const auto whole = ch02::forward_flops_per_token(llama.shape(), 10);
  const auto block = block_forward_flops(llama, 1, 10);
  EXPECT_DOUBLE_EQ(3 * block.qkv, whole.qkv);
  EXPECT_DOUBLE_EQ(3 * block.attention_scores, whole.attention_scores);
  EXPECT_DOUBLE_EQ(3 * block.attention_values, whole.attention_values);
  EXPECT_DOUBLE_EQ(3 * block.output_projection, whole.output_projection);
  EXPECT_DOUBLE_EQ(3 * block.mlp, whole.mlp);
  EXPECT_EQ(block.lm_head, 0);
}

TEST(Moe, CheckpointsCarryDeepSeekV3Names) {
  ScratchDir scratch("moe");
  const auto dir = scratch.path("checkpoint");
  Transformer model = make_model(tiny_model());
  ch03::save_model(dir, model);
  const auto tensors = io::load_safetensors(dir + "/model.safetensors");
  for (const char* name :
       {"model.layers.1.mlp.gate.weight", "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.1.mlp.experts.7.gate_proj.weight",
        "model.layers.2.mlp.experts.0.down_proj.weight",
        "model.layers.1.mlp.shared_experts.up_proj.weight",
        "model.layers.0.mlp.gate_proj.weight"}) {
    EXPECT_TRUE(tensors.count(name)) << name;
  }
  EXPECT_EQ(tensors.at("model.layers.1.mlp.gate.e_score_correction_bias").scalar_type(),
            torch::kFloat);
  EXPECT_EQ(tensors.at("model.layers.1.mlp.shared_experts.up_proj.weight").sizes(),
            (std::vector<int64_t>{16, 32}));
  EXPECT_FALSE(tensors.count("model.layers.0.mlp.gate.weight"));  // layer 0 stays dense
  const auto json = io::read_json(dir + "/config.json");
  EXPECT_EQ(json["n_routed_experts"], 8);
  EXPECT_EQ(json["first_k_dense_replace"], 1);
  Transformer loaded = load_model(dir);
  const auto tokens = torch::randint(0, 259, {2, 12}, generator_for(6, "tokens"));
  torch::NoGradGuard no_grad;
  EXPECT_TENSOR_EQ(loaded(tokens), model(tokens));
}

TEST(Moe, SmallModelTrainsAndReportsItsLoad) {
  ScratchDir scratch("moe_run");
  runtime::RunConfig c;
  c.model = tiny_model();
  c.build_model = make_model;
  c.after_step = [](Transformer& m) { return after_step(m); };
  c.steps = c.train.total_steps = 40;
  c.train.warmup_steps = 4;
  c.seq_len = 32;
  c.batch = 8;
  c.eval_every = 0;
  c.save_every = 0;
  c.progress = false;
  c.out_dir = scratch.path("run");
  const auto result = runtime::run_training(c);
  EXPECT_LT(result.losses.back(), result.losses.front() - 1.5);
  // Every training line reports the load of both MoE layers: 8 counts summing to tokens x k.
  std::ifstream metrics(c.out_dir + "/metrics.jsonl");
  std::string line;
  int64_t lines = 0;
  while (std::getline(metrics, line)) {
    const auto record = nlohmann::json::parse(line);
    if (record["kind"] != "train") continue;
    ++lines;
    ASSERT_EQ(record["moe_load"].size(), 2u);
    for (const auto& counts : record["moe_load"]) {
      int64_t sum = 0;
      for (const auto& n : counts) sum += n.get<int64_t>();
      EXPECT_EQ(sum, 8 * 32 * 2);
    }
    EXPECT_GE(record["moe_max_load"].get<double>(), 1.0);
    EXPECT_EQ(record["moe_dropped"].get<double>(), 0.0);
  }
  EXPECT_EQ(lines, 40);
  // The bias moved (γ = 0.001 per step) and training never touched it otherwise.
  auto bias = ch07::load_model(result.checkpoint)
                  ->named_parameters()["model.layers.1.mlp.gate.e_score_correction_bias"];
  EXPECT_GT(bias.abs().max().item<double>(), 0);
  EXPECT_LE(bias.abs().max().item<double>(), 40 * 0.001 + 1e-6);
}

// A layer may hold only some of its routed experts (chapter 13 gives each expert-parallel rank a
// range): they keep their global names, experts.{j}, and so the whole model's initial weights;
// the other experts are not built; a dispatcher that keeps every token here cannot serve them.
TEST(MoeParts, HeldExpertsKeepTheirGlobalNamesAndWeights) {
  const auto config = tiny_model();
  Transformer whole = make_model(config);
  const auto moe = MoeConfig::from_json(config.extensions);
  ch03::ModelRecipe r = recipe(config);
  r.mlp = [moe](const ch03::ModelConfig& c,
                int64_t layer) -> std::shared_ptr<ch03::FeedForwardLayer> {
    if (!moe.is_moe_layer(layer)) return nullptr;
    return std::make_shared<MoeImpl>(c, moe, nullptr, ExpertRange{2, 4});  // experts 2 .. 5
  };
  Transformer part(config, r);
  auto want = whole->named_parameters();
  int64_t held = 0;
  for (const auto& item : part->named_parameters()) {
    ASSERT_TRUE(want.contains(item.key())) << item.key();
    EXPECT_TENSOR_EQ(item.value(), want[item.key()]);
    if (item.key().find(".experts.") != std::string::npos) ++held;
  }
  EXPECT_EQ(held, 2 * 4 * 3);  // 2 MoE layers x 4 experts x 3 matrices
  EXPECT_TRUE(part->named_parameters().contains("model.layers.1.mlp.experts.5.up_proj.weight"));
  EXPECT_FALSE(part->named_parameters().contains("model.layers.1.mlp.experts.6.up_proj.weight"));
  auto& layer = *part->block(1).mlp->as<MoeImpl>();
  EXPECT_EQ(layer.held_experts().first, 2);
  EXPECT_THROW(layer.expert(6), fivefold::Error);
  const auto tokens = torch::randint(config.vocab_size, {2, 8}, generator_for(0, "tokens"));
  EXPECT_THROW(part->forward(tokens), fivefold::Error);  // LocalDispatcher groups all 8 experts
  EXPECT_THROW(MoeImpl(config, moe, nullptr, ExpertRange{6, 4}), fivefold::Error);  // 6 .. 9 of 8
}
