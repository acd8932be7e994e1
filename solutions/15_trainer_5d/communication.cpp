// Chapter 15: each parallelism's communication in a layout's step, priced on the cluster's links
// from the chapter's own traffic terms (the estimate that adds them up is planner.cpp).
#include <algorithm>
#include <cmath>
#include <vector>

#include "10_tensor_parallel/plan.h"
#include "12_context_parallel/plan.h"
#include "13_expert_parallel/expert_parallel.h"
#include "planner_parts.h"

namespace fivefold::ch15 {

// The mesh puts tp fastest, then cp, dp, pp (trainer_5d.h): a group of `size` ranks `stride`
// apart spans stride·size consecutive ranks, one node's link when that span fits in a node, the
// nodes' link otherwise (its slowest hop sets a ring's pace).
const Link& group_link(const Cluster& cluster, int64_t stride, int64_t size) {
  return stride * size <= cluster.devices_per_node ? cluster.intra_node : cluster.inter_node;
}

double all_reduce_wire(double bytes, int64_t n) { return 2.0 * (n - 1) / n * bytes; }

double gather_wire(double bytes, int64_t n) { return static_cast<double>(n - 1) / n * bytes; }

// Tensor parallelism (chapter 10): its all-reduces, or all-gathers and reduce-scatters, of one
// micro-batch through a stage's blocks, half forward and half backward; none of it hidden.
double tp_forward_seconds(const Workload& work, const Layout& layout, const Cluster& cluster,
                          const MicroBatchShare& share, const BusiestStage& stage,
                          const std::vector<ch10::RankBlock>& rank_blocks) {
  const int64_t t = layout.tp;
  if (t == 1) return 0;
  // f and g of each split layer, the embedding's and the head's; MLA's blocks cross as chapter 10
  // splits them.
  int64_t crossings = 4 * (stage.last - stage.first) + 2;
  if (!rank_blocks.empty()) {
    crossings = 2;
    for (int64_t i = stage.first; i < stage.last; ++i)
      crossings += rank_blocks[static_cast<size_t>(i)].crossings;
  }
  const auto traffic = ch10::tensor_parallel_traffic(
      crossings, work.model.d_model, static_cast<int>(t), share.rows, work.seq_len / layout.cp,
      layout.sequence_parallel, share.element);
  const Link& link = group_link(cluster, 1, t);
  using dist::Op;
  return (link.seconds(Op::AllReduce, static_cast<double>(traffic.all_reduce.calls),
                       traffic.all_reduce.wire_bytes) +
          link.seconds(Op::AllGather, static_cast<double>(traffic.all_gather.calls),
                       traffic.all_gather.wire_bytes) +
          link.seconds(Op::ReduceScatter, static_cast<double>(traffic.reduce_scatter.calls),
                       traffic.reduce_scatter.wire_bytes)) /
         2;
}

// Context parallelism (chapter 12), per block: the ring's sends run beside the attention they
// feed, so only what outlasts the block's attention shows; the all-gather kernel waits for its
// keys and values. Chapter 12 counts 4-byte elements.
std::pair<double, double> cp_seconds(const Workload& work, const ModelTerms& terms,
                                     const Layout& layout, const Cluster& cluster,
                                     const MicroBatchShare& share, const BusiestStage& stage,
                                     double attention) {
  const int64_t t = layout.tp, c = layout.cp;
  if (c == 1) return {0, 0};
  // Each rank's keys and values: its key/value heads (MLA: its heads, at their own widths).
  const ch07::BlockParameters& first = terms.block.front();
  const ch03::ModelConfig& model = work.model;
  const int64_t heads =
      !model.extensions.is_null() ? model.n_heads / t : std::max<int64_t>(1, model.n_kv_heads / t);
  const auto traffic =
      ch12::context_parallel_traffic(c, 0, share.rows, work.seq_len, heads, first.query_key,
                                     first.value, layout.cp_layout, layout.cp_attention);
  const Link& link = group_link(cluster, t, c);
  const double scale = share.element / 4.0;
  const double payload =
      static_cast<double>(traffic.send_recv.payload_bytes + traffic.all_gather.payload_bytes +
                          traffic.reduce_scatter.payload_bytes);
  const double forward_share = traffic.forward_payload_bytes / payload;
  const int64_t layers = stage.last - stage.first;
  const double block_attention = attention / layers;  // forward; backward twice that
  double forward = 0, backward = 0;
  if (layout.cp_attention == ch12::CpAttention::Ring) {
    const double sends =
        link.seconds(dist::Op::SendRecv, static_cast<double>(traffic.send_recv.calls),
                     traffic.send_recv.payload_bytes * scale);
    forward = std::max(0.0, sends * forward_share - block_attention);
    backward = std::max(0.0, sends * (1 - forward_share) - 2 * block_attention);
  } else {
    forward = link.seconds(dist::Op::AllGather, static_cast<double>(traffic.all_gather.calls),
                           gather_wire(traffic.all_gather.payload_bytes * scale, c));
    backward =
        link.seconds(dist::Op::ReduceScatter, static_cast<double>(traffic.reduce_scatter.calls),
                     gather_wire(traffic.reduce_scatter.payload_bytes * scale, c));
  }
  return {forward * layers, backward * layers};
}

// Expert parallelism (chapter 13): each MoE block's all-to-alls (the counts, the dispatch and
// the combine forward, their mirror backward) when the router spreads the tokens evenly over
// the ep ranks; chapter 13 waits for each, so none of it hides.
std::pair<double, double> ep_seconds(const Workload& work, const ModelTerms& terms,
                                     const Layout& layout, const Cluster& cluster,
                                     const MicroBatchShare& share, const BusiestStage& stage) {
  if (layout.ep == 1 || stage.moe_layers == 0) return {0, 0};
  const int64_t routed = static_cast<int64_t>(share.tokens * share.routes) * terms.per_token /
                         layout.ep;  // its routed rows
  const std::vector<int64_t> sent(static_cast<size_t>(layout.ep), routed);
  const auto traffic = ch13::expert_parallel_traffic(sent, sent, 0, terms.experts,
                                                     work.model.d_model, share.element);
  const double all = group_link(cluster, layout.tp, layout.ep)
                         .seconds(dist::Op::AllToAll, static_cast<double>(traffic.calls),
                                  static_cast<double>(traffic.wire_bytes)) *
                     stage.moe_layers;
  const double forward_share =
      static_cast<double>(traffic.forward_payload_bytes) / traffic.payload_bytes;
  const double forward = all * forward_share;
  return {forward, all - forward};
}

// The pipeline (chapter 11): each stage sends its output forward and its input's gradient back,
// one micro-batch at a time (split over tp under sequence parallelism).
double pp_send_seconds(const Workload& work, const Layout& layout, const Cluster& cluster,
                       const MicroBatchShare& share) {
  if (layout.pp == 1) return 0;
  const double bytes = share.tokens * work.model.d_model * share.element /
                       (layout.sequence_parallel ? layout.tp : 1);
  return group_link(cluster, layout.tp * layout.cp * layout.dp, layout.pp)
      .seconds(dist::Op::SendRecv, 1, bytes);
}

// The data-parallel reduction of the step's gradients (fp32) runs beside the last micro-batch's
// backward (chapter 09's buckets); ZeRO-1 and 2 also gather the updated parameters; ZeRO-3
// gathers them for every micro-batch's forward and backward and reduces each micro-batch's
// gradients, each unit when it is needed: chapter 09 does not prefetch, so none of it hides.
// With ep, chapter 09's step runs over the ranks that hold the same experts (tp·ep apart), and
// chapter 13 first all-reduces the other parameters' gradients over the ep group.
double dp_seconds(const Layout& layout, const Cluster& cluster, int64_t held, int64_t experts,
                  int64_t element, int64_t micro_batches, double backward) {
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
    return micro_batches * (2 * gather + scatter);  // gathered for forward and backward
  };
  const int64_t t = layout.tp, replicas = layout.dp * layout.cp / layout.ep;
  return reduction(held + experts, replicas, group_link(cluster, t * layout.ep, replicas),
                   layout.zero) +
         reduction(held, layout.ep, group_link(cluster, t, layout.ep), 0);
}

// Chapter 10's partial gradients (MLA's down-projections and their norms; under sequence
// parallelism every whole parameter, the routed experts included): summed over tp once a step,
// in fp32, after the last backward, waited for.
double tp_partial_seconds(const Layout& layout, const Cluster& cluster, int64_t partial) {
  if (partial == 0) return 0;
  const int64_t t = layout.tp;
  const double grads = 4.0 * static_cast<double>(partial);
  return group_link(cluster, 1, t)
      .seconds(dist::Op::AllReduce, std::ceil(grads / 25e6) * 2 * (t - 1),
               all_reduce_wire(grads, t));
}

}  // namespace fivefold::ch15
