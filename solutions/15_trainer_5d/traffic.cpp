// Chapter 15: the bytes each rank of a layout hands each communicator in a step, every chapter's
// traffic formula for the rank's share (predicted_traffic, predict.h).
#include <map>
#include <string>
#include <vector>

#include "06_mla/mla.h"
#include "07_moe/moe.h"
#include "11_pipeline_parallel/plan.h"
#include "12_context_parallel/plan.h"
#include "13_expert_parallel/expert_parallel.h"
#include "14_memory/plan.h"
#include "fivefold/error.h"
#include "fivefold/seed.h"
#include "predict_parts.h"

namespace fivefold::ch15 {

namespace {

using Bytes = std::map<std::string, int64_t>;

// The model's routed experts' settings (the defaults without any).
ch07::MoeConfig moe_of(const ch03::ModelConfig& model) {
  return ch07::has_routed_experts(model) ? ch07::MoeConfig::from_json(model.extensions)
                                         : ch07::MoeConfig{};
}

// Partial gradients' elements (by ZeRO-3 unit) as the step hands them to their group: once a
// step, but ZeRO-3 without pp sums each unit's as it releases it, which for blocks 1 .. L-1
// happens every one of the m micro-batches (the root and block 0 at the step).
int64_t reduced_elements(const std::vector<int64_t>& by_unit, const Layout& layout, int64_t m) {
  int64_t total = 0;
  for (size_t u = 0; u < by_unit.size(); ++u)
    total += by_unit[u] * (layout.zero == 3 && layout.pp == 1 && u >= 2 ? m : 1);
  return total;
}

// Chapter 11's pipeline_traffic: what this rank sends, activations forward and gradients back,
// each row's `positions`. It receives on each communicator what it sends on the other (the
// activation it sends forward comes back as a gradient), so each is handed the same bytes.
void pp_traffic(Bytes& bytes, const Layout& layout, const Workload& run, const RankWork& work) {
  const int64_t m = run.micro_batches;
  if (layout.pp > 1) {
    const int64_t sent = ch11::pipeline_traffic(layout.pp, layout.virtual_stages, m, work.at.pp,
                                                work.rows, work.positions, run.model.d_model)
                             .payload_bytes;
    bytes["pp-activations"] = sent;
    bytes["pp-gradients"] = sent;
    bytes["pp"] = 8;     // the last stage's loss, broadcast to the others
    bytes["pp+tp"] = 8;  // the gradient norm's squares of every stage (and tp part), summed
  }
}

// Chapter 12: each attention layer of this rank's stages, every micro-batch.
void cp_traffic(Bytes& bytes, const Layout& layout, const Workload& run, const RankWork& work,
                int64_t cores_again) {
  const ch03::ModelConfig& model = run.model;
  const int64_t m = run.micro_batches, rows = work.rows;
  const auto held_layers = static_cast<int64_t>(work.layers.size());
  if (layout.cp > 1) {
    const bool mla = !model.extensions.is_null();
    int64_t heads = 0, key_dim = 0, value_dim = 0;
    if (mla) {
      const auto dims = ch06::MlaConfig::from_json(model.extensions);
      heads = model.n_heads;
      key_dim = dims.qk_nope_head_dim + dims.qk_rope_head_dim;
      value_dim = dims.v_head_dim;
    } else {
      heads = model.n_kv_heads;
      key_dim = value_dim = model.resolved_head_dim();
    }
    const auto t = ch12::context_parallel_traffic(layout.cp, work.at.cp, rows / m, run.seq_len,
                                                  heads / layout.tp, key_dim, value_dim,
                                                  layout.cp_layout, layout.cp_attention);
    bytes["cp"] = held_layers * m *
                      (t.all_gather.payload_bytes + t.send_recv.payload_bytes +
                       t.reduce_scatter.payload_bytes) +
                  cores_again * m * t.forward_payload_bytes;  // chapter 14: attention re-run
  }
}

// Chapter 10: each crossing into or out of the split layers, every micro-batch (f or g: one
// all-reduce; under sequence parallelism an all-gather and a reduce-scatter), the loss's
// per-token sums on the last stage; per step the partial gradients and the norm's number.
void tp_traffic(Bytes& bytes, const Layout& layout, const Workload& run, const RankWork& work,
                const HeldParameters& held, const ch14::RecomputeConfig& again) {
  const ch03::ModelConfig& model = run.model;
  const int64_t m = run.micro_batches, rows = work.rows;
  const bool routed = ch07::has_routed_experts(model);
  const ch07::MoeConfig moe = moe_of(model);
  if (layout.tp > 1 && !held.tp_partial_by_unit.empty()) {
    const int64_t tokens = rows / m * work.cp_positions;
    int64_t crossings = (work.first_stage ? 1 : 0) + (work.last_stage ? 1 : 0);  // embedding, head
    int64_t entries = 0;  // into the blocks' split layers
    for (const int64_t layer : work.layers) {
      const bool experts_only = routed && moe.is_moe_layer(layer) && moe.n_shared_experts == 0;
      const int64_t block = 2 + (experts_only ? 0 : 2);  // attention, the MLP (shared experts)
      // A recomputed block's forward half once more: g's all-reduce out of each split layer
      // (under sequence parallelism, the all-gather in and the reduce-scatter out).
      crossings += block + (ch14::recomputes_block(again, layer) ? block / 2 : 0);
      entries += block / 2;
    }
    const int64_t activation = tokens * model.d_model * 4 * (layout.sequence_parallel ? 2 : 1);
    // Under sequence parallelism each entry's products kept the rank's part of their input (in
    // the products' operand type) and gather it again in backward.
    const int64_t regathered = layout.sequence_parallel ? entries * tokens * model.d_model *
                                                              ch14::bytes_per_number(run.precision)
                                                        : 0;
    const int64_t loss = work.last_stage ? 3 * tokens * 4 : 0;  // max, Σ exp, target logit
    bytes["tp"] = m * (crossings * activation + regathered + loss) +
                  4 * reduced_elements(held.tp_partial_by_unit, layout, m) +
                  (layout.pp == 1 ? 8 : 0);
    const int64_t replicas = reduced_elements(held.tp_replica_partial_by_unit, layout, m);
    if (replicas > 0) bytes["tp.replicas"] = 4 * replicas;
  }
}

// Chapter 13: each MoE layer's all-to-alls, every micro-batch; then per step the shared
// weights' partial gradients, the norm's squares and the loss, over the ep ranks. Returns whether
// the rank's experts are spread over ep (its data-parallel group is then edp).
bool ep_traffic(Bytes& bytes, const Layout& layout, const Workload& run, const RankWork& work,
                const HeldParameters& held, const ch14::RecomputeConfig& again) {
  const ch03::ModelConfig& model = run.model;
  const int64_t m = run.micro_batches, rows = work.rows;
  const ch07::MoeConfig moe = moe_of(model);
  const bool experts = layout.ep > 1 && held.elements > 0;
  if (experts) {
    int64_t moe_layers = 0, moe_layers_again = 0;
    for (const int64_t layer : work.layers) {
      moe_layers += moe.is_moe_layer(layer);
      moe_layers_again += moe.is_moe_layer(layer) && ch14::recomputes_block(again, layer);
    }
    // Each rank routes its own tokens (under sequence parallelism its tp part of them), spread
    // evenly over the ep ranks and received as evenly: chapter 13's bytes of one layer.
    const int64_t assignments = rows / m * work.positions * moe.num_experts_per_tok;
    const auto even = split_sizes(assignments, layout.ep);
    const auto layer_traffic =
        ch13::expert_parallel_traffic(even, even, 0, moe.n_routed_experts, model.d_model, 4);
    const int64_t exchange = layer_traffic.payload_bytes;
    std::vector<int64_t> shared = held.by_unit;  // the partial gradients the step sums over ep
    for (size_t u = 0; u < held.routed_by_unit.size() && u < shared.size(); ++u)
      shared[u] -= held.routed_by_unit[u];
    if (moe.capacity_factor <= 0 && !held.by_unit.empty())
      bytes["ep"] = moe_layers * m * exchange +
                    moe_layers_again * m * layer_traffic.forward_payload_bytes +
                    4 * reduced_elements(shared, layout, m) + 8 + 8;
  }
  return experts;
}

// Chapter 09: the gradients' reduction over the dp x cp ranks (edp under expert parallelism:
// the ranks holding the same experts), and the loss's (8 bytes). One process has no
// communicator at all (chapter 03's step); any other layout has the group, even of one rank
// (tp or pp alone), and hands it the same bytes.
void dp_traffic(Bytes& bytes, const Layout& layout, const Workload& run, const HeldParameters& held,
                bool experts) {
  const int64_t m = run.micro_batches;
  const bool one_process = layout.dp * layout.tp * layout.pp * layout.cp == 1;
  const std::string data = experts ? "edp" : "dp+cp";
  const int64_t n = layout.dp * layout.cp / layout.ep;
  auto padded = [n](int64_t numel) { return n * ((numel + n - 1) / n); };  // a multiple of n
  // Gradients are reduced in fp32; the parameters gathered in their own type (bf16 under
  // chapter 14's master weights).
  const int64_t gathered = ch14::bytes_per_number(run.precision);
  if (held.elements > 0 && !one_process && layout.zero <= 2) {
    const int64_t p = held.elements, tensors = held.tensors;
    if (layout.zero == 0) {
      bytes[data] = 4 * (p + tensors) + 8;  // DDP's buckets: gradients and one flag each
    } else {                                // flags, scatter, gather, norm, loss
      bytes[data] = 4 * tensors + (4 + gathered) * padded(p) + 8 + 8;
    }
  }
  // ZeRO-3: each unit gathered (all-gather output) and its gradient reduce-scattered (input).
  if (!held.by_unit.empty() && held.elements > 0 && !one_process && layout.zero == 3) {
    const int64_t total = padded_units(held, n);
    const int64_t root = padded(held.by_unit[0]);
    const int64_t first_block = held.by_unit.size() > 1 ? padded(held.by_unit[1]) : 0;
    const int64_t later = total - root - first_block;
    // Gathered for the whole step, then scattered once; or, without pp, gathered for each
    // micro-batch's forward and backward (the root and the first block stay gathered between the
    // backward of one and the forward of the next) and each later unit scattered each time.
    const int64_t gathers =
        layout.pp > 1 ? total : 2 * total + (m - 1) * (root + first_block + 2 * later);
    const int64_t scatters = layout.pp > 1 ? total : total + (m - 1) * later;
    // With the flags, the norm and the loss.
    bytes[data] = gathered * gathers + 4 * scatters + 4 * held.tensors + 8 + 8;
  }
}

}  // namespace

std::map<std::string, int64_t> predicted_traffic(const Layout& layout, const Workload& run,
                                                 int64_t world_rank, const HeldParameters& held) {
  FIVEFOLD_CHECK(layout.dp >= 1, "predicted_traffic: the layout is not resolved (dp 0)");
  const RankWork work = work_of(layout, run, world_rank);
  Bytes bytes;
  // Chapter 14: the collectives inside a recomputed region run again in backward, as in forward:
  // a recomputed block's (Full) or every attention core's (Selective: inside it only chapter
  // 12's). The pipeline's sends and chapter 09's reductions are outside every region, and ZeRO-3
  // recomputes a block while its unit is still gathered for backward: nothing more there.
  const ch14::RecomputeConfig again = run.recompute.for_stage(work.at.pp);
  int64_t cores_again = 0;
  for (const int64_t layer : work.layers) cores_again += ch14::recomputes_attention(again, layer);
  pp_traffic(bytes, layout, run, work);
  cp_traffic(bytes, layout, run, work, cores_again);
  tp_traffic(bytes, layout, run, work, held, again);
  const bool experts = ep_traffic(bytes, layout, run, work, held, again);
  dp_traffic(bytes, layout, run, held, experts);
  return bytes;
}

}  // namespace fivefold::ch15
