#pragma once
/// @file moe.h
/// @brief Chapter 07: Mixture-of-Experts (DeepSeek-V3's layer). A router scores every token
/// against E routed experts, each token goes to its k best (within its best groups), their outputs
/// are summed with renormalised, scaled gates, and shared experts see every token. Parameters grow
/// with E, FLOPs per token only with k. Load balancing with the Switch auxiliary loss or with
/// DeepSeek-V3's auxiliary-loss-free bias; optional capacity with token dropping. Hugging Face's
/// DeepseekV3 names and config keys.

#include <torch/torch.h>

#include <any>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "02_flops_6np/flops.h"
#include "03_transformer/model.h"
#include "fivefold/dist.h"

namespace fivefold::ch07 {

/// The MoE settings: DeepSeek-V3's config.json keys (kept in ch03::ModelConfig::extensions), with
/// Hugging Face's defaults (DeepSeek-V3's values), plus three training settings.
struct MoeConfig {
  int64_t n_routed_experts = 256;        ///< [n_routed_experts] E
  int64_t num_experts_per_tok = 8;       ///< [num_experts_per_tok] k
  int64_t n_shared_experts = 1;          ///< [n_shared_experts] one MLP of this many experts' width
  int64_t moe_intermediate_size = 2048;  ///< [moe_intermediate_size] each expert's hidden size
  std::string scoring_func = "sigmoid";  ///< [scoring_func] sigmoid (V3) or softmax (V2)
  bool norm_topk_prob = true;            ///< [norm_topk_prob] gates renormalised over the k
  double routed_scaling_factor = 2.5;    ///< [routed_scaling_factor] multiplies the gates
  int64_t n_group = 8;                   ///< [n_group] expert groups (node-limited routing)
  int64_t topk_group = 4;                ///< [topk_group] groups a token may choose from
  int64_t first_k_dense_replace = 3;     ///< [first_k_dense_replace] layers before: dense MLP
  int64_t moe_layer_freq = 1;            ///< [moe_layer_freq] every this many layers after
  double aux_loss_alpha = 0;     ///< [aux_loss_alpha] Switch auxiliary loss weight α (0: off)
  double bias_update_speed = 0;  ///< [fivefold_bias_update_speed] γ, V3's balancing (0: off)
  double capacity_factor = 0;    ///< [fivefold_capacity_factor] 0: dropless, else capacity

  /// Reads the keys from `extensions`, defaults for absent ones. Throws fivefold::Error naming a
  /// key of the wrong kind or an inconsistent value (k > E, groups not dividing E, ...).
  static MoeConfig from_json(const nlohmann::json& extensions);
  /// True when layer i has experts: i >= first_k_dense_replace and i % moe_layer_freq == 0.
  bool is_moe_layer(int64_t layer) const;
  /// Assignments each expert accepts out of `tokens` tokens: ceil(capacity_factor·k·tokens/E);
  /// -1 when dropless.
  int64_t capacity(int64_t tokens) const;
};

/// True when `config` describes routed experts (an `n_routed_experts` key that is not null in its
/// extensions): the one test of "is this a Mixture-of-Experts model" every chapter uses.
bool has_routed_experts(const ch03::ModelConfig& config);

/// Which experts each token goes to, and with what weight.
struct Routing {
  torch::Tensor experts;  ///< [tokens, k] int64, the chosen experts
  torch::Tensor gates;    ///< [tokens, k] their weights, differentiable with respect to scores
};

/// Top-k routing. `scores` [tokens, E] are the router's probabilities (sigmoid or softmax);
/// `bias` [E] is added for choosing only. With n_group > 1 a token first keeps its topk_group
/// best groups (a group's score: the sum of its two best biased scores) and may not choose
/// outside them. The k best biased scores name the experts; the gates are the *unbiased* scores of
/// those experts, divided by their sum when norm_topk_prob, times routed_scaling_factor.
/// **Exercise** (README, "The exercise").
Routing route(const torch::Tensor& scores, const torch::Tensor& bias, const MoeConfig& config);

/// The router, Hugging Face's `mlp.gate`: a linear map to E logits and the balancing bias.
class TopkRouterImpl : public torch::nn::Module {
 public:
  /// weight [E, d_model]; e_score_correction_bias [E] zeros.
  TopkRouterImpl(int64_t d_model, const MoeConfig& config);
  /// x [tokens, d_model] -> scores [tokens, E] (sigmoid or softmax of the logits).
  torch::Tensor scores(const torch::Tensor& x);
  torch::Tensor weight;  ///< [E, d_model]
  /// [E] float32, steers the choice only; changed by the balancing update, never by gradients
  /// (a parameter without gradient, so that checkpoints, resume and the parallel wrappers carry
  /// it as they carry weights; Hugging Face keeps it as a buffer under the same name).
  torch::Tensor e_score_correction_bias;

 private:
  std::string scoring_func_;
};
TORCH_MODULE(TopkRouter);

/// What one MoE layer saw since its counts were last reset (training forwards only).
struct ExpertLoad {
  torch::Tensor counts;     ///< [E] int64: assignments each expert received (before any dropping)
  int64_t assignments = 0;  ///< tokens x k
  int64_t dropped = 0;      ///< assignments beyond an expert's capacity (their output is lost)
  double aux_loss = 0;      ///< the last auxiliary loss (0 when α = 0)
};

/// The assignments an MoE layer's experts receive, grouped by expert: what dispatch hands to the
/// experts and combine takes back.
struct DispatchedTokens {
  torch::Tensor tokens;                  ///< [rows, d_model]: expert 0's tokens, then expert 1's...
  std::vector<int64_t> rows_per_expert;  ///< rows of `tokens` for each expert, in expert order
  torch::Tensor slots;  ///< [rows] int64: the assignment (token·k + choice) each row serves
  /// What a dispatcher needs in combine that the rows do not say (chapter 13: the sizes and order
  /// of its exchange); empty for LocalDispatcher.
  std::any route_back;
};

/// Moves tokens to their experts and the experts' outputs back: the two stages around the experts
/// that expert parallelism replaces (chapter 13 sends the tokens to the ranks holding their
/// experts with an all-to-all). Chapter 07's LocalDispatcher keeps everything on this process.
class TokenDispatcher {
 public:
  virtual ~TokenDispatcher() = default;
  /// x [tokens, d_model]; experts [tokens·k] int64, the expert of each assignment (token-major);
  /// kept [tokens·k] bool (false: dropped by capacity) -> the kept assignments' tokens grouped by
  /// expert, in token order within an expert.
  virtual DispatchedTokens dispatch(const torch::Tensor& x, const torch::Tensor& experts,
                                    const torch::Tensor& kept, int64_t n_experts) = 0;
  /// outputs [rows, d_model] of the experts for `dispatched`'s rows, gates [tokens·k] ->
  /// [tokens, d_model]: for each token, the sum over its kept assignments of gate x output.
  virtual torch::Tensor combine(const torch::Tensor& outputs, const DispatchedTokens& dispatched,
                                const torch::Tensor& gates, int64_t tokens, int64_t k) = 0;
};

/// Every expert on this process: dispatch sorts the assignments by expert (a stable sort) and
/// gathers their tokens; combine adds the gated outputs back to their tokens.
class LocalDispatcher : public TokenDispatcher {
 public:
  DispatchedTokens dispatch(const torch::Tensor& x, const torch::Tensor& experts,
                            const torch::Tensor& kept, int64_t n_experts) override;
  torch::Tensor combine(const torch::Tensor& outputs, const DispatchedTokens& dispatched,
                        const torch::Tensor& gates, int64_t tokens, int64_t k) override;
};

/// The routed experts a process holds: experts first .. first + count − 1 of the E (all of them
/// by default; chapter 13 gives each expert-parallel rank its own range).
struct ExpertRange {
  int64_t first = 0;   ///< the first expert held
  int64_t count = -1;  ///< experts held; -1: all from `first` on
};

/// DeepSeek-V3's MoE layer in chapter 03's MLP slot: `gate`, `experts.{j}` (chapter 03's SwiGLU
/// MLP with moe_intermediate_size), `shared_experts` (absent when n_shared_experts is 0).
class MoeImpl : public ch03::FeedForwardLayer {
 public:
  /// Sizes from the model (d_model) and `config`. `shared` fills the shared-experts slot when
  /// given (chapter 10: a tensor-parallel MLP of the same width); default chapter 03's MLP.
  /// `held`: the routed experts built here, registered under their global index (experts.{j}),
  /// so their names and initial weights are those of the whole layer's.
  MoeImpl(const ch03::ModelConfig& model, const MoeConfig& config,
          std::shared_ptr<ch03::FeedForwardLayer> shared = nullptr, ExpertRange held = {});
  /// x [batch, seq, d_model] -> same shape: Σ_k gate·expert(x) + shared(x), in four stages:
  /// route (the router and `route`), dispatch (the dispatcher), the experts (run_experts), combine
  /// (the dispatcher). In training (gradients on) it counts the load, and with α > 0 adds the
  /// auxiliary loss's gradient to the router's in backward, weighted as this forward's loss is
  /// in the step (ch03::LossWeightScope: with m micro-batches each counts 1/m, as on one batch;
  /// the loss value itself is reported in load(), not added to the model's).
  torch::Tensor forward(const torch::Tensor& x) override;
  /// The experts held on their tokens: the i-th expert held on the rows_per_expert[i] rows that
  /// follow the (i − 1)-th's -> outputs [rows, d_model] in the same order.
  torch::Tensor run_experts(const DispatchedTokens& dispatched);
  /// Routed expert j (global index); throws fivefold::Error when this layer does not hold it.
  ch03::MlpImpl& expert(int64_t j);
  /// The routed experts this layer holds.
  ExpertRange held_experts() const { return held_; }
  /// The routing of the last forward, gates detached (for tests and the demo).
  const Routing& last_routing() const { return last_routing_; }
  /// The load since the last reset.
  const ExpertLoad& load() const { return load_; }
  /// Auxiliary-loss-free balancing (DeepSeek-V3): bias_i += γ·sign(mean load − load_i) from the
  /// counts since the last call, then resets the counts. Returns the load it used. With `comm`
  /// (data parallelism), the counts are first summed over its ranks, so that every rank applies
  /// the update the whole global batch calls for and the biases stay equal.
  ExpertLoad update_bias(dist::Communicator* comm = nullptr);
  /// The settings.
  const MoeConfig& config() const { return config_; }

  TopkRouter gate{nullptr};       ///< the router
  torch::nn::ModuleDict experts;  ///< the routed experts held, keyed by global index ("0", ...)
  std::shared_ptr<ch03::FeedForwardLayer> shared_experts;  ///< always on; null when none
  /// Dispatch and combine (LocalDispatcher; chapter 13: all-to-all over the expert-parallel ranks).
  std::shared_ptr<TokenDispatcher> dispatcher = std::make_shared<LocalDispatcher>();

 private:
  MoeConfig config_;
  ExpertRange held_;
  Routing last_routing_;
  ExpertLoad load_;
};
TORCH_MODULE(Moe);

/// Parameters of a model: all of them, and those one token uses (everything outside the experts,
/// plus the router, k routed experts and the shared experts of each MoE layer).
struct MoeParameters {
  int64_t total = 0;   ///< numel of every parameter
  int64_t active = 0;  ///< per token
};

/// The counts from a config's dimensions (chapter 03's attention or chapter 06's MLA; dense or MoE
/// MLPs). DeepSeek-V3's config gives its published 671 B total, 37 B active.
MoeParameters count_parameters(const ch03::ModelConfig& config);

/// One block's parameters, by what multiplies a token and what does not.
struct BlockParameters {
  int64_t attention = 0;  ///< attention's weight matrices (grouped-query, or MLA's projections)
  int64_t output = 0;     ///< of those, the output projection (heads' values back to d_model)
  /// The MLP's matrices every token multiplies: the dense MLP, or a MoE layer's router and shared
  /// experts.
  int64_t mlp = 0;
  int64_t expert = 0;      ///< one routed expert's matrices (0 in a dense block)
  int64_t experts = 0;     ///< routed experts: E (0 in a dense block)
  int64_t per_token = 0;   ///< routed experts a token goes to: k (0 in a dense block)
  int64_t vectors = 0;     ///< what multiplies no token: the norms, the router's bias
  /// Of vectors, what no optimizer trains: the router's bias (the balancing rule moves it).
  int64_t frozen = 0;
  int64_t query_key = 0;   ///< a head's query and key width (MLA: nope + rope)
  int64_t value = 0;       ///< a head's value width
  /// Every parameter of the block.
  int64_t total() const { return attention + mlp + experts * expert + vectors; }
  /// Those one token uses.
  int64_t active() const { return attention + mlp + per_token * expert + vectors; }
};

/// Block `layer` (from 0) of `config`: count_parameters, one block at a time.
BlockParameters block_parameters(const ch03::ModelConfig& config, int64_t layer);

/// Forward matmul FLOPs one token spends in block `layer` of `config` at `context` tokens, by
/// component, counted as chapter 02 counts them: 2 a weight the token multiplies (k routed
/// experts, the router and the shared experts in a MoE layer; MLA's down- and up-projections in
/// qkv), and the full [context x context] square of scores as chapter 03's attention runs it
/// (heads x query/key width, heads x value width). lm_head is 0: the head is not a block's. For
/// a Llama config, equal to chapter 02's forward_flops_per_token over n_layers.
ch02::FlopBreakdown block_forward_flops(const ch03::ModelConfig& config, int64_t layer,
                                        int64_t context);

/// After each optimizer step (the training run's after_step, runtime/run.h): applies every MoE
/// layer's bias update and resets its counts. Returns, over the MoE layers, "moe_load" (each
/// layer's counts), "moe_layers" (the global index of the layer each entry of moe_load counts),
/// "moe_max_load" (the largest count over the mean, 1 = balanced), "moe_dropped" (share of the
/// assignments dropped) and "moe_aux_loss" (mean over layers); {} for a model without experts.
/// Under data parallelism pass the data-parallel communicator: loads are summed over it.
nlohmann::json after_step(ch03::Transformer& model, dist::Communicator* comm = nullptr);

/// DeepSeek-V3's architecture as its config.json describes it (the keys that fix parameters:
/// vocabulary 129,280, hidden 7,168, 61 layers, 128 heads, MLA ranks 1,536 / 512, 256 experts of
/// 2,048 with 8 active and 1 shared, the first 3 layers dense with 18,432), read through chapter
/// 03's config reader. For counting (count_parameters), not for building: 671 B parameters.
ch03::ModelConfig deepseek_v3_config();

/// Chapter 07's recipe: a config with MoE keys gets chapter 06's (MLA) and this chapter's experts
/// in its MoE layers (DeepSeek-V3 in miniature); any other config gets chapter 06's recipe. This
/// is the most complete recipe the chapters build: the commands use it.
ch03::ModelRecipe recipe(const ch03::ModelConfig& config);

/// The model (or `part` of it) from recipe(config); a ch03::ModelBuilder.
ch03::Transformer make_model(const ch03::ModelConfig& config, const ch03::ModelPart& part = {});

/// ch03::load_model with this chapter's make_model.
ch03::Transformer load_model(const std::string& dir);

}  // namespace fivefold::ch07
