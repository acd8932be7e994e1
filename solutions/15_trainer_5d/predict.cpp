// Chapter 15: what each rank of a layout holds, carries and computes, from the chapters' formulas.
#include "15_trainer_5d/predict.h"
#include "predict_parts.h"

#include <functional>
#include <map>
#include <set>

#include "06_mla/mla.h"
#include "07_moe/moe.h"
#include "09_data_parallel/zero.h"
#include "10_tensor_parallel/layers.h"
#include "10_tensor_parallel/plan.h"
#include "11_pipeline_parallel/pipeline.h"
#include "11_pipeline_parallel/plan.h"
#include "12_context_parallel/attention.h"
#include "12_context_parallel/plan.h"
#include "13_expert_parallel/expert_parallel.h"
#include "14_memory/plan.h"
#include "fivefold/error.h"
#include "fivefold/seed.h"

namespace fivefold::ch15 {

size_t parameter_unit(const std::string& name) {
  const std::string prefix = "model.layers.";
  return name.rfind(prefix, 0) == 0 ? 1 + std::stoul(name.substr(prefix.size())) : 0;
}

TrainableCounts count_trainable(ch03::Transformer& model) {
  TrainableCounts counts;
  counts.by_unit.assign(static_cast<size_t>(model->config().n_layers + 1), 0);
  for (const auto& item : model->named_parameters()) {
    const auto& p = item.value();
    if (!p.requires_grad()) {
      counts.frozen += p.numel();
      continue;
    }
    counts.elements += p.numel();
    counts.tensors += 1;
    const size_t unit = parameter_unit(item.key());
    counts.by_unit[unit] += p.numel();
    if (item.key().find(".experts.") != std::string::npos) {
      if (counts.routed_by_unit.empty()) counts.routed_by_unit.assign(counts.by_unit.size(), 0);
      counts.routed_by_unit[unit] += p.numel();
      counts.routed_tensors += 1;
    }
  }
  return counts;
}

// ZeRO-3's S: each unit's elements padded to a multiple of the n data-parallel ranks, summed.
int64_t padded_units(const HeldParameters& held, int64_t n) {
  int64_t total = 0;
  for (int64_t u : held.by_unit) total += n * ((u + n - 1) / n);
  return total;
}

ch03::StateBytes predicted_state_bytes(const Layout& layout, const HeldParameters& held,
                                       ch14::Precision precision) {
  const int64_t n = layout.dp * layout.cp / layout.ep;
  const int64_t bytes = ch14::bytes_per_number(precision);  // a parameter's number
  if (layout.zero == 3) {  // FSDP shards each unit on its own: the formula unit by unit
    ch03::StateBytes b;
    for (const int64_t unit : held.by_unit) {
      const auto u = ch09::zero_memory_formula(unit, n, 3, bytes);
      b.parameters += u.parameters;
      b.gradients += u.gradients;
      b.optimizer += u.optimizer;
    }
    return b;
  }
  auto b = ch09::zero_memory_formula(held.elements, n, layout.zero, bytes);
  b.parameters += 4 * held.frozen;  // stored whole (fp32), with no gradient or moments
  return b;
}

RankWork work_of(const Layout& layout, const Workload& run, int64_t world_rank) {
  RankWork w;
  w.at = layout.place(world_rank);
  w.rows = run.batch / layout.dp;
  // Contiguous CP's slices, and sequence parallelism's parts of them, may differ by one.
  w.cp_positions =
      ch14::ContextParallelShare{layout.cp, w.at.cp, layout.cp_layout, layout.cp_attention}.tokens(
          run.seq_len);
  w.positions =
      ch14::TensorParallelShare{layout.tp, w.at.tp, layout.sequence_parallel}.own(w.cp_positions);
  // Virtual stage k·pp + r of pp·v for k < v; the first stage holds the embedding, the last the
  // head.
  const int64_t stages = layout.pp * layout.virtual_stages;
  const auto ranges = ch11::stage_layers(run.model.n_layers, stages);
  for (int64_t k = 0; k < layout.virtual_stages; ++k) {
    const auto [first, end] = ranges[static_cast<size_t>(k * layout.pp + w.at.pp)];
    for (int64_t layer = first; layer < end; ++layer) w.layers.push_back(layer);
  }
  w.first_stage = w.at.pp == 0;
  w.last_stage = w.at.pp == layout.pp - 1;
  return w;
}

namespace {

// The part's matrices by the tokens they multiply, from their Hugging Face names: the routers
// (mlp.gate), the routed experts (mlp.experts.j: one expert's per layer), the rest but the
// embedding and the head; only the blocks `chosen` takes (by global index).
MatmulWeights matmul_weights(ch03::Transformer& model,
                             const std::function<bool(int64_t layer)>& chosen) {
  MatmulWeights w;
  std::map<std::string, std::pair<int64_t, std::set<std::string>>> routed;  // layer -> experts
  for (const auto& item : model->named_parameters()) {
    const std::string& name = item.key();
    if (item.value().dim() != 2 || name.find("embed_tokens") != std::string::npos ||
        name.find("lm_head") != std::string::npos)
      continue;
    const size_t unit = parameter_unit(name);  // 1 + the block's index, 0 outside the blocks
    if (unit > 0 && !chosen(static_cast<int64_t>(unit) - 1)) continue;
    const int64_t n = item.value().numel();
    const auto experts = name.find(".mlp.experts.");
    if (experts != std::string::npos) {
      const auto id = name.substr(experts + 13, name.find('.', experts + 13) - experts - 13);
      auto& layer = routed[name.substr(0, experts)];
      layer.first += n;
      layer.second.insert(id);
    } else if (name.size() > 16 && name.compare(name.size() - 16, 16, ".mlp.gate.weight") == 0) {
      w.router += n;
    } else {
      w.dense += n;
    }
  }
  for (const auto& [layer, held] : routed)
    w.per_assignment += held.first / static_cast<int64_t>(held.second.size());
  return w;
}

}  // namespace

HeldParameters rank_parameters(const Layout& layout, const Workload& run,
                               int64_t world_rank) {
  FIVEFOLD_CHECK(layout.dp >= 1, "rank_parameters: the layout is not resolved (dp 0)");
  const Layout::Place at = layout.place(world_rank);
  const ch03::ModelPart part =
      layout.pp > 1
          ? ch11::stage_part(run.model.n_layers, layout.pp, layout.virtual_stages, at.pp)
          : ch03::ModelPart{};
  // The groups' places, as layout.cpp's mesh gives them: ep groups of consecutive dp·cp ranks.
  auto offline = [](int64_t rank, int64_t size, const char* name) {
    return dist::offline_communicator(static_cast<int>(rank), static_cast<int>(size), name);
  };
  const int64_t data_rank = at.dp * layout.cp + at.cp;
  ch13::ExpertParallel experts;
  if (layout.ep > 1) {
    experts.ep = offline(data_rank % layout.ep, layout.ep, "ep");
    experts.edp = offline(data_rank / layout.ep, layout.dp * layout.cp / layout.ep, "edp");
  }
  ch03::Transformer model{nullptr};
  std::shared_ptr<ch10::TensorParallel> tp;
  if (layout.tp > 1) {
    tp = std::make_shared<ch10::TensorParallel>(offline(at.tp, layout.tp, "tp"),
                                                layout.sequence_parallel);
    // Fewer key/value heads than ranks: the tp/K ranks reading the same head form a replica
    // group (TensorParallel::replica_group's split: consecutive ranks).
    const int64_t kv = run.model.n_kv_heads;
    if (run.model.extensions.is_null() && kv % layout.tp != 0 && layout.tp % kv == 0) {
      const int64_t share = layout.tp / kv;
      tp->replica_groups[static_cast<int>(kv)] =
          offline(at.tp % share, share, "tp.replicas");
    }
    model = ch10::make_model(run.model, tp, part);
    if (layout.ep > 1) ch13::adapt_moe_layers(model, experts);
  } else if (layout.ep > 1) {
    model = ch13::make_model(run.model, experts, part);
  } else {
    model = ch07::make_model(run.model, part);  // apply_layout's builder
  }
  HeldParameters held;
  static_cast<TrainableCounts&>(held) = count_trainable(model);
  held.tp_partial_by_unit.assign(held.by_unit.size(), 0);
  held.tp_replica_partial_by_unit.assign(held.by_unit.size(), 0);
  if (tp) {
    const auto parameters = model->named_parameters();
    for (const auto& [name, group] : ch10::partial_gradient_parameters(model, *tp)) {
      auto& by_unit = group == tp->comm ? held.tp_partial_by_unit : held.tp_replica_partial_by_unit;
      by_unit[parameter_unit(name)] += parameters[name].numel();
    }
  }
  held.matmul = matmul_weights(model, [](int64_t) { return true; });
  const ch14::RecomputeConfig again = run.recompute.for_stage(at.pp);
  held.recomputed = matmul_weights(model, [&again](int64_t layer) {
    return ch14::recomputes_block(again, layer);
  });
  return held;
}

StepFlops predicted_flops(const Layout& layout, const Workload& run, int64_t world_rank,
                          const HeldParameters& held) {
  FIVEFOLD_CHECK(layout.dp >= 1, "predicted_flops: the layout is not resolved (dp 0)");
  const MatmulWeights& w = held.matmul;
  FIVEFOLD_CHECK(w.dense + w.router + w.per_assignment > 0,
                 "predicted_flops: the rank's matrices are not known (rank_parameters)");
  const ch03::ModelConfig& model = run.model;
  const RankWork work = work_of(layout, run, world_rank);
  const int64_t tokens = work.rows * work.cp_positions, routed = work.rows * work.positions;
  StepFlops f;
  int64_t k = 0;  // experts per token
  if (ch07::has_routed_experts(model)) {
    const auto moe = ch07::MoeConfig::from_json(model.extensions);
    FIVEFOLD_CHECK(moe.capacity_factor <= 0,
                   "predicted_flops: experts with a capacity drop what the routing decides");
    k = moe.num_experts_per_tok;
  }
  f.matrices = 6 * (w.dense * tokens + w.router * routed + w.per_assignment * k * routed);
  if (work.last_stage)
    f.head = 6 * model.d_model *
             split_sizes(model.vocab_size, layout.tp)[static_cast<size_t>(work.at.tp)] * tokens;

  // Attention: per row and query head the scores the kernel computes, each costing c FLOPs.
  int64_t key_dim = model.resolved_head_dim(), value_dim = key_dim;
  if (!model.extensions.is_null()) {  // MLA (chapter 06's recipe)
    const auto dims = ch06::MlaConfig::from_json(model.extensions);
    key_dim = dims.qk_nope_head_dim + dims.qk_rope_head_dim;
    value_dim = dims.v_head_dim;
  }
  int64_t scores = 0, per_score = ch12::blockwise_flops_per_score(key_dim, value_dim);
  if (layout.cp > 1) {
    scores = ch12::attention_scores(layout.cp, work.at.cp, run.seq_len, layout.cp_layout,
                                    layout.cp_attention);
  } else if (run.attention_tile > 0) {
    const auto positions = torch::arange(run.seq_len, torch::kLong);
    scores = ch12::visible_scores(positions, positions, run.attention_tile);
  } else {  // chapter 03's kernel: the whole square, and backward keeps the probabilities
    scores = run.seq_len * run.seq_len;
    per_score = 6 * (key_dim + value_dim);
  }
  f.attention = static_cast<int64_t>(work.layers.size()) * work.rows *
                (model.n_heads / layout.tp) * scores * per_score;

  // Chapter 14: what backward runs forward again. Full: the recomputed blocks' matrices (2 per
  // weight and token: forward's share of 6) and their attention's forward products; selective:
  // every block's attention core. The forward products are q·kᵀ and the weighted values, 2·(d_k +
  // d_v) a score, whichever kernel computes them.
  const ch14::RecomputeConfig again = run.recompute.for_stage(work.at.pp);
  const MatmulWeights& r = held.recomputed;
  f.matrices += 2 * (r.dense * tokens + r.router * routed + r.per_assignment * k * routed);
  int64_t cores = 0;  // attention layers whose core runs again
  for (const int64_t layer : work.layers) cores += ch14::recomputes_attention(again, layer);
  f.attention += cores * work.rows * (model.n_heads / layout.tp) * scores *
                 2 * (key_dim + value_dim);
  return f;
}

std::map<std::string, int64_t> predicted_run_traffic(const Layout& layout,
                                                     const Workload& run, int64_t world_rank,
                                                     const HeldParameters& held, int64_t steps,
                                                     int64_t after_whole_model) {
  auto bytes = predicted_traffic(layout, run, world_rank, held);
  for (auto& [group, b] : bytes) b *= steps;
  const std::string data = bytes.count("edp") ? "edp" : "dp+cp";
  if (bytes.count(data) && layout.zero == 3) {
    const int64_t n = layout.dp * layout.cp / layout.ep;
    const int64_t gathered = ch14::bytes_per_number(run.precision);
    bytes[data] -= after_whole_model * gathered * padded_units(held, n);  // found gathered
  }
  return bytes;
}

int64_t block_kept(const Workload& run, int64_t layer, int64_t rows, ch14::Precision precision,
                   ch14::Recompute mode, const ch14::TensorParallelShare& tp,
                   const ch14::ContextParallelShare& cp, const ch14::ExpertParallelShare& ep) {
  const ch03::ModelConfig& config = run.model;
  if (run.block_activations)
    return run.block_activations(config, layer, rows, run.seq_len, precision, mode, tp, cp, ep);
  return config.extensions.is_null()
             ? ch14::block_activation_bytes(config.shape(), rows, run.seq_len, mode, tp,
                                            precision, cp)
             : ch14::deepseek_block_activation_bytes(config, layer, rows, run.seq_len, mode, tp,
                                                     cp, precision, ep);
}

int64_t blocks_activation_bytes(const Layout& layout, const Workload& run, const Layout::Place& at,
                                int64_t first, int64_t last, ch14::Precision precision) {
  const int64_t rows = run.batch / (layout.dp * run.micro_batches);
  const ch14::RecomputeConfig recompute = run.recompute.for_stage(at.pp);
  const ch14::TensorParallelShare tp{layout.tp, at.tp, layout.sequence_parallel};
  const ch14::ContextParallelShare cp{layout.cp, at.cp, layout.cp_layout, layout.cp_attention};
  const ch14::ExpertParallelShare ep{layout.ep, -1};  // the routing's balanced expectation
  int64_t bytes = 0;
  for (int64_t layer = first; layer < last; ++layer) {
    const ch14::Recompute mode =
        recompute.mode == ch14::Recompute::Full && !ch14::recomputes_block(recompute, layer)
            ? ch14::Recompute::None
            : recompute.mode;
    bytes += block_kept(run, layer, rows, precision, mode, tp, cp, ep);
  }
  return bytes;
}

ActivationPrediction predicted_activations(const Layout& layout, const Workload& run,
                                           int64_t world_rank, ch14::Precision precision) {
  const ch03::ModelConfig& config = run.model;
  const Layout::Place at = layout.place(world_rank);
  ActivationPrediction out;
  const ch03::ModelPart part =
      layout.pp > 1 ? ch11::stage_part(config.n_layers, layout.pp, layout.virtual_stages, at.pp)
                    : ch03::ModelPart{};
  std::vector<std::pair<int64_t, int64_t>> chunks = {
      {part.first_layer, part.end(config.n_layers)}};
  chunks.insert(chunks.end(), part.more_layers.begin(), part.more_layers.end());
  for (const auto& [first, last] : chunks)
    out.per_micro_batch = std::max(
        out.per_micro_batch, blocks_activation_bytes(layout, run, at, first, last, precision));
  if (layout.pp > 1) {
    const auto schedule = ch11::make_schedule(layout.schedule, layout.pp, layout.virtual_stages,
                                              run.micro_batches);
    out.in_flight = ch11::simulate(schedule).peak_in_flight[static_cast<size_t>(at.pp)];
  }
  return out;
}

}  // namespace fivefold::ch15
