// Chapter 10: the tensor-parallel layers and the recipe that puts them in chapter 03's slots.

#include "10_tensor_parallel/layers.h"

#include <cmath>
#include <set>
#include <utility>

#include "07_moe/moe.h"
#include "fivefold/error.h"
#include "fivefold/seed.h"

namespace fivefold::ch10 {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The split of `full` items that rank `rank` of `ranks` holds, along `dim`.
ch03::TensorShard part_of(int64_t full, int64_t dim, int rank, int ranks) {
  return {dim, rank, ranks, full};
}

int64_t part_size(const ch03::TensorShard& s) {
  return split_sizes(s.full_size, s.count)[static_cast<size_t>(s.index)];
}

int64_t part_offset(const ch03::TensorShard& s) {
  return split_offset(s.full_size, s.index, s.count);
}

// The full logits from every rank's vocabulary rows: all-gather along the last dimension forward,
// this rank's columns of the gradient backward.
class GatherVocabulary : public torch::autograd::Function<GatherVocabulary> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor local, int64_t vocab,
                               dist::CommunicatorPtr tp) {
    ctx->saved_data["first"] = split_offset(vocab, tp->rank(), tp->size());
    ctx->saved_data["rows"] = local.size(-1);
    return dist::all_gather_along(*tp, local, -1, split_sizes(vocab, tp->size()));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto mine =
        grads[0].narrow(-1, ctx->saved_data["first"].toInt(), ctx->saved_data["rows"].toInt());
    return {mine.contiguous(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor Entered::product(const torch::Tensor& weight) const {
  if (kept) kept->add_reader();
  return ch03::linear(whole, weight, kept);
}

Entered TensorParallel::enter(const torch::Tensor& x) const {
  if (!sequence_parallel) return {copy_to_tensor_parallel(x, comm), {}, {}};
  FIVEFOLD_CHECK(sequence > 0, "TensorParallel: the sequence length of this forward is unknown");
  auto whole = gather_from_sequence_parallel(x, sequence, comm);
  auto operand = ch03::matmul_operand(whole);
  return {whole, c10::make_intrusive<GatheredSequence>(x, sequence, comm), operand};
}

dist::CommunicatorPtr TensorParallel::replica_group(int parts) {
  FIVEFOLD_CHECK(parts >= 1 && size() % parts == 0, "TensorParallel: ", size(),
                 " ranks do not share ", parts, " parts evenly");
  auto& group = replica_groups[parts];
  if (!group) group = comm->split(rank() / (size() / parts), rank(), comm->name() + ".replicas");
  return group;
}

torch::Tensor TensorParallel::leave(const torch::Tensor& partial) const {
  // The partial sums are summed in fp32 at least: a bf16 product's result (chapter 14) is widened
  // first, so that the sum rounds once and the traffic is an fp32 step's.
  const auto wide = ch03::at_least_fp32(partial);
  return sequence_parallel ? reduce_scatter_to_sequence_parallel(wide, comm)
                           : reduce_from_tensor_parallel(wide, comm);
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in, int64_t out, int rank, int ranks)
    : shard_(part_of(out, 0, rank, ranks)) {
  weight = register_parameter("weight", torch::empty({part_size(shard_), in}));
}

torch::Tensor ColumnParallelLinearImpl::forward(const torch::Tensor& x) {
  return ch03::linear(x, weight);
}

std::map<std::string, ch03::TensorShard> ColumnParallelLinearImpl::shards() const {
  return {{"weight", shard_}};
}

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in, int64_t out, int rank, int ranks)
    : shard_(part_of(in, 1, rank, ranks)) {
  weight = register_parameter("weight", torch::empty({out, part_size(shard_)}));
}

torch::Tensor RowParallelLinearImpl::forward(const torch::Tensor& x) {
  return ch03::linear(x, weight);  // this rank's share of the sum over the input features
}

std::map<std::string, ch03::TensorShard> RowParallelLinearImpl::shards() const {
  return {{"weight", shard_}};
}

TensorParallelMlpImpl::TensorParallelMlpImpl(int64_t d_model, int64_t d_ff, TensorParallelPtr tp)
    : tp_(std::move(tp)) {
  gate_proj =
      register_module("gate_proj", ColumnParallelLinear(d_model, d_ff, tp_->rank(), tp_->size()));
  up_proj =
      register_module("up_proj", ColumnParallelLinear(d_model, d_ff, tp_->rank(), tp_->size()));
  down_proj =
      register_module("down_proj", RowParallelLinear(d_ff, d_model, tp_->rank(), tp_->size()));
}

torch::Tensor TensorParallelMlpImpl::forward(const torch::Tensor& x) {
  const Entered h = tp_->enter(x);  // f: the same input on every rank, its gradient summed backward
  // SiLU acts on each hidden feature alone, so it runs on this rank's features without talking.
  auto partial = down_proj(torch::silu(h.product(gate_proj->weight)) * h.product(up_proj->weight));
  return tp_->leave(partial);  // g: the ranks' partial sums added
}

TensorParallelAttentionImpl::TensorParallelAttentionImpl(const ch03::ModelConfig& c,
                                                         TensorParallelPtr tp)
    : tp_(std::move(tp)), n_heads_(c.n_heads / tp_->size()), head_dim_(c.resolved_head_dim()) {
  const int r = tp_->rank(), n = tp_->size();
  // Whole heads per rank: rank r's query heads are r·H/tp .. and the key/value heads they read
  // are r·K/tp .., the grouping chapter 03's attention uses. With fewer key/value heads than
  // ranks (tp a multiple of K), the tp / K ranks r with the same r / (tp / K) read the same one.
  const int kv_parts = c.n_kv_heads % n == 0 ? n : static_cast<int>(c.n_kv_heads);
  const int kv_part = r / (n / kv_parts);
  n_kv_heads_ = c.n_kv_heads / kv_parts;
  if (kv_parts < n) kv_replicas_ = tp_->replica_group(kv_parts);
  q_proj = register_module("q_proj", ColumnParallelLinear(c.d_model, c.n_heads * head_dim_, r, n));
  k_proj = register_module(
      "k_proj", ColumnParallelLinear(c.d_model, c.n_kv_heads * head_dim_, kv_part, kv_parts));
  v_proj = register_module(
      "v_proj", ColumnParallelLinear(c.d_model, c.n_kv_heads * head_dim_, kv_part, kv_parts));
  o_proj = register_module("o_proj", RowParallelLinear(c.n_heads * head_dim_, c.d_model, r, n));
}

std::map<std::string, dist::CommunicatorPtr> TensorParallelAttentionImpl::partial_gradients()
    const {
  // A shared key/value head serves each sharing rank's query heads: each rank's gradient of its
  // rows is that rank's share.
  if (!kv_replicas_) return {};
  return {{"k_proj.weight", kv_replicas_}, {"v_proj.weight", kv_replicas_}};
}

torch::Tensor TensorParallelAttentionImpl::forward(const torch::Tensor& x,
                                                   const torch::Tensor& positions,
                                                   ch03::LayerCache* cache) {
  tp_->sequence = positions.size(0);  // the whole sequence, for the gathers of this forward
  const Entered h = tp_->enter(x);    // [batch, seq, d_model] on every rank
  // Chapter 03's attention on this rank's heads: no head attends to another's.
  auto partial = o_proj(attend_heads(h.product(q_proj->weight), h.product(k_proj->weight),
                                     h.product(v_proj->weight), n_heads_, n_kv_heads_, head_dim_,
                                     positions, cache));
  return tp_->leave(partial);
}

TensorParallelMlaImpl::TensorParallelMlaImpl(const ch03::ModelConfig& c, const ch06::MlaConfig& mla,
                                             TensorParallelPtr tp)
    : tp_(std::move(tp)),
      n_heads_(c.n_heads / tp_->size()),
      mla_(mla),
      scale_(ch06::softmax_scale(c, mla)) {
  const int r = tp_->rank(), n = tp_->size();
  const int64_t q_width = c.n_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim);
  auto whole = [](int64_t in, int64_t out) { return ch03::Linear(in, out); };
  // Rows of q_b_proj, kv_b_proj and columns of o_proj are laid out head after head: an equal
  // split gives each rank whole heads.
  if (mla.q_lora_rank > 0) {
    q_a_proj = register_module("q_a_proj", whole(c.d_model, mla.q_lora_rank));
    q_a_layernorm = register_module("q_a_layernorm", ch03::RMSNorm(mla.q_lora_rank, 1e-6));
    q_b_proj = register_module("q_b_proj", ColumnParallelLinear(mla.q_lora_rank, q_width, r, n));
  } else {
    q_proj = register_module("q_proj", ColumnParallelLinear(c.d_model, q_width, r, n));
  }
  kv_a_proj_with_mqa = register_module("kv_a_proj_with_mqa",
                                       whole(c.d_model, mla.kv_lora_rank + mla.qk_rope_head_dim));
  kv_a_layernorm = register_module("kv_a_layernorm", ch03::RMSNorm(mla.kv_lora_rank, 1e-6));
  kv_b_proj = register_module(
      "kv_b_proj", ColumnParallelLinear(mla.kv_lora_rank,
                                        c.n_heads * (mla.qk_nope_head_dim + mla.v_head_dim), r, n));
  o_proj =
      register_module("o_proj", RowParallelLinear(c.n_heads * mla.v_head_dim, c.d_model, r, n));
}

torch::Tensor TensorParallelMlaImpl::forward(const torch::Tensor& x, const torch::Tensor& positions,
                                             ch03::LayerCache* cache) {
  FIVEFOLD_CHECK(cache == nullptr,
                 "tensor-parallel MLA runs the training path only: generate with the gathered "
                 "model (TrainingStep::full_model)");
  tp_->sequence = positions.size(0);
  const Entered h = tp_->enter(x);  // [batch, seq, d_model] on every rank
  const int64_t batch = h.whole.size(0), seq = h.whole.size(1), heads = n_heads_;
  const int64_t nope = mla_.qk_nope_head_dim, rope = mla_.qk_rope_head_dim, dv = mla_.v_head_dim;
  // Chapter 06's forward_naive on this rank's heads.
  auto q = (mla_.q_lora_rank > 0 ? q_b_proj(q_a_layernorm(h.product(q_a_proj->weight)))
                                 : h.product(q_proj->weight))
               .view({batch, seq, heads, nope + rope})
               .transpose(1, 2);
  auto q_nope = q.narrow(-1, 0, nope), q_rope = q.narrow(-1, nope, rope);
  auto down = h.product(kv_a_proj_with_mqa->weight);  // whole on every rank: [b, s, d_c + rope]
  auto latent = kv_a_layernorm(down.narrow(-1, 0, mla_.kv_lora_rank));
  auto k_rope = down.narrow(-1, mla_.kv_lora_rank, rope).unsqueeze(1);
  if (encoding) std::tie(q_rope, k_rope) = encoding->encode(q_rope, k_rope, positions);
  auto up = kv_b_proj(latent).view({batch, seq, heads, nope + dv}).transpose(1, 2);
  auto k_nope = up.narrow(-1, 0, nope), v = up.narrow(-1, nope, dv);
  auto k = torch::cat({k_nope, k_rope.expand({batch, heads, seq, rope})}, -1);
  auto out =
      kernel->attend(torch::cat({q_nope, q_rope}, -1), k, v, positions, positions, scale_).output;
  return tp_->leave(o_proj(out.transpose(1, 2).reshape({batch, seq, heads * dv})));
}

std::map<std::string, dist::CommunicatorPtr> TensorParallelMlaImpl::partial_gradients() const {
  // The whole projections feed only this rank's heads here: each rank's gradient is its heads'
  // share.
  std::map<std::string, dist::CommunicatorPtr> names{{"kv_a_proj_with_mqa.weight", tp_->comm},
                                                     {"kv_a_layernorm.weight", tp_->comm}};
  if (mla_.q_lora_rank > 0) {
    names["q_a_proj.weight"] = tp_->comm;
    names["q_a_layernorm.weight"] = tp_->comm;
  }
  return names;
}

VocabParallelEmbeddingImpl::VocabParallelEmbeddingImpl(int64_t vocab, int64_t d_model,
                                                       TensorParallelPtr tp)
    : tp_(std::move(tp)), shard_(part_of(vocab, 0, tp_->rank(), tp_->size())) {
  first_ = part_offset(shard_);
  weight = register_parameter("weight", torch::empty({part_size(shard_), d_model}));
}

torch::Tensor VocabParallelEmbeddingImpl::forward(const torch::Tensor& tokens) {
  // Tokens this rank holds look their row up; the others get zeros, which the sum over the
  // ranks fills in from the rank that holds them.
  const auto mine = (tokens >= first_) & (tokens < first_ + weight.size(0));
  const auto local = torch::where(mine, tokens - first_, torch::zeros_like(tokens));
  auto rows = torch::embedding(weight, local) * mine.unsqueeze(-1).to(weight.scalar_type());
  return tp_->leave(rows);  // g, or under sequence parallelism this rank's part of the sequence
}

std::map<std::string, ch03::TensorShard> VocabParallelEmbeddingImpl::shards() const {
  return {{"weight", shard_}};
}

torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& local, const torch::Tensor& targets,
                                           int64_t first, const dist::CommunicatorPtr& tp) {
  const int64_t rows = local.size(-1);
  auto logits = local.reshape({-1, rows});  // [tokens, rows]
  auto target = targets.reshape({-1});
  const auto counted = target != -100;  // PyTorch's ignore_index
  // 1. The max over the whole vocabulary, for a stable exponential. A constant per token: no
  //    gradient flows through it, so a plain all-reduce.
  auto max = std::get<0>(logits.detach().max(-1));
  tp->all_reduce(max, dist::ReduceOp::Max);
  auto shifted = logits - max.unsqueeze(-1);
  // 2. Σ exp over the whole vocabulary: each rank's partial sum, added by g (its gradient
  //    reaches each rank's own logits unchanged).
  auto sum_exp = reduce_from_tensor_parallel(shifted.exp().sum(-1), tp);
  // 3. The target's logit, from the rank that holds its row (zeros elsewhere), added by g.
  const auto mine = (target >= first) & (target < first + rows) & counted;
  const auto index = torch::where(mine, target - first, torch::zeros_like(target));
  auto picked = shifted.gather(1, index.unsqueeze(1)).squeeze(1) * mine.to(shifted.scalar_type());
  auto target_logit = reduce_from_tensor_parallel(picked, tp);
  // -log softmax(target) = log Σ exp − target logit, averaged over the counted tokens.
  auto per_token = (torch::log(sum_exp) - target_logit) * counted.to(shifted.scalar_type());
  return per_token.sum() / counted.sum().to(shifted.scalar_type());
}

VocabParallelHeadImpl::VocabParallelHeadImpl(int64_t vocab, int64_t d_model, TensorParallelPtr tp,
                                             torch::Tensor tied_weight)
    : tp_(std::move(tp)),
      shard_(part_of(vocab, 0, tp_->rank(), tp_->size())),
      tied_(tied_weight.defined()) {
  first_ = part_offset(shard_);
  weight = tied_ ? tied_weight
                 : register_parameter("weight", torch::empty({part_size(shard_), d_model}));
  FIVEFOLD_CHECK(weight.size(0) == part_size(shard_), "VocabParallelHead: the tied table holds ",
                 weight.size(0), " rows, this rank's part is ", part_size(shard_));
}

torch::Tensor VocabParallelHeadImpl::local_logits(const torch::Tensor& hidden, int64_t seq) {
  tp_->sequence = seq;
  // enter: f (the hidden state feeds every rank's rows; its gradient is their sum), or the
  // sequence all-gather whose backward reduce-scatters that sum.
  // (The head keeps the gathered x, not this rank's part: its product is chapter 03's linear.)
  const auto x = tp_->enter(hidden).whole;
  return ch03::at_least_fp32(ch03::linear(x, weight));  // [batch, seq, rows], fp32 for the loss
}

torch::Tensor VocabParallelHeadImpl::logits(const torch::Tensor& hidden) {
  const int64_t seq = tp_->sequence_parallel ? tp_->sequence : hidden.size(1);
  return GatherVocabulary::apply(local_logits(hidden, seq), shard_.full_size, tp_->comm);
}

torch::Tensor VocabParallelHeadImpl::loss(const torch::Tensor& hidden,
                                          const torch::Tensor& targets) {
  return vocab_parallel_cross_entropy(local_logits(hidden, targets.size(1)), targets, first_,
                                      tp_->comm);
}

std::map<std::string, ch03::TensorShard> VocabParallelHeadImpl::shards() const {
  if (tied_) return {};  // the embedding declares the tied table
  return {{"weight", shard_}};
}

void check_tensor_parallel(const ch03::ModelConfig& config, int tp_size, bool sequence_parallel) {
  FIVEFOLD_CHECK(tp_size >= 1, "--tp must be at least 1, got ", tp_size);
  if (tp_size == 1) return;
  FIVEFOLD_CHECK(config.n_heads % tp_size == 0, "--tp ", tp_size, ": the model's ", config.n_heads,
                 " attention heads do not split over ", tp_size,
                 " ranks (tensor parallelism gives each rank whole heads)");
  const bool mla = !config.extensions.is_null();
  FIVEFOLD_CHECK(mla || config.n_kv_heads % tp_size == 0 || tp_size % config.n_kv_heads == 0,
                 "--tp ", tp_size, ": the model's ", config.n_kv_heads,
                 " key/value heads do not split over ", tp_size,
                 " ranks (each rank reads whole key/value heads: tp must divide n_kv_heads, or "
                 "be a multiple of it so that ranks share them)");
  if (!mla || !sequence_parallel || !ch07::has_routed_experts(config)) return;
  const auto moe = ch07::MoeConfig::from_json(config.extensions);
  FIVEFOLD_CHECK(moe.aux_loss_alpha == 0 && moe.capacity_factor == 0,
                 "--sequence-parallel routes each rank's part of the sequence on its own, but the "
                 "Switch auxiliary loss and expert capacity need the whole sequence's routing "
                 "statistics (global statistics come with chapter 13): use aux_loss_alpha 0 and "
                 "dropless routing, or leave out --sequence-parallel");
}

ch03::ModelRecipe recipe(const ch03::ModelConfig& config, TensorParallelPtr tp) {
  FIVEFOLD_CHECK(tp != nullptr && tp->comm != nullptr, "ch10::recipe: no tensor-parallel group");
  check_tensor_parallel(config, tp->size(), tp->sequence_parallel);
  ch03::ModelRecipe r = ch07::recipe(config);  // RoPE / YaRN as the config asks
  if (config.extensions.is_null()) {
    r.attention = [tp](const ch03::ModelConfig& c,
                       int64_t) -> std::shared_ptr<ch03::AttentionLayer> {
      return std::make_shared<TensorParallelAttentionImpl>(c, tp);
    };
  } else {
    const auto mla = ch06::MlaConfig::from_json(config.extensions);
    r.attention = [tp, mla](const ch03::ModelConfig& c,
                            int64_t) -> std::shared_ptr<ch03::AttentionLayer> {
      return std::make_shared<TensorParallelMlaImpl>(c, mla, tp);
    };
  }
  const auto& e = config.extensions;
  const bool moe = ch07::has_routed_experts(config);
  r.mlp = [tp, moe, e](const ch03::ModelConfig& c,
                       int64_t layer) -> std::shared_ptr<ch03::FeedForwardLayer> {
    if (moe) {
      const auto m = ch07::MoeConfig::from_json(e);
      if (m.is_moe_layer(layer)) {
        // Whole routed experts on every rank; the shared experts split like a dense MLP.
        std::shared_ptr<ch03::FeedForwardLayer> shared;
        if (m.n_shared_experts > 0) {
          shared = std::make_shared<TensorParallelMlpImpl>(
              c.d_model, m.n_shared_experts * m.moe_intermediate_size, tp);
        }
        return std::make_shared<ch07::MoeImpl>(c, m, shared);
      }
    }
    return std::make_shared<TensorParallelMlpImpl>(c.d_model, c.d_ff, tp);
  };
  r.embedding = [tp](const ch03::ModelConfig& c) -> std::shared_ptr<ch03::TokenEmbedding> {
    return std::make_shared<VocabParallelEmbeddingImpl>(c.vocab_size, c.d_model, tp);
  };
  r.output = [tp](const ch03::ModelConfig& c,
                  torch::Tensor tied) -> std::shared_ptr<ch03::OutputLayer> {
    return std::make_shared<VocabParallelHeadImpl>(c.vocab_size, c.d_model, tp, tied);
  };
  return r;
}

ch03::Transformer make_model(const ch03::ModelConfig& config, TensorParallelPtr tp,
                             const ch03::ModelPart& part) {
  return ch03::Transformer(config, recipe(config, tp), part);
}

std::map<std::string, dist::CommunicatorPtr> partial_gradient_parameters(ch03::Transformer& model,
                                                                         const TensorParallel& tp) {
  std::map<std::string, dist::CommunicatorPtr> partial;
  if (tp.size() == 1) return partial;
  // Declared by the layers: weights whose rows feed only this rank's heads.
  for (const auto& item : model->named_modules("", /*include_self=*/false)) {
    const auto* declares = dynamic_cast<const PartialGradients*>(item.value().get());
    if (declares == nullptr) continue;
    for (const auto& [name, group] : declares->partial_gradients())
      partial[item.key() + "." + name] = group;
  }
  // Under sequence parallelism every whole parameter (norms, router, routed experts) sees only
  // this rank's part of the sequence.
  if (tp.sequence_parallel) {
    const auto shards = model->parameter_shards();
    for (const auto& item : model->named_parameters())
      if (shards.count(item.key()) == 0) partial[item.key()] = tp.comm;
  }
  // A parameter without gradient (the balancing bias) has nothing to sum.
  for (const auto& item : model->named_parameters())
    if (!item.value().requires_grad()) partial.erase(item.key());
  return partial;
}

}  // namespace fivefold::ch10
