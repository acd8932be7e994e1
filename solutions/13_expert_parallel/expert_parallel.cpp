// Chapter 13 plumbing: where the experts live, the groups, the all-to-all inside autograd, the
// recipe, the map of gradient groups and the traffic formula.

#include "10_tensor_parallel/mappings.h"
#include "13_expert_parallel/expert_parallel.h"
#include "fivefold/error.h"

namespace fivefold::ch13 {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Forward: rows to their ranks; backward: the gradient rows back to where they came from (the
// same exchange with send and receive sizes swapped).
class AllToAll : public torch::autograd::Function<AllToAll> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x,
                               std::vector<int64_t> send_sizes, std::vector<int64_t> recv_sizes,
                               dist::CommunicatorPtr ep) {
    ch10::save_communicator(ctx, ep);
    ctx->saved_data["send"] = send_sizes;
    ctx->saved_data["recv"] = recv_sizes;
    return ep->all_to_all(x, send_sizes, recv_sizes);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto send = ctx->saved_data["send"].toIntVector();
    const auto recv = ctx->saved_data["recv"].toIntVector();
    return {ch10::saved_communicator(ctx)->all_to_all(grads[0], recv, send), torch::Tensor(),
            torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

ch07::ExpertRange expert_range(int64_t n_experts, int64_t ep, int64_t rank) {
  FIVEFOLD_CHECK(ep >= 1 && n_experts % ep == 0 && 0 <= rank && rank < ep, "expert_range: ",
                 n_experts, " experts do not split over ", ep, " ranks (rank ", rank, ")");
  const int64_t per_rank = n_experts / ep;
  return {rank * per_rank, per_rank};
}

void check_expert_parallel(const ch03::ModelConfig& config, int64_t ep, int64_t data_ranks) {
  FIVEFOLD_CHECK(ep >= 1, "--ep must be at least 1, got ", ep);
  if (ep == 1) return;
  FIVEFOLD_CHECK(ch07::has_routed_experts(config), "--ep ", ep,
                 ": the model has no routed experts to distribute (give a Mixture-of-Experts "
                 "--model-config, e.g. deepseek_v3 keys with n_routed_experts)");
  const auto moe = ch07::MoeConfig::from_json(config.extensions);
  FIVEFOLD_CHECK(moe.n_routed_experts % ep == 0, "--ep ", ep, ": the ", moe.n_routed_experts,
                 " routed experts of each layer must split evenly over the expert-parallel "
                 "ranks (each rank holds E/ep whole experts)");
  FIVEFOLD_CHECK(data_ranks % ep == 0, "--ep ", ep, " does not divide the ", data_ranks,
                 " data-parallel ranks (dp x cp) it folds into: the ranks of an expert-parallel "
                 "group are data-parallel ranks that exchange their tokens");
}

torch::Tensor all_to_all(const torch::Tensor& x, const std::vector<int64_t>& send_sizes,
                         const std::vector<int64_t>& recv_sizes, const dist::CommunicatorPtr& ep) {
  return AllToAll::apply(x, send_sizes, recv_sizes, ep);
}

ExpertParallel make_expert_parallel(const dist::CommunicatorPtr& data, int64_t ep) {
  FIVEFOLD_CHECK(ep >= 1 && data->size() % ep == 0, "expert parallelism: ep ", ep,
                 " does not divide the ", data->size(), " data-parallel ranks");
  const int r = data->rank(), e = static_cast<int>(ep);
  ExpertParallel g;
  g.ep = data->split(r / e, r % e, "ep");    // consecutive ranks exchange tokens
  g.edp = data->split(r % e, r / e, "edp");  // the same place in every group: the same experts
  return g;
}

ch03::ModelRecipe recipe(const ch03::ModelConfig& config, const ExpertParallel& group) {
  ch03::ModelRecipe r = ch07::recipe(config);
  if (!ch07::has_routed_experts(config)) return r;
  const auto moe = ch07::MoeConfig::from_json(config.extensions);
  const auto held = expert_range(moe.n_routed_experts, group.ep->size(), group.ep->rank());
  r.mlp = [moe, held, ep = group.ep](const ch03::ModelConfig& c,
                                     int64_t layer) -> std::shared_ptr<ch03::FeedForwardLayer> {
    if (!moe.is_moe_layer(layer)) return nullptr;  // a dense layer: chapter 03's MLP
    auto layer_moe = std::make_shared<ch07::MoeImpl>(c, moe, nullptr, held);
    layer_moe->dispatcher = std::make_shared<ExpertParallelDispatcher>(ep);
    return layer_moe;
  };
  return r;
}

ch03::Transformer make_model(const ch03::ModelConfig& config, const ExpertParallel& group,
                             const ch03::ModelPart& part) {
  return ch03::Transformer(config, recipe(config, group), part);
}

void adapt_moe_layers(ch03::Transformer& model, const ExpertParallel& group) {
  const auto& config = model->config();
  if (!ch07::has_routed_experts(config)) return;
  const auto moe = ch07::MoeConfig::from_json(config.extensions);
  const auto held = expert_range(moe.n_routed_experts, group.ep->size(), group.ep->rank());
  for (int64_t i : model->layer_indices()) {
    auto whole = std::dynamic_pointer_cast<ch07::MoeImpl>(model->block(i).mlp);
    if (!whole || whole->held_experts().count != moe.n_routed_experts) continue;
    // Only the held experts are built; the router and the shared experts (chapter 10's
    // tensor-parallel MLP) are the layer's own.
    auto mine = std::make_shared<ch07::MoeImpl>(config, whole->config(), whole->shared_experts,
                                                held);
    mine->dispatcher = std::make_shared<ExpertParallelDispatcher>(group.ep);
    model->block(i).set_mlp(mine);
  }
}

bool is_expert_parameter(const std::string& name) {
  return name.find(".experts.") != std::string::npos;
}

void add_expert_parallel_groups(ch03::Transformer& model, const ExpertParallel& group,
                                ch09::ModelParallelGroups& groups) {
  if (group.ep->size() == 1) return;
  for (const auto& item : model->named_parameters()) {
    if (!item.value().requires_grad() || is_expert_parameter(item.key())) continue;
    // The same tensor on every ep rank, each rank's gradient from its own tokens: summed over ep,
    // then identical there, so counted once.
    groups.partial.emplace(item.key(), group.ep);
    if (group.ep->rank() != 0) groups.counted_elsewhere.insert(item.key());
  }
  groups.norm.push_back(group.ep);  // each ep rank adds its own experts' squares
}

ch09::StepHooks expert_parallel_hooks(const ExpertParallel& group) {
  ch09::StepHooks hooks;
  hooks.adapt_model = [group](ch03::Transformer& model) { adapt_moe_layers(model, group); };
  hooks.adapt_groups = [group](ch03::Transformer& model, ch09::ModelParallelGroups& groups) {
    add_expert_parallel_groups(model, group, groups);
  };
  return hooks;
}

ExpertParallelTraffic expert_parallel_traffic(const std::vector<int64_t>& sent_rows,
                                              const std::vector<int64_t>& received_rows,
                                              int64_t rank, int64_t n_experts, int64_t d,
                                              int64_t element_size) {
  const auto ep = static_cast<int64_t>(sent_rows.size());
  int64_t sent = 0, received = 0;
  for (int64_t j = 0; j < ep; ++j) {
    sent += sent_rows[static_cast<size_t>(j)];
    received += received_rows[static_cast<size_t>(j)];
  }
  const int64_t row = d * element_size;
  const int64_t sent_away = sent - sent_rows[static_cast<size_t>(rank)];
  const int64_t received_away = received - received_rows[static_cast<size_t>(rank)];
  ExpertParallelTraffic t;
  // Forward: counts (E int64, E − E/ep of them for other ranks), dispatch, combine.
  // Backward: the gradient of the combine travels as the dispatch did, and the dispatch's back.
  t.calls = 5;
  t.payload_bytes = n_experts * 8 + 2 * (sent + received) * row;
  t.wire_bytes = (n_experts - n_experts / ep) * 8 + 2 * (sent_away + received_away) * row;
  t.forward_payload_bytes = n_experts * 8 + (sent + received) * row;
  return t;
}

}  // namespace fivefold::ch13
