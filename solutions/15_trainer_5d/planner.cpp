// Chapter 15: a layout's step time and memory from the chapters' terms (the search over layouts
// is search.cpp).
#include "15_trainer_5d/planner.h"
#include "planner_parts.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "02_flops_6np/flops.h"
#include "07_moe/moe.h"
#include "09_data_parallel/zero.h"
#include "10_tensor_parallel/layers.h"
#include "10_tensor_parallel/plan.h"
#include "11_pipeline_parallel/pipeline.h"
#include "11_pipeline_parallel/schedule.h"
#include "12_context_parallel/plan.h"
#include "14_memory/plan.h"
#include "fivefold/error.h"
#include "fivefold/seed.h"

namespace fivefold::ch15 {

namespace {

// What the rank that holds the most keeps of the model, in numbers: `held` trained and every
// rank's of dp·cp alike, `experts` trained and its 1/ep of the routed experts (chapter 13),
// `frozen` stored with no gradient or moments (the router's bias). Its blocks, the embedding on
// the first stage, the final norm and the head on the last (a tied embedding's copy there, as
// chapter 11 keeps it); tp's share as chapter 10 splits the whole model.
struct Holding {
  int64_t held = 0, experts = 0, frozen = 0;
};
Holding busiest_holding(const Workload& work, const Layout& layout,
                        const std::vector<std::pair<int64_t, int64_t>>& stages,
                        const std::vector<ch07::BlockParameters>& blocks,
                        const std::vector<ch10::RankBlock>& rank_blocks) {
  const ch02::TransformerShape shape = work.model.shape();
  const int64_t p = layout.pp;
  const ch02::ParameterCount count = ch02::count_parameters(shape);
  const bool split = !rank_blocks.empty();  // MLA's blocks: tp rank 0's share of each (chapter 10)
  std::vector<int64_t> replicated(static_cast<size_t>(p), 0), experts(replicated),
      frozen(replicated);
  for (size_t s = 0; s < stages.size(); ++s)
    for (int64_t i = stages[s].first; i < stages[s].second; ++i) {
      const ch07::BlockParameters& block = blocks[static_cast<size_t>(i)];
      int64_t total = block.total(), routed = block.experts * block.expert;
      if (split) {
        const ch10::RankBlock& mine = rank_blocks[static_cast<size_t>(i)];
        total = mine.held(), routed = mine.routed;
      }
      replicated[s % static_cast<size_t>(p)] += total - routed - block.frozen;
      experts[s % static_cast<size_t>(p)] += routed / layout.ep;
      frozen[s % static_cast<size_t>(p)] += block.frozen;
    }
  // The embedding and the head: tp rank 0's vocabulary rows under MLA's split, the whole here for
  // Llama's (which chapter 10's parameters_per_rank shares out below).
  const int64_t rows = split_sizes(shape.vocab_size, layout.tp)[0] * shape.d_model;
  const int64_t embedding = split ? rows : count.embedding;
  const int64_t head = split ? (shape.tied_embeddings && p == 1 ? 0 : rows) : count.lm_head;
  replicated.front() += embedding;
  replicated.back() += shape.d_model + (p > 1 && shape.tied_embeddings ? embedding : head);
  const double tp_share =
      split ? 1.0
            : static_cast<double>(ch10::parameters_per_rank(shape, static_cast<int>(layout.tp))) /
                  count.total;
  Holding most;
  for (int64_t r = 0; r < p; ++r) {
    const int64_t all =
        static_cast<int64_t>(std::ceil(tp_share * static_cast<double>(replicated[r] + experts[r])));
    if (all > most.held + most.experts) most = {all - experts[r], experts[r], frozen[r]};
  }
  return most;
}

// Activations (chapter 14's block term, this rank's share under tp or cp, each block in the mode
// its stage recomputes it: blocks_activation_bytes, as `train --plan` counts) for the micro-batches
// the schedule keeps in flight (`in_flight`), each through one virtual stage, on the stage that
// keeps the most; plus the stage's input, and the logits on the last.
int64_t kept_activations(const Workload& work, const Layout& layout,
                         const std::vector<std::pair<int64_t, int64_t>>& stages,
                         ch14::Precision precision, int64_t in_flight) {
  const ch02::TransformerShape shape = work.model.shape();
  const int64_t t = layout.tp, c = layout.cp, p = layout.pp;
  const int64_t rows = work.batch / (layout.dp * work.micro_batches), seq = work.seq_len;
  const double tokens = static_cast<double>(rows * seq) / c;  // a micro-batch's, on this rank
  int64_t stage_kept = 0;  // the stage that keeps the most
  for (size_t s = 0; s < stages.size(); ++s) {
    const Layout::Place at{static_cast<int64_t>(s) % p, 0, 0, 0};  // virtual stage s's rank
    stage_kept = std::max(stage_kept, blocks_activation_bytes(layout, work, at, stages[s].first,
                                                              stages[s].second, precision));
  }
  const int64_t stage_input =
      static_cast<int64_t>(tokens) * shape.d_model * 4 / (layout.sequence_parallel ? t : 1);
  const int64_t logits = 2 * static_cast<int64_t>(tokens) * (shape.vocab_size / t) * 4;
  const int64_t per_micro_batch_kept = stage_kept + stage_input;  // the last stage: + logits
  return p == 1 ? per_micro_batch_kept + logits
                : std::max(in_flight * per_micro_batch_kept, per_micro_batch_kept + logits);
}

}  // namespace

// The estimate with the pipeline's timeline left out: a step of m·v micro-batches back to back
// (exact without pp, a lower bound with it), for a rank that keeps `in_flight` micro-batches at
// once. `costs` receives the pipeline simulator's costs of one micro-batch through one stage.
ModelTerms model_terms(const Workload& work) {
  const int64_t layers = work.model.n_layers;
  ModelTerms terms;
  for (int64_t i = 0; i < layers; ++i) {
    const ch02::FlopBreakdown b = ch07::block_forward_flops(work.model, i, work.seq_len);
    const ch07::BlockParameters block = ch07::block_parameters(work.model, i);
    terms.block.push_back(block);
    terms.products.push_back(b.qkv + b.output_projection + b.mlp);
    terms.attention.push_back((b.attention_scores + b.attention_values) / 2);
    terms.attention_training.push_back(
        terms.attention.back() * ch12::blockwise_flops_per_score(block.query_key, block.value) /
        (2.0 * (block.query_key + block.value)));
    if (block.experts > 0) terms.experts = block.experts, terms.per_token = block.per_token;
  }
  const ch03::ModelConfig& config = work.model;
  int64_t first_moe = 0;  // the first MoE block, if any
  while (first_moe < layers && terms.block[static_cast<size_t>(first_moe)].experts == 0)
    ++first_moe;
  for (int64_t t = 1; t <= config.n_heads; ++t)
    for (bool sp : {false, true}) {
      if (config.n_heads % t != 0) continue;
      const auto dense = ch10::rank_block(config, 0, static_cast<int>(t), 0, sp);
      terms.split[{t, sp}] = {
          dense,
          first_moe < layers ? ch10::rank_block(config, first_moe, static_cast<int>(t), 0, sp)
                             : dense};
    }
  return terms;
}

namespace {

// What a block's products cost besides their FLOPs (Cluster::product_overhead), its matrices
// (ch10::rank_block) one by one: every token's by the rank's `tokens`, the router's by those it
// routes, each of the rank's `experts` by its `per_expert` rows.
double block_overhead(const Cluster& cluster, bool bf16, const ch10::RankBlock& block,
                      double tokens, double routed, double experts, double per_expert) {
  using Rows = ch10::RankMatrix::Rows;
  double seconds = 0;
  for (const ch10::RankMatrix& w : block.matrices) {
    if (w.rows == Rows::Expert) {
      seconds += experts * cluster.product_overhead(bf16, per_expert, w.in, w.out);
    } else {
      seconds +=
          cluster.product_overhead(bf16, w.rows == Rows::Every ? tokens : routed, w.in, w.out);
    }
  }
  return seconds;
}

// MLA's blocks as chapter 10 splits them for tp rank 0 (`rank_blocks`, one a block), and a token's
// forward FLOPs of each block's products: t times the rank's, the router and the routed experts
// on the share of the tokens the rank routes.
std::vector<double> split_products(const ModelTerms& terms, const Layout& layout,
                                   const MicroBatchShare& share,
                                   std::vector<ch10::RankBlock>& rank_blocks) {
  const auto& [dense, routed] = terms.split.at({layout.tp, layout.sequence_parallel});
  std::vector<double> products;
  for (const ch07::BlockParameters& block : terms.block) {
    const ch10::RankBlock& mine = block.experts > 0 ? routed : dense;
    rank_blocks.push_back(mine);
    products.push_back(
        2.0 * layout.tp *
        (mine.products + (mine.router + terms.per_token * mine.per_assignment) * share.routes));
  }
  return products;
}

// Each product's cost besides its FLOPs (Cluster: a latency, the bytes of a thin product): every
// matrix of the stage's blocks, a routed expert's for each of the rank's E/ep experts, each
// receiving its share of the ep group's routed tokens.
double stage_overhead(const Cluster& cluster, bool bf16, const ModelTerms& terms,
                      const Layout& layout, const BusiestStage& stage,
                      const MicroBatchShare& share) {
  if (cluster.product_latency_fp32 <= 0 && cluster.product_latency_bf16 <= 0 &&
      cluster.memory_bandwidth <= 0)
    return 0;
  const double tokens = share.tokens;
  const auto& [dense, moe] = terms.split.at({layout.tp, layout.sequence_parallel});
  const double experts = static_cast<double>(terms.experts) / layout.ep;
  const double per_expert =
      terms.experts == 0 ? 0 : tokens * share.routes * terms.per_token * layout.ep / terms.experts;
  double overhead = 0, dense_overhead = -1, moe_overhead = -1;  // each kind's once
  for (int64_t i = stage.first; i < stage.last; ++i) {
    const bool routed = terms.block[static_cast<size_t>(i)].experts > 0;
    double& each = routed ? moe_overhead : dense_overhead;
    if (each < 0)
      each = block_overhead(cluster, bf16, routed ? moe : dense, tokens, tokens * share.routes,
                            experts, per_expert);
    overhead += each;
  }
  return overhead;
}

}  // namespace

BusiestStage busiest_stage(const Layout& layout, const ModelTerms& terms,
                           const std::vector<double>& rank_products,
                           const std::vector<ch10::RankBlock>& rank_blocks) {
  const int64_t p = layout.pp, v = layout.virtual_stages;
  BusiestStage b;
  b.stages = ch11::stage_layers(static_cast<int64_t>(terms.block.size()), p * v);
  for (const auto& [first, last] : b.stages) {
    double work_of = 0;
    for (int64_t i = first; i < last; ++i)
      work_of += 3 * rank_products[i] + terms.attention_training[i];
    b.work.push_back(work_of);
  }
  b.largest = static_cast<size_t>(std::max_element(b.work.begin(), b.work.end()) - b.work.begin());
  std::tie(b.first, b.last) = b.stages[b.largest];
  for (int64_t i = b.first; i < b.last; ++i) {
    b.products += rank_products[i];
    b.attention += terms.attention[i];
    b.attention_training += terms.attention_training[i];
  }
  // ep's all-to-alls run in every MoE block the rank holds: a stage's share is the mean over the
  // stages of the rank that holds the largest (whose dense blocks may leave it none of its own).
  // Under tp, that rank's blocks' partial gradients are summed once a step.
  for (size_t s = b.largest % static_cast<size_t>(p); s < b.stages.size();
       s += static_cast<size_t>(p))
    for (int64_t i = b.stages[s].first; i < b.stages[s].second; ++i) {
      b.moe_layers += terms.block[static_cast<size_t>(i)].experts > 0 ? 1.0 / v : 0.0;
      if (!rank_blocks.empty()) b.partial += rank_blocks[static_cast<size_t>(i)].partial;
    }
  return b;
}

StepEstimate estimate_before_pipeline(const Workload& work, const ModelTerms& terms,
                                      const Layout& layout, const Cluster& cluster,
                                      ch14::Precision precision, int64_t in_flight,
                                      ch11::UnitCosts& costs) {
  const ch03::ModelConfig& config = work.model;
  const bool deepseek = !config.extensions.is_null();  // chapter 06's MLA, chapter 07's experts
  FIVEFOLD_CHECK(!deepseek || config.extensions.contains("kv_lora_rank"),
                 "estimate_step: experts without MLA are not priced (chapter 14's activations "
                 "are derived for DeepSeek-V3's block, MLA and experts together)");
  const ch02::TransformerShape shape = config.shape();
  const int64_t t = layout.tp, c = layout.cp, p = layout.pp;
  const int64_t m = work.micro_batches, L = shape.n_layers, seq = work.seq_len;
  const bool bf16 = precision == ch14::Precision::Bf16;
  MicroBatchShare share;
  share.rows = work.batch / (layout.dp * m);
  share.tokens = static_cast<double>(share.rows * seq) / c;
  share.element = ch14::bytes_per_number(precision);
  const double tokens = share.tokens;
  const double flops_per_s = bf16 ? cluster.matmul_flops_bf16 : cluster.matmul_flops_fp32;
  const ch14::Recompute mode = work.recompute.mode;

  // Compute (chapter 07's count per token of each block, chapter 02's for Llama): tp splits every
  // product by heads and features, cp the tokens (zig-zag balances the causal work). Attention is
  // chapter 12's causal blockwise kernel: half the square of scores, 2(d_k + d_v) FLOPs a score
  // forward, 6·d_k + 4·d_v backward (which computes q·kᵀ again instead of keeping the
  // probabilities). A MoE block's products are its k experts', the router's and the shared ones'.
  const ch02::FlopBreakdown f = ch02::forward_flops_per_token(shape, seq);  // the head's
  const double seconds = tokens / t / flops_per_s;  // per FLOP of one token, for this rank
  // MLA's blocks split as chapter 10 splits them (rank_block, for tp rank 0: the most): the heads
  // split, the down-projections, the router and the routed experts whole, the router and the
  // experts multiplying the tokens the rank routes (under sequence parallelism its own part);
  // a token's products are then t times its rank's, as `seconds` counts them. Llama's split
  // evenly.
  const int64_t s_r = ch14::ContextParallelShare{c, 0, layout.cp_layout, layout.cp_attention}
                          .tokens(seq);
  share.routes =
      static_cast<double>(ch14::TensorParallelShare{t, 0, layout.sequence_parallel}.own(s_r)) /
      static_cast<double>(s_r);
  std::vector<ch10::RankBlock> rank_blocks;
  const std::vector<double> rank_products =
      deepseek ? split_products(terms, layout, share, rank_blocks) : terms.products;
  const double attention_rate = bf16 ? cluster.attention_flops_bf16 : cluster.attention_flops_fp32;
  const double attention_seconds = attention_rate > 0 ? tokens / t / attention_rate : seconds;
  // Chapter 11 splits the blocks over the p·v virtual stages; the last also runs the head. The
  // costs below are those of the stage with the most work in its blocks (and the head without a
  // pipeline); costs.scale weighs each stage against it.
  const BusiestStage stage = busiest_stage(layout, terms, rank_products, rank_blocks);
  // The head: tp rank 0's vocabulary rows (chapter 10 gives the first V mod t ranks one more).
  const int64_t head_rows = split_sizes(shape.vocab_size, t)[0];
  const double head_share =
      static_cast<double>(head_rows) / static_cast<double>(shape.vocab_size) * t;  // of a 1/t
  const double head =
      p == 1 ? f.lm_head * head_share * seconds +
                   cluster.product_overhead(bf16, tokens, shape.d_model, head_rows)
             : 0;
  const double overhead = stage_overhead(cluster, bf16, terms, layout, stage, share);
  const double products = stage.products * seconds + overhead + head;
  const double attention = stage.attention * attention_seconds;
  const double attention_backward = (stage.attention_training - stage.attention) * attention_seconds;
  if (p > 1) {
    costs.scale.clear();
    for (size_t s = 0; s < stage.stages.size(); ++s)
      costs.scale.push_back(
          (stage.work[s] + (s + 1 == stage.stages.size() ? 3 * f.lm_head : 0)) /
          stage.work[stage.largest]);
  }
  // The busiest rank's share of the step's work, in stages of the largest (rank r runs stages
  // r, r + p, ...).
  double busiest = static_cast<double>(layout.virtual_stages);
  if (p > 1) {
    std::vector<double> work_of(static_cast<size_t>(p), 0.0);
    for (size_t s = 0; s < costs.scale.size(); ++s)
      work_of[s % static_cast<size_t>(p)] += costs.scale[s];
    busiest = *std::max_element(work_of.begin(), work_of.end());
  }
  double recomputed = 0;  // chapter 14: what backward runs forward again
  if (mode == ch14::Recompute::Full) recomputed = products - head + attention;
  if (mode == ch14::Recompute::Selective) recomputed = attention;

  // One micro-batch through the largest stage, as chapter 11's simulator takes it, with each
  // parallelism's communication (communication.cpp).
  const bool full = mode == ch14::Recompute::Full, again = mode != ch14::Recompute::None;
  StageTimes times;
  times.products = products;
  times.attention_forward = attention;
  times.attention_backward = attention_backward;
  times.recomputed = recomputed;
  times.tp = tp_forward_seconds(work, layout, cluster, share, stage, rank_blocks);
  times.tp_recomputed = full ? times.tp : 0;
  std::tie(times.cp_forward, times.cp_backward) =
      cp_seconds(work, terms, layout, cluster, share, stage, attention);
  std::tie(times.ep_forward, times.ep_backward) =
      ep_seconds(work, terms, layout, cluster, share, stage);
  times.ep_recomputed = full ? times.ep_forward : 0;
  times.pp_send = pp_send_seconds(work, layout, cluster, share);
  const std::vector<double> scale = costs.scale;
  costs = micro_batch_costs(times);
  costs.scale = scale;
  const double per_micro_batch = costs.forward + costs.backward_input + costs.backward_weight;
  const double makespan = m * busiest * per_micro_batch;

  StepEstimate e;
  double last_products = 0, last_attention = 0, last_attention_training = 0;  // the last rank's
  for (size_t s = static_cast<size_t>(p) - 1; s < stage.stages.size(); s += static_cast<size_t>(p))
    for (int64_t i = stage.stages[s].first; i < stage.stages[s].second; ++i) {
      last_products += rank_products[i];
      last_attention += terms.attention[i];
      last_attention_training += terms.attention_training[i];
    }
  const double rank_tokens = m * tokens / t;  // a step's, times the products' share
  e.flops.matrices = std::llround(rank_tokens * last_products * (full ? 4 : 3));
  e.flops.attention =
      std::llround(rank_tokens * (last_attention_training + (again ? last_attention : 0)));
  e.flops.head = std::llround(rank_tokens * f.lm_head * head_share * 3);
  e.compute = m * busiest * (3 * products + attention + attention_backward + recomputed);
  e.exposed["tp"] = m * busiest * (2 * times.tp + times.tp_recomputed);
  e.exposed["cp"] = m * busiest * (times.cp_forward + times.cp_backward);
  if (layout.ep > 1)
    e.exposed["ep"] = m * busiest * (times.ep_forward + times.ep_backward + times.ep_recomputed);
  e.exposed["pp"] = m * busiest * 2 * times.pp_send;

  // State (chapter 09's ZeRO formulas) for the rank that holds the most; ZeRO runs over the
  // dp·cp/ep ranks that hold the same experts (chapter 15's compose_step), for every parameter.
  const int64_t replicas = layout.dp * c / layout.ep;
  const auto [held, held_experts, frozen] =
      busiest_holding(work, layout, stage.stages, terms.block, rank_blocks);
  // In bf16 chapter 14's master weights: 2 + 2 bytes a number, 12 for masters and moments.
  ch03::StateBytes state =
      ch09::zero_memory_formula(held + held_experts, replicas, layout.zero, share.element);
  state.parameters += 4 * frozen;  // kept whole, with no gradient or moments
  e.state_bytes = state.total();
  e.activation_bytes = kept_activations(work, layout, stage.stages, precision, in_flight);

  // The gradients' reductions: over dp (beside the last backward) and tp's partial sums.
  const double backward = busiest * (costs.backward_input + costs.backward_weight);
  const double dp_time =
      dp_seconds(layout, cluster, held, held_experts, share.element, m, backward);
  e.exposed["dp"] = dp_time;
  const double tp_sums = tp_partial_seconds(layout, cluster, stage.partial);
  if (stage.partial > 0) e.exposed["tp"] += tp_sums;
  e.reductions = dp_time + tp_sums;
  // The optimizer updates what the rank keeps: its parameters, or under ZeRO its 1/N shard.
  const int64_t updated = held + held_experts;
  e.optimizer =
      cluster.optimizer_seconds_per_parameter *
      static_cast<double>(layout.zero == 0 ? updated : (updated + replicas - 1) / replicas);

  e.step = makespan + e.reductions + e.optimizer;
  const double step_tokens = static_cast<double>(work.batch) * seq;
  double model_flops_per_token = f.lm_head;  // forward, causal attention
  for (int64_t i = 0; i < L; ++i)
    model_flops_per_token += terms.products[i] + terms.attention[i];
  e.model_flops = step_tokens * 3 * model_flops_per_token;
  const double peak = bf16 ? cluster.peak_flops_bf16 : cluster.peak_flops_fp32;
  e.mfu = e.model_flops / (e.step * cluster.devices * peak);
  e.tokens_per_second = step_tokens / e.step;
  return e;
}

// The pipeline's idle time (chapter 11's simulator run on the modelled costs) added to `e`.
void add_pipeline(StepEstimate& e, const ch11::Simulation& timeline) {
  const double scale = e.tokens_per_second * e.step;  // tokens a step
  e.bubble = timeline.makespan -
             (e.step - e.reductions - e.optimizer);  // the busiest rank's idle time
  e.mfu *= e.step / (e.step + e.bubble);
  e.step += e.bubble;
  e.tokens_per_second = scale / e.step;
}

ch11::Schedule schedule_of(const Layout& layout, int64_t m) {
  return ch11::make_schedule(layout.schedule, layout.pp, layout.virtual_stages, m);
}

int64_t most_in_flight(const ch11::Simulation& timeline) {
  return *std::max_element(timeline.peak_in_flight.begin(), timeline.peak_in_flight.end());
}

StepEstimate estimate_step(const Workload& work, const Layout& layout, const Cluster& cluster,
                           ch14::Precision precision) {
  ch11::UnitCosts costs;
  const ModelTerms terms = model_terms(work);
  if (layout.pp == 1)
    return estimate_before_pipeline(work, terms, layout, cluster, precision, 1, costs);
  const ch11::Schedule schedule = schedule_of(layout, work.micro_batches);
  const int64_t in_flight = most_in_flight(ch11::simulate(schedule));
  StepEstimate e =
      estimate_before_pipeline(work, terms, layout, cluster, precision, in_flight, costs);
  add_pipeline(e, ch11::simulate(schedule, costs));
  return e;
}

}  // namespace fivefold::ch15
