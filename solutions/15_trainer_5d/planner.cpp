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
#include "13_expert_parallel/expert_parallel.h"
#include "14_memory/plan.h"
#include "fivefold/error.h"
#include "fivefold/seed.h"

namespace fivefold::ch15 {

namespace {

// The link a group's messages cross. The mesh puts tp fastest, then cp, dp, pp (trainer_5d.h):
// a group of `size` ranks `stride` apart spans stride·size consecutive ranks, one node's link
// when that span fits in a node, the nodes' link otherwise (its slowest hop sets a ring's pace).
const Link& group_link(const Cluster& cluster, int64_t stride, int64_t size) {
  return stride * size <= cluster.devices_per_node ? cluster.intra_node : cluster.inter_node;
}

// Ring collectives over n ranks: the wire bytes one rank sends for an all-reduce of `bytes`, and
// for an all-gather or reduce-scatter whose whole tensor is `bytes` (notes/08).
double all_reduce_wire(double bytes, int64_t n) { return 2.0 * (n - 1) / n * bytes; }
double gather_wire(double bytes, int64_t n) { return static_cast<double>(n - 1) / n * bytes; }

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

}  // namespace

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
  const int64_t t = layout.tp, c = layout.cp, p = layout.pp, v = layout.virtual_stages;
  const int64_t d = layout.dp, m = work.micro_batches, L = shape.n_layers;
  const int64_t rows = work.batch / (d * m), seq = work.seq_len;
  const double tokens = static_cast<double>(rows * seq) / c;  // a micro-batch's, on this rank
  const bool bf16 = precision == ch14::Precision::Bf16;
  const int64_t element = ch14::bytes_per_number(precision);
  const double flops_per_s = bf16 ? cluster.matmul_flops_bf16 : cluster.matmul_flops_fp32;
  const ch14::Recompute mode = work.recompute.mode;

  // Compute (chapter 07's count per token of each block, chapter 02's for Llama): tp splits every
  // product by heads and features, cp the tokens (zig-zag balances the causal work). Attention is
  // chapter 12's causal blockwise kernel: half the square of scores, 2(d_k + d_v) FLOPs a score
  // forward, 6·d_k + 4·d_v backward (which computes q·kᵀ again instead of keeping the
  // probabilities). A MoE block's products are its k experts', the router's and the shared ones'.
  const ch02::FlopBreakdown f = ch02::forward_flops_per_token(shape, seq);  // the head's
  const std::vector<double>&block_products = terms.products, &block_attention = terms.attention,
        &block_attention_training = terms.attention_training;
  const std::vector<ch07::BlockParameters>& block = terms.block;
  const double seconds = tokens / t / flops_per_s;  // per FLOP of one token, for this rank
  // MLA's blocks split as chapter 10 splits them (rank_block, for tp rank 0: the most): the heads
  // split, the down-projections, the router and the routed experts whole, the router and the
  // experts multiplying the tokens the rank routes (under sequence parallelism its own part);
  // a token's products are then t times its rank's, as `seconds` counts them. Llama's split
  // evenly.
  const int64_t s_r = ch14::ContextParallelShare{c, 0, layout.cp_layout, layout.cp_attention}
                          .tokens(seq);
  const double routes =
      static_cast<double>(ch14::TensorParallelShare{t, 0, layout.sequence_parallel}.own(s_r)) /
      static_cast<double>(s_r);  // of the rank's tokens, those it routes
  std::vector<ch10::RankBlock> rank_blocks;
  std::vector<double> rank_products = block_products;
  if (deepseek) {
    const auto& [dense, routed] = terms.split.at({t, layout.sequence_parallel});
    for (int64_t i = 0; i < L; ++i) {
      const ch10::RankBlock& mine = block[static_cast<size_t>(i)].experts > 0 ? routed : dense;
      rank_blocks.push_back(mine);
      rank_products[static_cast<size_t>(i)] =
          2.0 * t *
          (mine.products + (mine.router + terms.per_token * mine.per_assignment) * routes);
    }
  }
  const double attention_rate = bf16 ? cluster.attention_flops_bf16 : cluster.attention_flops_fp32;
  const double attention_seconds = attention_rate > 0 ? tokens / t / attention_rate : seconds;
  // Chapter 11 splits the blocks over the p·v virtual stages; the last also runs the head. The
  // costs below are those of the stage with the most work in its blocks (and the head without a
  // pipeline); costs.scale weighs each stage against it.
  const auto stages = ch11::stage_layers(L, p * v);
  std::vector<double> stage_work;  // a token's training FLOPs in each stage's blocks
  for (const auto& [first, last] : stages) {
    double work_of = 0;
    for (int64_t i = first; i < last; ++i)
      work_of += 3 * rank_products[i] + block_attention_training[i];
    stage_work.push_back(work_of);
  }
  const size_t largest = static_cast<size_t>(
      std::max_element(stage_work.begin(), stage_work.end()) - stage_work.begin());
  const auto [first_layer, last_layer] = stages[largest];
  const int64_t layers = last_layer - first_layer;
  double stage_products = 0, stage_attention = 0, stage_attention_training = 0;
  for (int64_t i = first_layer; i < last_layer; ++i) {
    stage_products += rank_products[i];
    stage_attention += block_attention[i];
    stage_attention_training += block_attention_training[i];
  }
  // ep's all-to-alls run in every MoE block the rank holds: a stage's share is the mean over the
  // stages of the rank that holds the largest (whose dense blocks may leave it none of its own).
  // Under tp, that rank's blocks' partial gradients are summed once a step.
  double stage_moe_layers = 0;
  int64_t partial = 0;
  for (size_t s = largest % static_cast<size_t>(p); s < stages.size(); s += static_cast<size_t>(p))
    for (int64_t i = stages[s].first; i < stages[s].second; ++i) {
      stage_moe_layers += block[static_cast<size_t>(i)].experts > 0 ? 1.0 / v : 0.0;
      if (deepseek) partial += rank_blocks[static_cast<size_t>(i)].partial;
    }
  // The head: tp rank 0's vocabulary rows (chapter 10 gives the first V mod t ranks one more).
  const int64_t head_rows = split_sizes(shape.vocab_size, t)[0];
  const double head_share =
      static_cast<double>(head_rows) / static_cast<double>(shape.vocab_size) * t;  // of a 1/t
  const double head =
      p == 1 ? f.lm_head * head_share * seconds +
                   cluster.product_overhead(bf16, tokens, shape.d_model, head_rows)
             : 0;
  // Each product's cost besides its FLOPs (Cluster: a latency, the bytes of a thin product):
  // every matrix of the stage's blocks, a routed expert's for each of the rank's E/ep experts,
  // each receiving its share of the ep group's routed tokens.
  double overhead = 0;
  if (cluster.product_latency_fp32 > 0 || cluster.product_latency_bf16 > 0 ||
      cluster.memory_bandwidth > 0) {
    const auto& [dense, moe] = terms.split.at({t, layout.sequence_parallel});
    const double experts = static_cast<double>(terms.experts) / layout.ep;
    const double per_expert =
        terms.experts == 0 ? 0 : tokens * routes * terms.per_token * layout.ep / terms.experts;
    double dense_overhead = -1, moe_overhead = -1;  // each kind's once
    for (int64_t i = first_layer; i < last_layer; ++i) {
      const bool routed = block[static_cast<size_t>(i)].experts > 0;
      double& each = routed ? moe_overhead : dense_overhead;
      if (each < 0)
        each = block_overhead(cluster, bf16, routed ? moe : dense, tokens, tokens * routes, experts,
                              per_expert);
      overhead += each;
    }
  }
  const double products = stage_products * seconds + overhead + head;
  const double attention = stage_attention * attention_seconds;
  const double attention_backward =
      (stage_attention_training - stage_attention) * attention_seconds;
  if (p > 1) {
    costs.scale.clear();
    for (size_t s = 0; s < stages.size(); ++s)
      costs.scale.push_back((stage_work[s] + (s + 1 == stages.size() ? 3 * f.lm_head : 0)) /
                            stage_work[largest]);
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
    int64_t crossings = 4 * layers + 2;  // f and g of each split layer, the embedding's, the head's
    if (deepseek) {
      crossings = 2;
      for (int64_t i = first_layer; i < last_layer; ++i)
        crossings += rank_blocks[static_cast<size_t>(i)].crossings;
    }
    const auto traffic =
        ch10::tensor_parallel_traffic(crossings, shape.d_model, static_cast<int>(t), rows, seq / c,
                                      layout.sequence_parallel, element);
    const Link& link = group_link(cluster, 1, t);
    using dist::Op;
    tp_forward = (link.seconds(Op::AllReduce, static_cast<double>(traffic.all_reduce.calls),
                               traffic.all_reduce.wire_bytes) +
                  link.seconds(Op::AllGather, static_cast<double>(traffic.all_gather.calls),
                               traffic.all_gather.wire_bytes) +
                  link.seconds(Op::ReduceScatter, static_cast<double>(traffic.reduce_scatter.calls),
                               traffic.reduce_scatter.wire_bytes)) /
                 2;
  }
  const double tp_recomputed = mode == ch14::Recompute::Full ? tp_forward : 0;

  // Context parallelism (chapter 12), per block: the ring's sends run beside the attention they
  // feed, so only what outlasts the block's attention shows; the all-gather kernel waits for its
  // keys and values. Chapter 12 counts 4-byte elements.
  double cp_forward = 0, cp_backward = 0;
  if (c > 1) {
    // Each rank's keys and values: its key/value heads (MLA: its heads, at their own widths).
    const ch07::BlockParameters& first = block.front();
    const int64_t heads = deepseek ? shape.n_heads / t : std::max<int64_t>(1, shape.n_kv_heads / t);
    const auto traffic =
        ch12::context_parallel_traffic(c, 0, rows, seq, heads, first.query_key, first.value,
                                       layout.cp_layout, layout.cp_attention);
    const Link& link = group_link(cluster, t, c);
    const double scale = element / 4.0;
    const double payload =
        static_cast<double>(traffic.send_recv.payload_bytes + traffic.all_gather.payload_bytes +
                            traffic.all_to_all.payload_bytes);
    const double forward_share = traffic.forward_payload_bytes / payload;
    const double block_attention_time = attention / layers;  // forward; backward twice that
    if (layout.cp_attention == ch12::CpAttention::Ring) {
      const double sends =
          link.seconds(dist::Op::SendRecv, static_cast<double>(traffic.send_recv.calls),
                       traffic.send_recv.payload_bytes * scale);
      cp_forward = std::max(0.0, sends * forward_share - block_attention_time);
      cp_backward = std::max(0.0, sends * (1 - forward_share) - 2 * block_attention_time);
    } else {
      cp_forward = link.seconds(dist::Op::AllGather, static_cast<double>(traffic.all_gather.calls),
                                gather_wire(traffic.all_gather.payload_bytes * scale, c));
      cp_backward = link.seconds(dist::Op::AllToAll, static_cast<double>(traffic.all_to_all.calls),
                                 gather_wire(traffic.all_to_all.payload_bytes * scale, c));
    }
    cp_forward *= layers;
    cp_backward *= layers;
  }

  // Expert parallelism (chapter 13): each MoE block's all-to-alls (the counts, the dispatch and
  // the combine forward, their mirror backward) when the router spreads the tokens evenly over
  // the ep ranks; chapter 13 waits for each, so none of it hides.
  double ep_forward = 0, ep_backward = 0;
  if (layout.ep > 1 && stage_moe_layers > 0) {
    const int64_t routed =
        static_cast<int64_t>(tokens * routes) * terms.per_token / layout.ep;  // its routed rows
    const std::vector<int64_t> sent(static_cast<size_t>(layout.ep), routed);
    const auto traffic =
        ch13::expert_parallel_traffic(sent, sent, 0, terms.experts, shape.d_model, element);
    const double all = group_link(cluster, t, layout.ep)
                           .seconds(dist::Op::AllToAll, static_cast<double>(traffic.calls),
                                    static_cast<double>(traffic.wire_bytes)) *
                       stage_moe_layers;
    const double forward_share =
        static_cast<double>(traffic.forward_payload_bytes) / traffic.payload_bytes;
    ep_forward = all * forward_share;
    ep_backward = all - ep_forward;
  }

  // The pipeline (chapter 11): each stage sends its output forward and its input's gradient back,
  // one micro-batch at a time (split over tp under sequence parallelism).
  double pp_send = 0;
  if (p > 1) {
    const double bytes = tokens * shape.d_model * element / (layout.sequence_parallel ? t : 1);
    pp_send = group_link(cluster, t * c * d, p).seconds(dist::Op::SendRecv, 1, bytes);
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
  stage.ep_forward = ep_forward;
  stage.ep_backward = ep_backward;
  stage.ep_recomputed = mode == ch14::Recompute::Full ? ep_forward : 0;
  stage.pp_send = pp_send;
  const std::vector<double> scale = costs.scale;
  costs = micro_batch_costs(stage);
  costs.scale = scale;
  const double per_micro_batch = costs.forward + costs.backward_input + costs.backward_weight;
  const double makespan = m * busiest * per_micro_batch;

  StepEstimate e;
  double last_products = 0, last_attention = 0, last_attention_training = 0;  // the last rank's
  for (size_t s = static_cast<size_t>(p) - 1; s < stages.size(); s += static_cast<size_t>(p))
    for (int64_t i = stages[s].first; i < stages[s].second; ++i) {
      last_products += rank_products[i];
      last_attention += block_attention[i];
      last_attention_training += block_attention_training[i];
    }
  const double rank_tokens = m * tokens / t;  // a step's, times the products' share
  const bool full = mode == ch14::Recompute::Full, again = mode != ch14::Recompute::None;
  e.flops.matrices = std::llround(rank_tokens * last_products * (full ? 4 : 3));
  e.flops.attention =
      std::llround(rank_tokens * (last_attention_training + (again ? last_attention : 0)));
  e.flops.head = std::llround(rank_tokens * f.lm_head * head_share * 3);
  e.compute = m * busiest * (3 * products + attention + attention_backward + recomputed);
  e.exposed["tp"] = m * busiest * (2 * tp_forward + tp_recomputed);
  e.exposed["cp"] = m * busiest * (cp_forward + cp_backward);
  if (layout.ep > 1)
    e.exposed["ep"] = m * busiest * (ep_forward + ep_backward + stage.ep_recomputed);
  e.exposed["pp"] = m * busiest * 2 * pp_send;

  // State (chapter 09's ZeRO formulas) for the rank that holds the most; ZeRO runs over the
  // dp·cp/ep ranks that hold the same experts (chapter 15's compose_step), for every parameter.
  const int64_t replicas = d * c / layout.ep;
  const auto [held, held_experts, frozen] =
      busiest_holding(work, layout, stages, block, rank_blocks);
  // In bf16 chapter 14's master weights: 2 + 2 bytes a number, 12 for masters and moments.
  ch03::StateBytes state =
      ch09::zero_memory_formula(held + held_experts, replicas, layout.zero, element);
  state.parameters += 4 * frozen;  // kept whole, with no gradient or moments
  e.state_bytes = state.total();

  e.activation_bytes = kept_activations(work, layout, stages, precision, in_flight);

  // The data-parallel reduction of the step's gradients (fp32) runs beside the last micro-batch's
  // backward (chapter 09's buckets); ZeRO-1 and 2 also gather the updated parameters; ZeRO-3
  // gathers them for every micro-batch's forward and backward and reduces each micro-batch's
  // gradients, each unit when it is needed: chapter 09 does not prefetch, so none of it hides.
  // With ep, chapter 09's step runs over the ranks that hold the same experts (tp·ep apart), and
  // chapter 13 first all-reduces the other parameters' gradients over the ep group.
  const double backward = busiest * (costs.backward_input + costs.backward_weight);
  using dist::Op;
  auto reduction = [&](int64_t parameters, int64_t n, const Link& link, int zero) {
    if (n == 1 || parameters == 0) return 0.0;
    const double grads = 4.0 * parameters, params = static_cast<double>(element) * parameters;
    const double messages = std::ceil(grads / 25e6) * 2 * (n - 1);  // 25 MB buckets
    if (zero == 0)
      return std::max(0.0,
                      link.seconds(Op::AllReduce, messages, all_reduce_wire(grads, n)) - backward);
    const double gather = link.seconds(Op::AllGather, messages / 2, gather_wire(params, n));
    const double scatter = link.seconds(Op::ReduceScatter, messages / 2, gather_wire(grads, n));
    if (zero < 3) return std::max(0.0, scatter - backward) + gather;
    return m * (2 * gather + scatter);  // gathered for forward and backward
  };
  const double dp_time = reduction(held + held_experts, replicas,
                                   group_link(cluster, t * layout.ep, replicas), layout.zero) +
                         reduction(held, layout.ep, group_link(cluster, t, layout.ep), 0);
  e.exposed["dp"] = dp_time;
  // Chapter 10's partial gradients (MLA's down-projections and their norms; under sequence
  // parallelism every whole parameter, the routed experts included): summed over tp once a step,
  // in fp32, after the last backward, waited for.
  double tp_sums = 0;
  if (partial > 0) {
    const double grads = 4.0 * static_cast<double>(partial);
    tp_sums = group_link(cluster, 1, t)
                  .seconds(Op::AllReduce, std::ceil(grads / 25e6) * 2 * (t - 1),
                           all_reduce_wire(grads, t));
    e.exposed["tp"] += tp_sums;
  }
  e.reductions = dp_time + tp_sums;
  // The optimizer updates what the rank keeps: its parameters, or under ZeRO its 1/N shard.
  const int64_t updated = held + held_experts;
  e.optimizer =
      cluster.optimizer_seconds_per_parameter *
      static_cast<double>(layout.zero == 0 ? updated : (updated + replicas - 1) / replicas);

  e.step = makespan + e.reductions + e.optimizer;
  const double step_tokens = static_cast<double>(work.batch) * seq;
  double model_flops_per_token = f.lm_head;  // forward, causal attention
  for (int64_t i = 0; i < L; ++i) model_flops_per_token += block_products[i] + block_attention[i];
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
