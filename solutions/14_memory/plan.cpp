// Chapter 14's plan terms: recomputation's FLOPs, and the activations a block keeps.
#include "14_memory/plan.h"

#include <algorithm>
#include <optional>
#include <vector>

#include "06_mla/mla.h"
#include "07_moe/moe.h"
#include "10_tensor_parallel/plan.h"
#include "11_pipeline_parallel/plan.h"
#include "fivefold/error.h"
#include "fivefold/seed.h"

namespace fivefold::ch14 {

int64_t TensorParallelShare::own(int64_t tokens) const {
  return sequence_parallel ? split_sizes(tokens, ranks)[static_cast<size_t>(rank)] : tokens;
}

int64_t ContextParallelShare::tokens(int64_t seq) const {
  return ranks > 1 ? ch12::shard_size(seq, ranks, rank, layout) : seq;
}

int64_t recomputed_layers(int64_t n_layers, int64_t every) {
  return (n_layers + every - 1) / every;
}

double training_flops_per_token(const ch02::TransformerShape& shape, int64_t context,
                                const RecomputeConfig& config) {
  const ch02::FlopBreakdown forward = ch02::forward_flops_per_token(shape, context);
  double again = 0;  // forward FLOPs run a second time in backward
  if (config.mode == Recompute::Full) {
    const double per_layer =
        (forward.total() - forward.lm_head) / static_cast<double>(shape.n_layers);
    again = per_layer * static_cast<double>(recomputed_layers(shape.n_layers, config.every));
  } else if (config.mode == Recompute::Selective) {
    again = forward.attention_scores + forward.attention_values;
  }
  return 3 * forward.total() + again;
}

namespace {

// In bf16, 2 bytes an element instead of 4: the linear maps keep their inputs rounded (the norms'
// outputs, the heads' merged output, SwiGLU's product), and SwiGLU's gate, its SiLU and up are
// the products' bf16 results; for `tokens` tokens of `shape` (a rank's share of heads and d_ff
// under tp), of which the norms' outputs are kept for `own` (the rank's part under sequence
// parallelism).
int64_t linear_inputs_saving(const ch02::TransformerShape& shape, int64_t tokens, int64_t own,
                             Precision precision) {
  if (precision != Precision::Bf16) return 0;
  return 2 * (own * 2 * shape.d_model + tokens * (shape.n_heads * shape.head_dim + 4 * shape.d_ff));
}

}  // namespace

int64_t block_activation_bytes(const ch02::TransformerShape& shape, int64_t batch, int64_t seq,
                               Recompute mode, const TensorParallelShare& tp, Precision precision,
                               const ContextParallelShare& cp) {
  const int64_t t = tp.ranks, r = tp.rank;
  FIVEFOLD_CHECK(t >= 1 && r >= 0 && r < t && shape.n_heads % t == 0,
                 "block_activation_bytes: rank ", r, " of ", t, " tensor-parallel ranks for ",
                 shape.n_heads, " heads");
  const int64_t d = shape.d_model, hd = shape.head_dim;
  // This rank's share (its heads, key/value heads (one, shared, when there are fewer than ranks)
  // and MLP width) as a model of its own: chapter 11's block formula counts what it keeps without
  // recomputation. With sequence parallelism, also its share of the tokens.
  const ch02::TransformerShape mine =
      ch10::rank_shape(shape, static_cast<int>(t), static_cast<int>(r));
  // Under sequence parallelism the residual stream's part (each norm's x², 1/rms and x/rms, the
  // residual after attention, the block's output: 6d + 2 a token) is kept for this rank's tokens
  // only, and so are the norms' outputs (2d): the split products read them gathered over the
  // sequence (of this cp rank) but keep the rank's part and gather it again in backward.
  auto sequence_parallel_saving = [&](int64_t tokens) {
    return 4 * batch * (tokens - tp.own(tokens)) * (8 * d + 2);
  };
  if (cp.ranks > 1) {  // chapter 12's block term, or this rank's tokens under recomputation
    const int64_t s_r = cp.tokens(seq);
    if (mode != Recompute::None)
      return block_activation_bytes(shape, batch, s_r, mode, tp, precision);
    // With tp, chapter 12's term for this rank's heads and d_ff over its cp tokens.
    return ch12::cp_block_activation_bytes(mine, cp.ranks, cp.rank, batch, seq, cp.layout,
                                           cp.attention) -
           linear_inputs_saving(mine, batch * s_r, batch * tp.own(s_r), precision) -
           sequence_parallel_saving(s_r);
  }
  const int64_t h = mine.n_heads, kv = mine.n_kv_heads;
  const int64_t own = tp.own(seq);
  int64_t none = ch11::block_activation_bytes(mine, batch, seq) - sequence_parallel_saving(seq);
  none -= linear_inputs_saving(mine, batch * seq, batch * own, precision);
  switch (mode) {
    case Recompute::Full:  // the block's output, which the next block keeps as its input
      return 4 * batch * own * d;
    case Recompute::Selective: {
      // The core's inputs (q before scaling, k and v at h_kv heads) instead of what it kept: q/√hd,
      // k and v at h heads, the probabilities, the causal mask, the index that repeats k and v.
      const int64_t core = 4 * batch * seq * 3 * h * hd + 4 * batch * h * seq * seq + seq * seq +
                           (kv < h ? 2 * 8 * h : 0);
      return none - core + 4 * batch * seq * (h + 2 * kv) * hd;
    }
    case Recompute::None: break;
  }
  return none;
}

int64_t deepseek_block_activation_bytes(const ch03::ModelConfig& config, int64_t layer,
                                        int64_t batch, int64_t seq, Recompute mode,
                                        const TensorParallelShare& tp,
                                        const ContextParallelShare& cp, Precision precision,
                                        const ExpertParallelShare& ep) {
  const auto mla = ch06::MlaConfig::from_json(config.extensions);
  const auto moe = ch07::MoeConfig::from_json(config.extensions);
  const bool routed = ch07::has_routed_experts(config) && moe.is_moe_layer(layer);
  FIVEFOLD_CHECK(
      !routed || (moe.capacity_factor == 0 && moe.aux_loss_alpha == 0 && moe.norm_topk_prob),
      "deepseek_block_activation_bytes: derived for dropless routing with normalised "
      "gates and no auxiliary loss");
  const int64_t t = tp.ranks, rank = tp.rank;
  FIVEFOLD_CHECK(t >= 1 && rank >= 0 && rank < t && config.n_heads % t == 0,
                 "deepseek_block_activation_bytes: rank ", rank, " of ", t,
                 " tensor-parallel ranks for ", config.n_heads, " heads");
  // On a rank of tp (chapter 10): its heads, its part of d_ff and of the shared experts; the
  // latents, their norms, the router and the routed experts stay whole. With sequence
  // parallelism its own tokens for the residual stream and the routing.
  auto share = [&](int64_t n) { return split_sizes(n, t)[static_cast<size_t>(rank)]; };
  const int64_t d = config.d_model, h = config.n_heads / t, n = mla.qk_nope_head_dim;
  const int64_t r = mla.qk_rope_head_dim, dv = mla.v_head_dim, d_c = mla.kv_lora_rank;
  // Under cp (chapter 12) the rank's s_r tokens of every row.
  const int64_t s_r = cp.tokens(seq);
  const int64_t tokens = batch * s_r, own = batch * tp.own(s_r);
  // Full: the block's input, and a MoE layer's last routing (k expert indices and gates a token),
  // which the layer keeps outside the graph (ch07::MoeImpl::last_routing).
  if (mode == Recompute::Full)
    return 4 * own * d + (routed ? own * moe.num_experts_per_tok * (8 + 4) : 0);
  // The norms' outputs (2d): over the sequence, or under sequence parallelism the rank's own
  // tokens (the split products keep its part and gather it again in backward).
  const bool sp = tp.sequence_parallel;
  int64_t floats = sp ? 0 : 2 * d;
  if (mla.q_lora_rank > 0) floats += 4 * mla.q_lora_rank + 1;  // query latent, its norm
  floats += 4 * d_c + r + 1;                                   // key/value latent, norm
  if (mode == Recompute::Selective) {
    // The checkpointed core keeps its inputs, q and k (n + r a head each) and v, a view of
    // kv_b_proj's whole output (n + dv), whichever kernel runs inside; o_proj its input (dv).
    floats += h * (2 * (n + r) + n + 2 * dv);
  } else if (cp.ranks == 1) {
    floats += h * (2 * (n + r) + 2 * dv) + (batch == 1 ? h * n : 0);  // q, k, v, heads' output
  } else {
    // Chapter 12's kernel keeps q, its output, the log-sum-exp and o_proj's input; the ring also
    // the rank's own keys and values, which are a view of kv_b_proj's whole output (n + dv a
    // head); all-gather instead every rank's keys and values.
    floats += h * ((n + r) + 2 * dv + 1);
    if (cp.attention == ch12::CpAttention::Ring) floats += h * ((n + r) + (n + dv));
  }
  // The norms' other terms, the residual stream (and the norms' outputs under sp).
  int64_t own_floats = 6 * d + 2 + (sp ? 2 * d : 0), own_int64s = 0;
  if (!routed) {
    floats += 4 * share(config.d_ff);
  } else {
    const int64_t k = moe.num_experts_per_tok, f_e = moe.moe_intermediate_size;
    floats += 4 * share(f_e * moe.n_shared_experts);                     // shared experts
    own_floats += moe.n_routed_experts + 1 + k * (3 * d + 4 * f_e + 3);  // router, assignments
    own_int64s += 4 * k;
    // (Under sequence parallelism the router reads the rank's own rows of the norm's output: the
    // part the shared experts keep, the same storage in fp32.)
  }
  int64_t bytes = 4 * tokens * floats + own * (4 * own_floats + 8 * own_int64s);
  if (precision == Precision::Bf16) {
    // The linear maps' inputs kept rounded (2 bytes fewer an element) where the fp32 one is freed:
    // this rank's heads and shares; a MoE layer's routed rows for the tokens it routes.
    // The products hand their results on in bf16: SwiGLU's gate, SiLU and up (3 a unit of
    // width) and a routed expert's output, which the gate's product keeps, are bf16. What views
    // of an fp32 result kept whole is no longer kept: kv_b_proj's output, of which v was a view
    // (the kernel widens v into a copy: h·n fewer where the core's inputs, the ring's own keys
    // and values or one row's kept it), and kv_a_proj's, whose latent the norm now widens (the
    // key's rotary part, r: 4 bytes, 2r here).
    int64_t rounded = mla.q_lora_rank + d_c + h * dv + 2 * r, routed_rounded = 0;
    int64_t own_rounded = 0;            // for the rank's own tokens
    (sp ? own_rounded : rounded) += d;  // the attention norm's output
    const bool v_view_kept = mode == Recompute::Selective || (cp.ranks == 1 && batch == 1) ||
                             (cp.ranks > 1 && cp.attention == ch12::CpAttention::Ring);
    if (v_view_kept) rounded += 2 * h * n;
    if (!routed) {
      (sp ? own_rounded : rounded) += d;  // the MLP norm's output
      rounded += 4 * share(config.d_ff);
    } else {
      const int64_t f_s = moe.moe_intermediate_size * moe.n_shared_experts;
      routed_rounded = moe.num_experts_per_tok * (2 * d + 4 * moe.moe_intermediate_size);
      // The shared experts' product; and the norm's output, which the router keeps in fp32: the
      // shared experts keep a rounded copy of it besides (-d), of the rank's own rows under
      // sequence parallelism (else the experts' roundings in between evict the one rounding).
      if (f_s > 0) {
        rounded += 4 * share(f_s);
        (sp ? own_rounded : rounded) -= d;
      }
    }
    bytes -= 2 * (tokens * rounded + own * (routed_rounded + own_rounded));
  }
  if (routed && ep.ranks > 1) {
    // Chapter 13: the experts compute the R rows they receive (2d + 4f_e floats and the
    // regrouping index each), not the rank's A assignments; each assignment keeps its output sent
    // back, and that gated (2d), the gates and the routing's indices, d and an int64 more than on
    // one device. In bf16 the received rows keep the rounded routed row and SwiGLU product and
    // the products' bf16 gate, SiLU and up (d + 4f_e at 2 bytes); their outputs go back widened
    // to fp32 (chapter 13's combine), so the rank's own assignments keep theirs in fp32.
    const int64_t k = moe.num_experts_per_tok, f_e = moe.moe_intermediate_size;
    const int64_t assigned = own * k, received = ep.received < 0 ? assigned : ep.received;
    const bool bf16 = precision == Precision::Bf16;
    const int64_t per_row = 4 * (2 * d + 4 * f_e + 2) - (bf16 ? 2 * (d + 4 * f_e) : 0);
    bytes += (received - assigned) * per_row + assigned * (4 * d + 8 + (bf16 ? 2 * d : 0));
  }
  if (config.rope_theta > 0) bytes += 4 * s_r * r;  // cos and sin, [s, r/2] each
  if (mode == Recompute::Selective) return bytes;
  if (cp.ranks == 1) return bytes + 4 * batch * h * seq * seq + seq * seq;  // probabilities, mask
  bytes += 8 * seq;  // every rank's key positions
  if (cp.attention == ch12::CpAttention::AllGather) bytes += 4 * batch * seq * h * (n + r + dv);
  return bytes;
}

RecomputeChoice recompute_under_budget(const ch02::TransformerShape& shape, int64_t batch,
                                       int64_t seq, int64_t budget, Precision precision) {
  std::vector<RecomputeConfig> candidates = {{Recompute::None, 1}, {Recompute::Selective, 1}};
  for (int64_t every = shape.n_layers; every >= 1; --every)
    candidates.push_back({Recompute::Full, every});
  std::optional<RecomputeChoice> best;
  int64_t least = 0;  // what full recomputation of every block keeps: the smallest
  for (const auto& config : candidates) {
    RecomputeChoice choice{config, 0, training_flops_per_token(shape, seq, config)};
    for (int64_t layer = 0; layer < shape.n_layers; ++layer) {
      const Recompute as =
          config.mode == Recompute::Full
              ? (recomputes_block(config, layer) ? Recompute::Full : Recompute::None)
              : config.mode;
      choice.bytes += block_activation_bytes(shape, batch, seq, as, {}, precision);
    }
    least = choice.bytes;
    if (choice.bytes > budget) continue;
    if (!best || choice.flops_per_token < best->flops_per_token ||
        (choice.flops_per_token == best->flops_per_token && choice.bytes < best->bytes))
      best = choice;
  }
  FIVEFOLD_CHECK(best.has_value(), "no recomputation keeps the activations within ", budget,
                 " bytes: full recomputation of every block keeps ", least);
  return *best;
}

nlohmann::json activation_plan(const ch02::TransformerShape& shape, int64_t rows, int64_t seq,
                               int64_t tp, Precision precision, int64_t cp,
                               ch12::CpLayout cp_layout, ch12::CpAttention cp_attention) {
  if (!shape.gated_mlp || shape.layer_norm || shape.biases || shape.learned_positions != 0)
    return nlohmann::json::object();
  const std::pair<const char*, Recompute> modes[] = {
      {"none", Recompute::None}, {"selective", Recompute::Selective}, {"full", Recompute::Full}};
  auto per_mode = [&](const TensorParallelShare& share, const ContextParallelShare& cp_share) {
    nlohmann::json bytes;
    for (const auto& [name, mode] : modes)
      bytes[name] = block_activation_bytes(shape, rows, seq, mode, share, precision, cp_share);
    return bytes;
  };
  nlohmann::json flops;
  for (const auto& [name, mode] : modes)
    flops[name] = training_flops_per_token(shape, seq, {mode, 1});
  nlohmann::json plan = {{"rows", rows},
                         {"tokens", seq},
                         {"precision", to_string(precision)},
                         {"bytes_per_block", per_mode({}, {})},
                         {"training_flops_per_token", flops}};
  if (tp > 1) {
    plan["tensor_parallel"] = {{"ranks", tp},
                               {"plain", per_mode({tp, 0, false}, {})},
                               {"sequence_parallel", per_mode({tp, 0, true}, {})}};
  }
  if (cp > 1 && seq % cp == 0) {
    const ContextParallelShare cp_share{cp, 0, cp_layout, cp_attention};
    plan["context_parallel"] = {{"ranks", cp}, {"bytes", per_mode({}, cp_share)}};
    if (tp > 1)
      plan["context_parallel"]["with_tensor_parallel"] = {
          {"plain", per_mode({tp, 0, false}, cp_share)},
          {"sequence_parallel", per_mode({tp, 0, true}, cp_share)}};
  }
  return plan;
}

}  // namespace fivefold::ch14
