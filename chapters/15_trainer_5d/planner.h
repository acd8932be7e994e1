#pragma once
/// @file planner.h
/// @brief Chapter 15: choosing the layout. For a model, a cluster, a global batch and a sequence
/// length, how long does a step of one layout take, does it fit, and which layout is fastest?
///
/// The step-time model is built from the chapters' own terms, never a second derivation: each
/// rank's FLOPs (chapter 02's count, split as chapters 10-12 split the work), each group's bytes
/// (chapter 10's tensor-parallel traffic, chapter 12's ring or all-gather, chapter 11's sends,
/// chapter 09's gradient reduction), the pipeline's idle time from chapter 11's simulator run on
/// the modelled costs, and the memory each rank needs from chapter 09's ZeRO formulas and chapter
/// 14's activations. A collective of B wire bytes over a link costs B / bandwidth plus one
/// latency per message; what overlaps with compute is stated where it is modelled
/// (notes/15_trainer_5d.md, "Choosing the layout"). Llama-shaped models (chapter 03) in every
/// layout; MLA and MoE models (chapters 06-07) too, with ep (chapter 13) and tp split as chapter
/// 10 splits their blocks (ch10::rank_block).
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "11_pipeline_parallel/schedule.h"
#include "14_memory/precision.h"
#include "14_memory/recompute.h"
#include "fivefold/dist.h"
#include "15_trainer_5d/predict.h"
#include "15_trainer_5d/trainer_5d.h"

namespace fivefold::ch15 {

/// A collective's cost on a link: time = latency x messages + wire bytes / bandwidth.
struct LinkLine {
  double latency = 0;    ///< seconds per message
  double bandwidth = 0;  ///< bytes per second one device sends (each direction)
};

/// One class of link between two devices: inside a node (NVLink, shared memory) or between
/// nodes (InfiniBand, TCP). One line prices every collective, unless the collective has a line of
/// its own (`fivefold calibrate` fits one for each collective it times: an all-reduce also adds,
/// an all-to-all talks to every rank at once).
struct Link {
  Link() = default;
  /// One line for every collective.
  Link(double latency, double bandwidth) : latency(latency), bandwidth(bandwidth) {}
  double latency = 0;    ///< seconds per message
  double bandwidth = 0;  ///< bytes per second one device sends (each direction)
  std::map<dist::Op, LinkLine> by_collective;  ///< lines of their own, by collective
  /// Seconds for `messages` messages of collective `op` carrying `wire` bytes in all (ring
  /// messages and wire bytes, chapter 08).
  double seconds(dist::Op op, double messages, double wire) const;
};

/// What the planner needs to know about the machines.
struct Cluster {
  std::string name;              ///< what it is (a preset's datasheet line)
  int64_t devices = 1;           ///< in all
  int64_t devices_per_node = 1;  ///< ranks whose groups stay on the node's link
  double memory_bytes = 0;       ///< per device
  double peak_flops_fp32 = 0;    ///< the datasheet's dense fp32 FLOP/s of a device (for MFU)
  double peak_flops_bf16 = 0;    ///< the datasheet's dense bf16 FLOP/s (for MFU)
  double matmul_flops_fp32 = 0;  ///< fp32 FLOP/s the step's products sustain (for time)
  double matmul_flops_bf16 = 0;  ///< bf16 FLOP/s the step's products sustain (for time)
  /// fp32 FLOP/s the causal attention kernel sustains, counted as the planner counts its FLOPs
  /// (half the square of scores); 0: the products' rate.
  double attention_flops_fp32 = 0;
  double attention_flops_bf16 = 0;  ///< the same in bf16; 0: the products' rate
  /// Seconds each product costs besides its FLOPs at the rate, in fp32 (a kernel's launch and
  /// ramp: what makes many small products slower than one large one); 0: nothing.
  double product_latency_fp32 = 0;
  double product_latency_bf16 = 0;  ///< the same in bf16
  /// Bytes a second a product streams its operands at: a product whose operands take longer to
  /// read and write than its FLOPs take (few rows against a large matrix) costs its bytes at
  /// this rate instead; 0: every product costs its FLOPs.
  double memory_bandwidth = 0;
  /// Seconds a step's optimizer takes per parameter it updates, and whatever else a step costs
  /// once whatever its tokens (AdamW streams each parameter's value, gradient and two moments:
  /// memory-bound).
  double optimizer_seconds_per_parameter = 0;
  Link intra_node;  ///< between devices of one node
  Link inter_node;  ///< between nodes
  /// Seconds a product of `rows` rows by an [in, out] matrix costs besides its FLOPs at the
  /// matmul rate: the latency, and where its operands' bytes take longer at the memory's
  /// bandwidth than its FLOPs, the difference (the roofline). Its two backward products
  /// (∂L/∂x = ∂L/∂y·W, ∂L/∂W = (∂L/∂y)ᵀ·x) move as many bytes and cost the same.
  double product_overhead(bool bf16, double rows, int64_t in, int64_t out) const;
  /// Throws fivefold::Error naming the first missing or impossible value.
  void validate() const;
};

/// The prediction for one layout, on the busiest rank.
struct StepEstimate {
  double compute = 0;  ///< seconds of forward, backward and recomputation, without idle time
  /// Seconds of communication not hidden behind compute, by group: "tp", "cp", "pp", "dp".
  std::map<std::string, double> exposed;
  double bubble = 0;        ///< seconds the pipeline leaves the rank idle (chapter 11's simulator)
  double optimizer = 0;     ///< seconds of the optimizer's update of the rank's share (ZeRO: 1/N)
  /// Seconds after the last micro-batch's backward: the gradients' reductions (dp; tp's sums of
  /// the partial gradients of MLA's whole parameters), part of `exposed`.
  double reductions = 0;
  double step = 0;          ///< seconds a step takes: compute + exposed + bubble + optimizer
  int64_t state_bytes = 0;  ///< parameters, gradients and AdamW state kept (chapter 09)
  int64_t activation_bytes = 0;  ///< activations kept at the peak of the schedule (chapter 14)
  /// What the device must hold: state and activations.
  int64_t memory_bytes() const { return state_bytes + activation_bytes; }
  /// What the last pipeline rank (the one with the head) computes in a step, recomputation
  /// included: chapter 02's count split by tp and cp, attention for a causal kernel (half the
  /// square).
  StepFlops flops;
  /// The step's model FLOPs over all ranks (6NP + causal attention, no recomputation).
  double model_flops = 0;
  double mfu = 0;                ///< model_flops / (step x devices x peak)
  double tokens_per_second = 0;  ///< the global batch's tokens over the step
};

/// One micro-batch through one pipeline stage, in seconds, by part: what estimate_step derives
/// from the chapters' terms for the largest stage of a layout (notes/15_trainer_5d.md §7).
struct StageTimes {
  double products = 0;            ///< the weights' products, forward (B and W each as long)
  double attention_forward = 0;   ///< the causal attention's forward products
  double attention_backward = 0;  ///< its backward products
  double recomputed = 0;          ///< what backward runs forward again (chapter 14)
  double tp = 0;                  ///< tp's collectives in forward (backward has as many)
  double tp_recomputed = 0;       ///< tp's collectives of the recomputed forward
  double cp_forward = 0;          ///< cp's communication forward leaves exposed
  double cp_backward = 0;         ///< and backward
  double ep_forward = 0;          ///< ep's all-to-alls in forward (counts, dispatch, combine)
  double ep_backward = 0;         ///< and their mirror in backward
  double ep_recomputed = 0;       ///< ep's all-to-alls of the recomputed forward
  double pp_send = 0;             ///< one send of the stage's output, or of its input's gradient
};

/// **The exercise** (README, "Choosing the layout"): chapter 11's simulator costs of one
/// micro-batch through one stage: F, the forward with what it sends and waits for; B, the input's
/// gradient; W, the weights' gradient (the two halves of the backward, which ZB-H1 schedules
/// apart). Which part belongs to which, and which communication is paid in both directions?
ch11::UnitCosts micro_batch_costs(const StageTimes& stage);

/// One layout's step on `cluster` for `work` in `precision` (fp32: 4-byte elements on the wire and
/// 4 + 4 + 8 bytes of state per parameter; bf16: 2-byte elements and the mixed-precision
/// 2 + 2 + 12; activations as chapter 14 counts them in that precision). `layout` must come from
/// resolve_layout for cluster.devices processes. A model with MLA and experts (chapters 06-07,
/// DeepSeek-V3's shape) is priced block by block, split over tp as chapter 10 splits it, with
/// ep's all-to-alls (chapter 13). Each product costs its FLOPs at the matmul rate, and, where the
/// cluster gives them, a latency and the bytes of a product bound by the memory (notes §7).
StepEstimate estimate_step(const Workload& work, const Layout& layout, const Cluster& cluster,
                           ch14::Precision precision);

/// A layout the search considered: its settings and its estimate.
struct Candidate {
  Layout layout;                                      ///< resolved
  int64_t micro_batches = 1;                          ///< per data-parallel rank
  ch14::Recompute recompute = ch14::Recompute::None;  ///< every block's
  StepEstimate estimate;                              ///< estimate_step's
};

/// Every layout of `cluster.devices` processes that resolve_layout accepts for `work`'s model,
/// sequence and batch: over tp, cp and pp (each size whose product divides the devices), ZeRO 0-3
/// (0 alone without replicas), sequence parallelism (with tp), cp's ring and all-gather kernels
/// (zig-zag), the schedules (1F1B alone without pp; interleaved with every v >= 2), micro-batches
/// (the divisors of the rows per data-parallel rank, at most `max_micro_batches`) and
/// recomputation (none, selective, full); work.micro_batches and work.recompute are ignored. A
/// model with experts: ep too, over every size that divides dp·cp and the experts.
struct Search {
  int64_t valid = 0;            ///< layouts the trainer accepts (x the three recomputations)
  int64_t fit = 0;              ///< of those, whose memory fits the device
  int64_t dropped = 0;          ///< valid - fit
  std::vector<Candidate> best;  ///< the fastest `keep` that fit, fastest first
};
/// What the search tries: what is given is fixed (to price a published layout among the others of
/// its shape, or one layout alone).
struct SearchLimits {
  int64_t keep = 10;                ///< the best kept
  int64_t max_micro_batches = 512;  ///< the most micro-batches tried
  int64_t dp = 0;                   ///< data-parallel ranks; 0: every size
  int64_t tp = 0;                   ///< tensor-parallel ranks; 0: every size
  int64_t pp = 0;                   ///< pipeline stages; 0: every size
  int64_t cp = 0;                   ///< context-parallel ranks; 0: every size
  int64_t ep = 0;                   ///< expert-parallel ranks (a model with experts); 0: every
  int zero = -1;                    ///< ZeRO stage; -1: every stage
  std::string schedule;             ///< pipeline schedule; "": every schedule
  int64_t virtual_stages = 0;       ///< with interleaved; 0: every v
  int64_t micro_batches = 0;        ///< per data-parallel rank; 0: every divisor
  /// Only this recomputation (of every block); unset: none, selective and full each.
  std::optional<ch14::Recompute> recompute;
  /// Called before each split of the devices (tp, cp, pp, ep) and once at the end: splits done,
  /// splits in all, the search so far (a long search's progress; unset: nothing).
  std::function<void(int64_t, int64_t, const Search&)> progress;
};
/// The search. A layout whose step, without the pipeline's idle time, is already slower than the
/// `keep`-th best found so far is counted but not simulated.
Search search_layouts(const Workload& work, const Cluster& cluster, ch14::Precision precision,
                      const SearchLimits& limits = {});

}  // namespace fivefold::ch15
