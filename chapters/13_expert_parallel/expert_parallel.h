#pragma once
/// @file expert_parallel.h
/// @brief Chapter 13: expert parallelism. The E routed experts of each MoE layer are split over
/// the ep ranks of an expert-parallel group (rank r holds experts [r·E/ep, (r+1)·E/ep)); every
/// rank routes its own tokens with the replicated router, sends each token to the rank holding
/// its expert with an all-to-all of variable split sizes, runs its own experts on what it
/// received, and sends the outputs back with the reverse all-to-all, where they are gate-weighted
/// and summed (Lepikhin et al. 2020, GShard; Megatron-core's MoEAlltoAllTokenDispatcher).
///
/// Expert parallelism folds into the data-parallel ranks: the ep ranks of a group are dp·cp ranks
/// that saw other tokens. ep divides dp·cp; the dp·cp ranks form dp·cp/ep expert-parallel groups
/// of consecutive ranks, and the ranks holding the same experts (the same place in their groups)
/// form the expert-data-parallel group `edp`, over which those experts' gradients are averaged.

#include <torch/torch.h>

#include <any>
#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "03_transformer/model.h"
#include "03_transformer/train.h"
#include "07_moe/moe.h"
#include "09_data_parallel/step.h"
#include "10_tensor_parallel/step.h"
#include "fivefold/dist.h"

namespace fivefold::ch13 {

/// The routed experts rank `rank` of `ep` holds: E/ep consecutive ones (ep divides E).
ch07::ExpertRange expert_range(int64_t n_experts, int64_t ep, int64_t rank);

/// Refuses, with the reason (fivefold::Error), what expert parallelism cannot do: ep < 1, a model
/// without routed experts (ep > 1), ep not dividing the experts, ep not dividing the `data_ranks`
/// (dp·cp) it folds into. Call before any communicator exists: every rank refuses alike.
void check_expert_parallel(const ch03::ModelConfig& config, int64_t ep, int64_t data_ranks);

/// The all-to-all inside autograd: rows [offset_j, offset_j + send_sizes[j]) of x [rows, ...] go
/// to rank j of `ep`; returns what arrives, in rank order (rank i sends recv_sizes[i] rows). Its
/// backward is the reverse all-to-all (each gradient row goes back where its row came from).
torch::Tensor all_to_all(const torch::Tensor& x, const std::vector<int64_t>& send_sizes,
                         const std::vector<int64_t>& recv_sizes, const dist::CommunicatorPtr& ep);

/// What dispatch remembers for combine (kept in ch07::DispatchedTokens::route_back).
struct ExchangePlan {
  ch07::DispatchedTokens local;     ///< this rank's kept assignments, sorted by global expert
  std::vector<int64_t> send_sizes;  ///< rows sent to each rank of ep
  std::vector<int64_t> recv_sizes;  ///< rows received from each rank of ep
  /// Row i of the dispatched tokens (grouped by local expert) is row `order[i]` of what the
  /// all-to-all delivered (grouped by source rank, then local expert).
  torch::Tensor order;
};

/// Dispatch and combine over the ranks of an expert-parallel group (ch07::TokenDispatcher).
///
/// dispatch: (1) permute this rank's kept assignments by expert (chapter 07's LocalDispatcher),
/// (2) exchange the counts per expert (an all-to-all of E numbers: each rank learns how many
/// rows each source sends to each of its experts), (3) all-to-all the tokens with those split
/// sizes, (4) regroup the received rows by local expert (source order within an expert).
/// combine: the same in reverse: undo (4), the reverse all-to-all, then chapter 07's gate-weighted
/// sum of each token's outputs. Both all-to-alls are differentiable (all_to_all).
/// **Exercise** (README, "The exercise").
class ExpertParallelDispatcher : public ch07::TokenDispatcher {
 public:
  /// Over `ep`; each rank holds expert_range(E, ep.size(), ep.rank()).
  explicit ExpertParallelDispatcher(dist::CommunicatorPtr ep) : ep_(std::move(ep)) {}
  /// x [tokens, d]; experts [tokens·k] global indices; kept [tokens·k] -> the rows this rank's
  /// experts must process, grouped by local expert (rows_per_expert has E/ep entries), and in
  /// route_back the ExchangePlan. `slots` is left undefined: the rows are other ranks' tokens.
  ch07::DispatchedTokens dispatch(const torch::Tensor& x, const torch::Tensor& experts,
                                  const torch::Tensor& kept, int64_t n_experts) override;
  /// outputs [rows, d] for dispatch's rows -> [tokens, d], each token's gated outputs summed.
  /// Outputs narrower than fp32 (chapter 14's bf16 products) go back widened
  /// (ch03::at_least_fp32), as the tokens came: the traffic and the sum are an fp32 step's.
  torch::Tensor combine(const torch::Tensor& outputs, const ch07::DispatchedTokens& dispatched,
                        const torch::Tensor& gates, int64_t tokens, int64_t k) override;

 private:
  dist::CommunicatorPtr ep_;
};

/// The two groups of expert parallelism, made from the dp·cp ranks.
struct ExpertParallel {
  dist::CommunicatorPtr ep;   ///< the ranks that exchange tokens (consecutive dp·cp ranks)
  dist::CommunicatorPtr edp;  ///< the ranks holding the same experts (one per group)
};

/// Splits `data` (the dp·cp ranks) into groups of `ep` consecutive ranks and their edp peers.
/// Collective over `data`; ep must divide its size.
ExpertParallel make_expert_parallel(const dist::CommunicatorPtr& data, int64_t ep);

/// Chapter 07's recipe with each MoE layer holding this rank's experts (expert_range over
/// group.ep) and dispatching with ExpertParallelDispatcher; names and initial weights are the
/// whole model's.
ch03::ModelRecipe recipe(const ch03::ModelConfig& config, const ExpertParallel& group);

/// This rank's part of the model under expert parallelism (`part`: a pipeline stage's layers).
ch03::Transformer make_model(const ch03::ModelConfig& config, const ExpertParallel& group,
                             const ch03::ModelPart& part = {});

/// Replaces each MoE layer of `model` that holds every expert (chapter 10 builds them so, with
/// tensor-parallel shared experts) by one holding this rank's experts with the same router
/// settings and shared experts, dispatching over group.ep. Layers already expert-parallel are
/// left as they are. Call before the weights are loaded.
void adapt_moe_layers(ch03::Transformer& model, const ExpertParallel& group);

/// True for the parameters of routed experts (".experts." in the name).
bool is_expert_parameter(const std::string& name);

/// Adds expert parallelism to a map of groups for chapter 09's step run over group.edp: every
/// trainable parameter that is not a routed expert's is the same on the ep ranks and its gradient
/// there is a partial sum (summed over group.ep, counted in the norm on ep rank 0 only); the
/// experts' gradients already hold every ep rank's tokens (the all-to-all's backward brought
/// them). The norm's squares are summed over group.ep too.
void add_expert_parallel_groups(ch03::Transformer& model, const ExpertParallel& group,
                                ch09::ModelParallelGroups& groups);

/// The hooks that put expert parallelism into chapter 10's or 11's step (adapt_moe_layers,
/// add_expert_parallel_groups); that step is then made over group.edp, with make_model over the
/// group as its `whole` builder, and wrapped in ExpertParallelStep.
ch09::StepHooks expert_parallel_hooks(const ExpertParallel& group);

/// A training step with expert parallelism: the step it wraps (chapter 09's over group.edp, or
/// chapter 10's or 11's made over group.edp with expert_parallel_hooks) holds this rank's
/// experts. Each rank's loss counts 1/ep in the micro-batches' weights: then the experts'
/// gradients (sums over an ep group's tokens) averaged over edp, and the other gradients summed
/// over ep and averaged over edp, are all the mean over the dp·cp ranks, as one device computes
/// it. Checkpoints and optimizer state are gathered by name over ep (the whole model's, as one
/// process saves them).
class ExpertParallelStep : public ch10::ModelPartStep {
 public:
  /// Wraps `inner`, whose model holds this rank's experts and whose full_model() is this rank's
  /// whole part over tp and pp (make_model over `group`). full_model() is chapter 07's model,
  /// every expert, local dispatch.
  ExpertParallelStep(std::unique_ptr<ch03::TrainingStep> inner, ExpertParallel group);
  /// Runs the inner step with each micro-batch's loss weight divided by ep, then sums the loss
  /// over ep (one all-reduce of a number): the mean over every token.
  ch03::StepResult step(const std::vector<ch03::Batch>& micro_batches, int64_t step) override;

 protected:
  io::TensorMap gather(const io::TensorMap& mine, bool to_rank0) override;  // by name over ep
  io::TensorMap select(const io::TensorMap& whole) override;

 private:
  ExpertParallel group_;
  std::set<std::string> names_;  // the parameters this rank holds
};

/// A ch03::StepFactory making ExpertParallelStep around chapter 09's step over group.edp with
/// ZeRO `stage` (0 to 3): the run's model is replaced by this
/// rank's part (make_model over `group`), started from the same weights.
ch03::StepFactory expert_parallel_step(ExpertParallel group, int stage);

/// A ch03::StepFactory making ExpertParallelStep around the step `inner` makes (chapter 10's or
/// 11's, made over group.edp with expert_parallel_hooks(group) and make_model over `group` as
/// its whole builder).
ch03::StepFactory expert_parallel_step(ExpertParallel group, ch03::StepFactory inner);

/// Bytes of the all-to-alls of one MoE layer's forward and backward on one rank, from the counts
/// it routed: `sent_rows[j]` rows to rank j, `received_rows[j]` from rank j, of d numbers of
/// `element_size` bytes. Forward: the counts exchange (E int64 numbers), the dispatch (sent
/// rows) and the combine (received rows); backward the two token exchanges again, reversed.
struct ExpertParallelTraffic {
  int64_t calls = 0;          ///< all-to-alls
  int64_t payload_bytes = 0;  ///< bytes handed to them (each one's input)
  int64_t wire_bytes = 0;     ///< of those, the bytes addressed to other ranks
  /// Of payload_bytes, forward's (the counts, the dispatch, the combine): what recomputing the
  /// layer (chapter 14) hands over again.
  int64_t forward_payload_bytes = 0;
};

/// The formula, for rank `rank`: see ExpertParallelTraffic.
ExpertParallelTraffic expert_parallel_traffic(const std::vector<int64_t>& sent_rows,
                                              const std::vector<int64_t>& received_rows,
                                              int64_t rank, int64_t n_experts, int64_t d,
                                              int64_t element_size = 4);

}  // namespace fivefold::ch13
