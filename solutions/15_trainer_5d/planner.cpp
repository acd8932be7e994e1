// Chapter 15: a layout's step time and memory from the chapters' terms, and the search over
// layouts.
#include "15_trainer_5d/planner.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "02_flops_6np/flops.h"
#include "09_data_parallel/zero.h"
#include "10_tensor_parallel/layers.h"
#include "10_tensor_parallel/plan.h"
#include "11_pipeline_parallel/pipeline.h"
#include "11_pipeline_parallel/schedule.h"
#include "12_context_parallel/plan.h"
#include "14_memory/plan.h"
#include "fivefold/error.h"

namespace fivefold::ch15 {

void Cluster::validate() const {
  FIVEFOLD_CHECK(devices >= 1 && devices_per_node >= 1, "cluster '", name,
                 "': devices and devices per node must be at least 1");
  FIVEFOLD_CHECK(memory_bytes > 0, "cluster '", name, "': give each device's memory");
  FIVEFOLD_CHECK(
      matmul_flops_fp32 > 0 && matmul_flops_bf16 > 0 && peak_flops_fp32 > 0 && peak_flops_bf16 > 0,
      "cluster '", name, "': give the peak and sustained matmul FLOP/s in fp32 and bf16");
  FIVEFOLD_CHECK(optimizer_seconds_per_parameter >= 0, "cluster '", name,
                 "': the optimizer's seconds per parameter cannot be negative");
  FIVEFOLD_CHECK(intra_node.bandwidth > 0 && inter_node.bandwidth > 0 && intra_node.latency >= 0 &&
                     inter_node.latency >= 0,
                 "cluster '", name, "': give both links' bandwidth (> 0) and latency (>= 0)");
}

namespace {

// The link a group's messages cross. The mesh puts tp fastest, then cp, dp, pp (trainer_5d.h):
// a group of `size` ranks `stride` apart spans stride·size consecutive ranks, one node's link
// when that span fits in a node, the nodes' link otherwise (its slowest hop sets a ring's pace).
const Link& group_link(const Cluster& cluster, int64_t stride, int64_t size) {
  return stride * size <= cluster.devices_per_node ? cluster.intra_node : cluster.inter_node;
}

// Seconds for `calls` messages carrying `wire` bytes in all over `link`.
double transfer(const Link& link, double calls, double wire) {
  return calls * link.latency + wire / link.bandwidth;
}

// Ring collectives over n ranks: the wire bytes one rank sends for an all-reduce of `bytes`, and
// for an all-gather or reduce-scatter whose whole tensor is `bytes` (notes/08).
double all_reduce_wire(double bytes, int64_t n) { return 2.0 * (n - 1) / n * bytes; }
double gather_wire(double bytes, int64_t n) { return static_cast<double>(n - 1) / n * bytes; }

// The estimate with the pipeline's timeline left out: a step of m·v micro-batches back to back
// (exact without pp, a lower bound with it), for a rank that keeps `in_flight` micro-batches at
// once. `costs` receives the pipeline simulator's costs of one micro-batch through one stage.
StepEstimate estimate_before_pipeline(const Workload& work, const Layout& layout,
                                      const Cluster& cluster, ch14::Precision precision,
                                      int64_t in_flight, ch11::UnitCosts& costs) {
  FIVEFOLD_CHECK(work.model.extensions.is_null() && layout.ep == 1,
                 "estimate_step: the step-time model covers dense Llama-shaped models (no MLA, "
                 "no experts, ep 1)");
  const ch02::TransformerShape shape = work.model.shape();
  const int64_t t = layout.tp, c = layout.cp, p = layout.pp, v = layout.virtual_stages;
  const int64_t d = layout.dp, m = work.micro_batches, L = shape.n_layers;
  const int64_t rows = work.batch / (d * m), seq = work.seq_len;
  const double tokens = static_cast<double>(rows * seq) / c;  // a micro-batch's, on this rank
  const bool bf16 = precision == ch14::Precision::Bf16;
  const int64_t element = bf16 ? 2 : 4;
  const double flops_per_s = bf16 ? cluster.matmul_flops_bf16 : cluster.matmul_flops_fp32;
  const ch14::Recompute mode = work.recompute.mode;

  // Compute (chapter 02's count per token): tp splits every product by heads and features, cp the
  // tokens (zig-zag balances the causal work). Attention is chapter 12's causal blockwise kernel:
  // half the square of scores, 2(d_k + d_v) FLOPs a score forward, 6·d_k + 4·d_v backward (which
  // computes q·kᵀ again instead of keeping the probabilities).
  const ch02::FlopBreakdown f = ch02::forward_flops_per_token(shape, seq);
  const double block_products = (f.qkv + f.output_projection + f.mlp) / L;
  const double block_attention = (f.attention_scores + f.attention_values) / L / 2;
  const double block_attention_training =
      block_attention * ch12::blockwise_flops_per_score(shape.head_dim, shape.head_dim) /
      (4.0 * shape.head_dim);
  const double seconds = tokens / t / flops_per_s;  // per FLOP of one token, for this rank
  // Chapter 11 splits the blocks over the p·v virtual stages; the last also runs the head. The
  // costs below are the largest stage's blocks (and the head without a pipeline); costs.scale
  // weighs each stage against it.
  std::vector<int64_t> blocks;
  for (const auto& [first, last] : ch11::stage_layers(L, p * v)) blocks.push_back(last - first);
  const int64_t layers = *std::max_element(blocks.begin(), blocks.end());
  const double head = p == 1 ? f.lm_head * seconds : 0;
  const double products = layers * block_products * seconds + head;
  const double attention = layers * block_attention * seconds;
  const double attention_backward = layers * (block_attention_training - block_attention) * seconds;
  if (p > 1) {
    const double block_work = 3 * block_products + block_attention_training;
    costs.scale.clear();
    for (size_t s = 0; s < blocks.size(); ++s)
      costs.scale.push_back(
          (blocks[s] * block_work + (s + 1 == blocks.size() ? 3 * f.lm_head : 0)) /
          (layers * block_work));
  }
  // The busiest rank's share of the step's work, in stages of the largest (rank r runs stages
  // r, r + p, ...).
  double busiest = v;
  if (p > 1) {
    std::vector<double> work_of(static_cast<size_t>(p), 0.0);
    for (size_t s = 0; s < costs.scale.size(); ++s)
      work_of[s % static_cast<size_t>(p)] += costs.scale[s];
    busiest = *std::max_element(work_of.begin(), work_of.end());
  }
  double recomputed = 0;  // chapter 14: what backward runs forward again
  if (mode == ch14::Recompute::Full) recomputed = products - head + attention;
  if (mode == ch14::Recompute::Selective) recomputed = attention;

  // Tensor parallelism (chapter 10): its all-reduces, or all-gathers and reduce-scatters, of one
  // micro-batch through a stage's blocks, half forward and half backward; none of it hidden.
  double tp_forward = 0;
  if (t > 1) {
    ch02::TransformerShape stage = shape;
    stage.n_layers = layers;
    const auto traffic = ch10::tensor_parallel_traffic(stage, static_cast<int>(t), rows, seq / c,
                                                       layout.sequence_parallel, element);
    const double calls = static_cast<double>(traffic.all_reduce.calls + traffic.all_gather.calls +
                                             traffic.reduce_scatter.calls);
    tp_forward = transfer(group_link(cluster, 1, t), calls, traffic.wire_bytes()) / 2;
  }
  const double tp_recomputed = mode == ch14::Recompute::Full ? tp_forward : 0;

  // Context parallelism (chapter 12), per block: the ring's sends run beside the attention they
  // feed, so only what outlasts the block's attention shows; the all-gather kernel waits for its
  // keys and values. Chapter 12 counts 4-byte elements.
  double cp_forward = 0, cp_backward = 0;
  if (c > 1) {
    const auto traffic = ch12::context_parallel_traffic(
        c, 0, rows, seq, std::max<int64_t>(1, shape.n_kv_heads / t), shape.head_dim, shape.head_dim,
        layout.cp_layout, layout.cp_attention);
    const Link& link = group_link(cluster, t, c);
    const double scale = element / 4.0;
    const double payload =
        static_cast<double>(traffic.send_recv.payload_bytes + traffic.all_gather.payload_bytes +
                            traffic.all_to_all.payload_bytes);
    const double forward_share = traffic.forward_payload_bytes / payload;
    const double block_attention_time = attention / layers;  // forward; backward twice that
    if (layout.cp_attention == ch12::CpAttention::Ring) {
      const double sends = transfer(link, static_cast<double>(traffic.send_recv.calls),
                                    traffic.send_recv.payload_bytes * scale);
      cp_forward = std::max(0.0, sends * forward_share - block_attention_time);
      cp_backward = std::max(0.0, sends * (1 - forward_share) - 2 * block_attention_time);
    } else {
      cp_forward = transfer(link, static_cast<double>(traffic.all_gather.calls),
                            gather_wire(traffic.all_gather.payload_bytes * scale, c));
      cp_backward = transfer(link, static_cast<double>(traffic.all_to_all.calls),
                             gather_wire(traffic.all_to_all.payload_bytes * scale, c));
    }
    cp_forward *= layers;
    cp_backward *= layers;
  }

  // The pipeline (chapter 11): each stage sends its output forward and its input's gradient back,
  // one micro-batch at a time (split over tp under sequence parallelism).
  double pp_send = 0;
  if (p > 1) {
    const double bytes = tokens * shape.d_model * element / (layout.sequence_parallel ? t : 1);
    pp_send = transfer(group_link(cluster, t * c * d, p), 1, bytes);
  }

  // One micro-batch through the largest stage, as chapter 11's simulator takes it.
  StageTimes stage;
  stage.products = products;
  stage.attention_forward = attention;
  stage.attention_backward = attention_backward;
  stage.recomputed = recomputed;
  stage.tp = tp_forward;
  stage.tp_recomputed = tp_recomputed;
  stage.cp_forward = cp_forward;
  stage.cp_backward = cp_backward;
  stage.pp_send = pp_send;
  const std::vector<double> scale = costs.scale;
  costs = micro_batch_costs(stage);
  costs.scale = scale;
  const double per_micro_batch = costs.forward + costs.backward_input + costs.backward_weight;
  const double makespan = m * busiest * per_micro_batch;

  StepEstimate e;
  int64_t last_blocks = 0;  // on the last pipeline rank
  for (size_t s = static_cast<size_t>(p) - 1; s < blocks.size(); s += static_cast<size_t>(p))
    last_blocks += blocks[s];
  const double rank_tokens = m * tokens / t;  // a step's, times the products' share
  const bool full = mode == ch14::Recompute::Full, again = mode != ch14::Recompute::None;
  e.flops.matrices = std::llround(rank_tokens * last_blocks * block_products * (full ? 4 : 3));
  e.flops.attention = std::llround(rank_tokens * last_blocks *
                                   (block_attention_training + (again ? block_attention : 0)));
  e.flops.head = std::llround(rank_tokens * f.lm_head * 3);
  e.compute = m * busiest * (3 * products + attention + attention_backward + recomputed);
  e.exposed["tp"] = m * busiest * (2 * tp_forward + tp_recomputed);
  e.exposed["cp"] = m * busiest * (cp_forward + cp_backward);
  e.exposed["pp"] = m * busiest * 2 * pp_send;

  // State (chapter 09's ZeRO formulas over dp·cp, which average the gradients) for the rank that
  // holds the most: its blocks, the embedding on the first stage, the final norm and the head on
  // the last (a tied embedding's copy there, as chapter 11 keeps it); tp's share as chapter 10
  // splits the whole model.
  const ch02::ParameterCount count = ch02::count_parameters(shape);
  const int64_t final_norm = shape.d_model;
  const int64_t per_block = (count.attention + count.mlp + count.norms - final_norm) / L;
  std::vector<int64_t> rank_held(static_cast<size_t>(p), 0);
  for (size_t s = 0; s < blocks.size(); ++s)
    rank_held[s % static_cast<size_t>(p)] += blocks[s] * per_block;
  rank_held.front() += count.embedding;
  rank_held.back() +=
      final_norm + (p > 1 && shape.tied_embeddings ? count.embedding : count.lm_head);
  const double tp_share =
      static_cast<double>(ch10::parameters_per_rank(shape, static_cast<int>(t))) / count.total;
  const int64_t held = static_cast<int64_t>(std::ceil(
      tp_share * static_cast<double>(*std::max_element(rank_held.begin(), rank_held.end()))));
  const int64_t replicas = d * c;
  ch03::StateBytes state = ch09::zero_memory_formula(held, replicas, layout.zero);
  if (bf16) state = {state.parameters / 2, state.gradients / 2, state.optimizer * 3 / 2};
  e.state_bytes = state.total();

  // Activations (chapter 14's block term, this rank's share under tp or cp) for the micro-batches
  // the schedule keeps in flight, each through one virtual stage.
  ch14::TensorParallelShare tp_share_of{t, 0, layout.sequence_parallel};
  ch14::ContextParallelShare cp_share{c, 0, layout.cp_layout, layout.cp_attention};
  int64_t block = 0;
  if (c > 1) {
    // tp with cp is not derived in chapter 14: this rank's heads and features under cp, and with
    // sequence parallelism the residual stream's part (6d + 2 numbers a token, or full
    // recomputation's kept input, d) for its 1/t of the tokens, as chapter 14 counts it under tp.
    block = ch14::block_activation_bytes(ch10::rank_shape(shape, static_cast<int>(t)), rows, seq,
                                         mode, {}, precision, cp_share);
    if (layout.sequence_parallel) {
      const int64_t per_token =
          mode == ch14::Recompute::Full ? shape.d_model : 6 * shape.d_model + 2;
      block -= static_cast<int64_t>(4 * tokens * (t - 1) / t) * per_token;
    }
  } else {
    block = ch14::block_activation_bytes(shape, rows, seq, mode, tp_share_of, precision);
  }
  const int64_t stage_input =
      static_cast<int64_t>(tokens) * shape.d_model * 4 / (layout.sequence_parallel ? t : 1);
  const int64_t logits = 2 * static_cast<int64_t>(tokens) * (shape.vocab_size / t) * 4;
  const int64_t per_micro_batch_kept = layers * block + stage_input;  // the last stage: + logits
  e.activation_bytes =
      p == 1 ? per_micro_batch_kept + logits
             : std::max(in_flight * per_micro_batch_kept, per_micro_batch_kept + logits);

  // The data-parallel reduction of the step's gradients (fp32) runs beside the last micro-batch's
  // backward (chapter 09's buckets); ZeRO-1 and 2 also gather the updated parameters; ZeRO-3
  // gathers them for every micro-batch's forward and backward and reduces each micro-batch's
  // gradients, each unit when it is needed: chapter 09 does not prefetch, so none of it hides.
  double dp_time = 0;
  if (replicas > 1) {
    const Link& link = group_link(cluster, t, replicas);
    const double grads = 4.0 * held, params = static_cast<double>(element) * held;
    const double messages = std::ceil(grads / 25e6) * 2 * (replicas - 1);  // 25 MB buckets
    if (layout.zero == 0) {
      dp_time = std::max(0.0, transfer(link, messages, all_reduce_wire(grads, replicas)) -
                                  busiest * (costs.backward_input + costs.backward_weight));
    } else if (layout.zero < 3) {
      dp_time = std::max(0.0, transfer(link, messages / 2, gather_wire(grads, replicas)) -
                                  busiest * (costs.backward_input + costs.backward_weight)) +
                transfer(link, messages / 2, gather_wire(params, replicas));
    } else {
      const double each = transfer(link, 1.5 * messages, gather_wire(2 * params + grads, replicas));
      dp_time = m * each;
    }
  }
  e.exposed["dp"] = dp_time;
  // The optimizer updates what the rank keeps: its parameters, or under ZeRO its 1/N shard.
  e.optimizer = cluster.optimizer_seconds_per_parameter *
                static_cast<double>(layout.zero == 0 ? held : (held + replicas - 1) / replicas);

  e.step = makespan + dp_time + e.optimizer;
  const double step_tokens = static_cast<double>(work.batch) * seq;
  e.model_flops = step_tokens * 3 * (f.total() - (f.attention_scores + f.attention_values) / 2);
  const double peak = bf16 ? cluster.peak_flops_bf16 : cluster.peak_flops_fp32;
  e.mfu = e.model_flops / (e.step * cluster.devices * peak);
  e.tokens_per_second = step_tokens / e.step;
  return e;
}

// The pipeline's idle time (chapter 11's simulator run on the modelled costs) added to `e`.
void add_pipeline(StepEstimate& e, const ch11::Simulation& timeline) {
  const double scale = e.tokens_per_second * e.step;  // tokens a step
  e.bubble = timeline.makespan -
             (e.step - e.exposed.at("dp") - e.optimizer);  // the busiest rank's idle time
  e.mfu *= e.step / (e.step + e.bubble);
  e.step += e.bubble;
  e.tokens_per_second = scale / e.step;
}

ch11::Schedule schedule_of(const Layout& layout, int64_t m) {
  return ch11::make_schedule(layout.schedule, layout.pp, layout.virtual_stages, m);
}

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> out;
  for (int64_t k = 1; k <= n; ++k)
    if (n % k == 0) out.push_back(k);
  return out;
}

int64_t most_in_flight(const ch11::Simulation& timeline) {
  return *std::max_element(timeline.peak_in_flight.begin(), timeline.peak_in_flight.end());
}

}  // namespace

StepEstimate estimate_step(const Workload& work, const Layout& layout, const Cluster& cluster,
                           ch14::Precision precision) {
  ch11::UnitCosts costs;
  if (layout.pp == 1) return estimate_before_pipeline(work, layout, cluster, precision, 1, costs);
  const ch11::Schedule schedule = schedule_of(layout, work.micro_batches);
  const int64_t in_flight = most_in_flight(ch11::simulate(schedule));
  StepEstimate e = estimate_before_pipeline(work, layout, cluster, precision, in_flight, costs);
  add_pipeline(e, ch11::simulate(schedule, costs));
  return e;
}

Search search_layouts(const Workload& work, const Cluster& cluster, ch14::Precision precision,
                      const SearchLimits& limits) {
  cluster.validate();
  const int64_t keep = limits.keep, max_micro_batches = limits.max_micro_batches;
  FIVEFOLD_CHECK(keep >= 1 && max_micro_batches >= 1,
                 "search_layouts: keep and max_micro_batches must be at least 1");
  auto allowed = [](int64_t size, int64_t fixed) { return fixed == 0 || size == fixed; };
  const int64_t world = cluster.devices;
  Search search;
  // The micro-batches each rank keeps depend only on the schedule's lists, not on the costs.
  std::map<std::tuple<std::string, int64_t, int64_t, int64_t>, int64_t> in_flight;
  auto consider = [&](const Layout& layout, const Workload& w) {
    int64_t held = 1;
    if (layout.pp > 1) {
      const auto key =
          std::make_tuple(layout.schedule, layout.pp, layout.virtual_stages, w.micro_batches);
      auto found = in_flight.find(key);
      if (found == in_flight.end())
        found =
            in_flight
                .emplace(key, most_in_flight(ch11::simulate(schedule_of(layout, w.micro_batches))))
                .first;
      held = found->second;
    }
    search.valid += 1;
    ch11::UnitCosts costs;
    StepEstimate e = estimate_before_pipeline(w, layout, cluster, precision, held, costs);
    if (e.memory_bytes() > cluster.memory_bytes) return;
    search.fit += 1;
    const bool full = static_cast<int64_t>(search.best.size()) >= keep;
    if (full && e.step >= search.best.back().estimate.step) return;  // the bubble only adds
    if (layout.pp > 1) {
      add_pipeline(e, ch11::simulate(schedule_of(layout, w.micro_batches), costs));
    }
    if (full && e.step >= search.best.back().estimate.step) return;
    Candidate candidate{layout, w.micro_batches, w.recompute.mode, e};
    auto at =
        std::upper_bound(search.best.begin(), search.best.end(), e.step,
                         [](double step, const Candidate& c) { return step < c.estimate.step; });
    search.best.insert(at, candidate);
    if (static_cast<int64_t>(search.best.size()) > keep) search.best.pop_back();
  };
  for (int64_t tp : divisors(world))
    for (int64_t cp : divisors(world / tp))
      for (int64_t pp : divisors(world / (tp * cp))) {
        const int64_t dp = world / (tp * cp * pp);
        if (!allowed(tp, limits.tp) || !allowed(cp, limits.cp) || !allowed(pp, limits.pp) ||
            !allowed(dp, limits.dp))
          continue;
        if (work.batch % dp != 0) continue;  // resolve_layout refuses every m
        std::vector<std::pair<std::string, int64_t>> schedules = {{"1f1b", 1}};
        if (pp > 1) {
          schedules = {{"gpipe", 1}, {"1f1b", 1}, {"zb", 1}};
          for (int64_t v = 2; v * pp <= work.model.n_layers; ++v)  // more: fewer than a layer
            schedules.emplace_back("interleaved", v);
        }
        // Sequence parallelism asks one more thing of tp (check_tensor_parallel); the ZeRO
        // stage and cp's kernel ask nothing of the model, the batch or the schedule.
        bool sp_allowed = tp > 1;
        try {
          if (tp > 1) ch10::check_tensor_parallel(work.model, static_cast<int>(tp), true);
        } catch (const Error&) {
          sp_allowed = false;
        }
        for (int64_t m : divisors(work.batch / dp)) {
          if (m > max_micro_batches) break;
          if (!allowed(m, limits.micro_batches)) continue;
          for (const auto& [schedule, v] : schedules) {
            if ((!limits.schedule.empty() && pp > 1 && schedule != limits.schedule) ||
                (pp > 1 && !allowed(v, limits.virtual_stages)))
              continue;
            Layout base;
            base.dp = dp;
            base.tp = tp;
            base.pp = pp;
            base.cp = cp;
            base.schedule = schedule;
            base.virtual_stages = v;
            Workload w = work;
            w.micro_batches = m;
            try {
              base = resolve_layout(base, world, w);  // the trainer's own checks
            } catch (const Error&) {
              continue;
            }
            for (int zero = 0; zero <= (dp * cp > 1 ? 3 : 0); ++zero)
              for (bool sp : {false, true})
                if (limits.zero < 0 || zero == limits.zero || dp * cp == 1)
                  for (auto attention : {ch12::CpAttention::Ring, ch12::CpAttention::AllGather}) {
                    if ((sp && !sp_allowed) || (cp == 1 && attention != ch12::CpAttention::Ring))
                      continue;
                    Layout layout = base;
                    layout.zero = zero;
                    layout.sequence_parallel = sp;
                    layout.cp_attention = attention;
                    for (auto mode : {ch14::Recompute::None, ch14::Recompute::Selective,
                                      ch14::Recompute::Full}) {
                      w.recompute = {mode, 1, 0};
                      consider(layout, w);
                    }
                  }
          }
        }
      }
  search.dropped = search.valid - search.fit;
  return search;
}

}  // namespace fivefold::ch15
