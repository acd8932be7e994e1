#pragma once
/// @file layers.h
/// @brief Chapter 10: Megatron-style tensor parallelism for chapter 03's model. Each matrix is
/// split over the tp ranks so that a layer needs one all-reduce forward and one backward:
///
///   MLP:       gate/up column-parallel (rows split)  -> SiLU·up on local columns ->
///              down row-parallel (columns split)     -> partial sums, added by g
///   attention: q/k/v column-parallel by heads        -> attention on local heads ->
///              o row-parallel                        -> partial sums, added by g
///   embedding: vocabulary rows split; each rank looks up the tokens it holds, g adds
///   head+loss: vocabulary rows split; cross-entropy from a max, a sum and the target's logit
///              across ranks, never the full logits
///
/// The residual stream, norms and routing stay replicated (or, with sequence parallelism, split
/// along the sequence). Every parameter is a slice of the single-device model's tensor of the
/// same name (ch03::ShardedModule), drawn as that slice (chapter 01): a tp run starts from the
/// single-device weights, and checkpoints gather the slices back.

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "03_transformer/model.h"
#include "06_mla/mla.h"
#include "10_tensor_parallel/mappings.h"
#include "fivefold/dist.h"

namespace fivefold::ch10 {

/// What TensorParallel::enter hands the split layers: their input, whole on every rank, and how
/// the products that read it keep it for backward.
struct Entered {
  torch::Tensor whole;  ///< [batch, seq, d] on every rank
  /// Under sequence parallelism, what the products keep instead of `whole`: this rank's part,
  /// gathered again in backward; null without (they keep `whole`).
  c10::intrusive_ptr<GatheredSequence> kept;
  /// Under sequence parallelism, `whole` in the matmul kernel's operand form, held while the
  /// layer's products read it so that the kernel rounds it once (none of them keeps it).
  torch::Tensor operand;
  /// whole·Wᵀ through ch03::linear for W [out, in], keeping `kept` instead of whole.
  torch::Tensor product(const torch::Tensor& weight) const;
};

/// The tensor-parallel group of a model, shared by its layers.
struct TensorParallel {
  /// The group `comm`, with or without sequence parallelism.
  explicit TensorParallel(dist::CommunicatorPtr comm, bool sequence_parallel = false)
      : comm(std::move(comm)), sequence_parallel(sequence_parallel) {}
  dist::CommunicatorPtr comm;      ///< the tp ranks
  bool sequence_parallel = false;  ///< activations outside the split layers split by sequence
  /// The whole sequence length of the forward pass under way, set by each attention layer from
  /// its positions: what the MLP (whose slot sees only x) and the head need to gather a sequence
  /// split unevenly. Unused without sequence parallelism.
  int64_t sequence = 0;

  /// The replica groups made so far (replica_group's cache).
  std::map<int, dist::CommunicatorPtr> replica_groups;

  /// This rank's index in the group.
  int rank() const { return comm->rank(); }
  /// t, the ranks in the group.
  int size() const { return comm->size(); }
  /// When a tensor is cut into `parts` < size() parts, rank r holds part r / (size / parts): the
  /// ranks holding the same part as this one (grouped-query attention with fewer key/value heads
  /// than ranks). Made on first use, collective over `comm`: every rank asks in the same order.
  dist::CommunicatorPtr replica_group(int parts);
  /// Into the split layers: f (copy_to_tensor_parallel), or under sequence parallelism the
  /// all-gather of the sequence, whose products keep only this rank's part (Entered::kept).
  /// x [batch, seq or seq_r, d] -> [batch, seq, d].
  Entered enter(const torch::Tensor& x) const;
  /// Out of them: g (reduce_from_tensor_parallel), or the reduce-scatter along the sequence; a
  /// partial sum narrower than fp32 (a bf16 product's result, chapter 14) is summed in fp32.
  torch::Tensor leave(const torch::Tensor& partial) const;
};

/// Shared by every layer of one model.
using TensorParallelPtr = std::shared_ptr<TensorParallel>;

/// Y = X W^T with W [out, in] split by rows: this rank holds rows part `rank` of `out` (its
/// output features). Input replicated (after enter), output this rank's features.
class ColumnParallelLinearImpl : public torch::nn::Module, public ch03::ShardedModule {
 public:
  /// The slice of an [out, in] matrix that rank `rank` of `ranks` holds.
  ColumnParallelLinearImpl(int64_t in, int64_t out, int rank, int ranks);
  /// x [..., in] -> [..., out_r].
  torch::Tensor forward(const torch::Tensor& x);
  std::map<std::string, ch03::TensorShard> shards() const override;
  torch::Tensor weight;  ///< [out_r, in]

 private:
  ch03::TensorShard shard_;
};
TORCH_MODULE(ColumnParallelLinear);

/// Y = X W^T with W [out, in] split by columns: this rank holds columns part `rank` of `in`. Input
/// this rank's features, output a partial sum (before leave).
class RowParallelLinearImpl : public torch::nn::Module, public ch03::ShardedModule {
 public:
  /// The slice of an [out, in] matrix that rank `rank` of `ranks` holds.
  RowParallelLinearImpl(int64_t in, int64_t out, int rank, int ranks);
  /// x [..., in_r] -> partial [..., out].
  torch::Tensor forward(const torch::Tensor& x);
  std::map<std::string, ch03::TensorShard> shards() const override;
  torch::Tensor weight;  ///< [out, in_r]

 private:
  ch03::TensorShard shard_;
};
TORCH_MODULE(RowParallelLinear);

/// Chapter 03's SwiGLU MLP split over tp: gate_proj and up_proj column-parallel, down_proj
/// row-parallel; d_ff splits unevenly when tp does not divide it.
class TensorParallelMlpImpl : public ch03::FeedForwardLayer {
 public:
  /// `d_ff` hidden features (config.d_ff, or an expert's width).
  TensorParallelMlpImpl(int64_t d_model, int64_t d_ff, TensorParallelPtr tp);
  /// x [batch, seq or seq_r, d_model] -> the same shape.
  torch::Tensor forward(const torch::Tensor& x) override;
  ColumnParallelLinear gate_proj{nullptr};  ///< d_model -> d_ff_r
  ColumnParallelLinear up_proj{nullptr};    ///< d_model -> d_ff_r
  RowParallelLinear down_proj{nullptr};     ///< d_ff_r -> d_model (partial)

 private:
  TensorParallelPtr tp_;
};
TORCH_MODULE(TensorParallelMlp);

/// A module some of whose parameters get only part of their gradient on each rank, the part
/// flowing from this rank's heads: the step sums each over the group the module names.
class PartialGradients {
 public:
  virtual ~PartialGradients() = default;
  /// Those parameters, by their name within the module, and the group to sum each over.
  virtual std::map<std::string, dist::CommunicatorPtr> partial_gradients() const = 0;
};

/// Chapter 03's grouped-query attention split by heads: each rank holds n_heads / tp query heads
/// and the key/value heads they read, and o_proj's matching columns. tp must divide n_heads; with
/// n_kv_heads >= tp it divides them too (n_kv_heads / tp per rank); with fewer key/value heads
/// than ranks, tp / n_kv_heads ranks share each one, holding the same rows of k_proj and v_proj,
/// whose gradients are then partial sums over those ranks (check_tensor_parallel).
class TensorParallelAttentionImpl : public ch03::AttentionLayer, public PartialGradients {
 public:
  /// Projections sized from `config`, split over `tp`.
  TensorParallelAttentionImpl(const ch03::ModelConfig& config, TensorParallelPtr tp);
  /// As ch03::AttentionLayer::forward; x may be this rank's part of the sequence (sequence
  /// parallelism), `positions` is always the whole sequence's.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions,
                        ch03::LayerCache* cache = nullptr) override;
  ColumnParallelLinear q_proj{nullptr};  ///< d_model -> local heads · head_dim
  ColumnParallelLinear k_proj{nullptr};  ///< d_model -> local kv heads · head_dim
  ColumnParallelLinear v_proj{nullptr};  ///< d_model -> local kv heads · head_dim
  RowParallelLinear o_proj{nullptr};     ///< local heads · head_dim -> d_model (partial)
  /// k_proj and v_proj when ranks share their key/value head; none otherwise.
  std::map<std::string, dist::CommunicatorPtr> partial_gradients() const override;

 private:
  TensorParallelPtr tp_;
  int64_t n_heads_, n_kv_heads_, head_dim_;  // this rank's heads
  dist::CommunicatorPtr kv_replicas_;        // the ranks sharing this rank's key/value head
};
TORCH_MODULE(TensorParallelAttention);

/// Chapter 06's Multi-head Latent Attention split by heads (the training path). The
/// down-projections to the query and key/value latents, their norms and the shared rotary key are
/// small and stay whole on every rank (each rank computes them for its heads, so their gradients
/// are partial sums over tp); q_b_proj (or q_proj) and kv_b_proj are column-parallel by heads,
/// o_proj row-parallel. With a KV cache (inference) it refuses: generation runs on the gathered
/// model.
class TensorParallelMlaImpl : public ch03::AttentionLayer, public PartialGradients {
 public:
  /// Sizes from the model and `mla`, heads split over `tp`.
  TensorParallelMlaImpl(const ch03::ModelConfig& config, const ch06::MlaConfig& mla,
                        TensorParallelPtr tp);
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions,
                        ch03::LayerCache* cache = nullptr) override;
  /// The whole latent projections and their norms, over tp.
  std::map<std::string, dist::CommunicatorPtr> partial_gradients() const override;
  ColumnParallelLinear q_proj{nullptr};      ///< when q_lora_rank is 0: d_model -> local heads
  ch03::Linear q_a_proj{nullptr};            ///< whole: d_model -> q_lora_rank
  ch03::RMSNorm q_a_layernorm{nullptr};      ///< whole
  ColumnParallelLinear q_b_proj{nullptr};    ///< q_lora_rank -> local heads·(nope + rope)
  ch03::Linear kv_a_proj_with_mqa{nullptr};  ///< whole: d_model -> d_c + rope
  ch03::RMSNorm kv_a_layernorm{nullptr};     ///< whole
  ColumnParallelLinear kv_b_proj{nullptr};   ///< d_c -> local heads·(nope + v)
  RowParallelLinear o_proj{nullptr};         ///< local heads·v -> d_model (partial)

 private:
  TensorParallelPtr tp_;
  int64_t n_heads_;  // this rank's
  ch06::MlaConfig mla_;
  double scale_;
};
TORCH_MODULE(TensorParallelMla);

/// The embedding split by vocabulary rows: this rank holds rows [first, first + rows) (parts by
/// fivefold::split_sizes: 259 over 2 ranks is 130 + 129). A token outside them contributes zeros;
/// the sum over ranks (g, or the reduce-scatter along the sequence) is its row.
class VocabParallelEmbeddingImpl : public ch03::TokenEmbedding, public ch03::ShardedModule {
 public:
  /// The rows of a [vocab, d_model] table this rank holds.
  VocabParallelEmbeddingImpl(int64_t vocab, int64_t d_model, TensorParallelPtr tp);
  /// tokens [batch, seq] -> [batch, seq, d_model], or this rank's part of the sequence under
  /// sequence parallelism.
  torch::Tensor forward(const torch::Tensor& tokens) override;
  std::map<std::string, ch03::TensorShard> shards() const override;
  torch::Tensor weight;  ///< [rows, d_model]

 private:
  TensorParallelPtr tp_;
  ch03::TensorShard shard_;
  int64_t first_;
};
TORCH_MODULE(VocabParallelEmbedding);

/// Mean cross-entropy over the tokens whose target is not -100, from logits split by vocabulary:
/// `local` [..., rows] holds the logits of vocabulary rows [first, first + rows) on this rank of
/// `tp`; targets [...] are global token ids. Three all-reduces of one number per token (the max,
/// the sum of exponentials, the target's logit); the full logits never exist. Every rank returns
/// the same loss, and its gradient with respect to its own logits.
torch::Tensor vocab_parallel_cross_entropy(const torch::Tensor& local, const torch::Tensor& targets,
                                           int64_t first, const dist::CommunicatorPtr& tp);

/// The LM head split by vocabulary rows, with the vocabulary-parallel loss. With tied embeddings
/// it reads the VocabParallelEmbedding's rows (the same split).
class VocabParallelHeadImpl : public ch03::OutputLayer, public ch03::ShardedModule {
 public:
  /// Its own rows of a [vocab, d_model] matrix, or `tied_weight` (the embedding's rows).
  VocabParallelHeadImpl(int64_t vocab, int64_t d_model, TensorParallelPtr tp,
                        torch::Tensor tied_weight = {});
  /// hidden [batch, seq or seq_r, d_model] -> the full logits [batch, seq, vocab] (gathered: for
  /// evaluation and generation, not for training).
  torch::Tensor logits(const torch::Tensor& hidden) override;
  /// vocab_parallel_cross_entropy of this rank's logits; the full logits are never built.
  torch::Tensor loss(const torch::Tensor& hidden, const torch::Tensor& targets) override;
  std::map<std::string, ch03::TensorShard> shards() const override;
  torch::Tensor weight;  ///< [rows, d_model]

 private:
  torch::Tensor local_logits(const torch::Tensor& hidden, int64_t seq);
  TensorParallelPtr tp_;
  ch03::TensorShard shard_;
  int64_t first_;
  bool tied_;
};
TORCH_MODULE(VocabParallelHead);

/// Throws fivefold::Error, naming the reason, for a config that `tp_size` ranks cannot split:
/// query heads not divisible by tp (a rank must hold whole heads), key/value heads that neither
/// divide by tp nor divide it (a rank must read whole key/value heads); with sequence
/// parallelism, Mixture-of-Experts settings that need the whole sequence's routing statistics on
/// one rank (the Switch auxiliary loss, capacity). Vocabulary, d_ff and sequence split unevenly.
void check_tensor_parallel(const ch03::ModelConfig& config, int tp_size,
                           bool sequence_parallel = false);

/// Chapter 10's recipe: chapter 07's (which decides RoPE/YaRN, MLA, experts for the config) with
/// every matrix split over `tp`: attention (GQA or MLA), MLP, embedding and head. Mixture-of-
/// Experts layers keep whole routed experts on every rank (chapter 13 distributes them) and
/// split their shared experts; under sequence parallelism each rank routes its own tokens.
ch03::ModelRecipe recipe(const ch03::ModelConfig& config, TensorParallelPtr tp);

/// The tensor-parallel model (or `part` of it) for `config` over `tp`; check_tensor_parallel
/// first. With tp of size 1 it computes what ch07::make_model computes.
ch03::Transformer make_model(const ch03::ModelConfig& config, TensorParallelPtr tp,
                             const ch03::ModelPart& part = {});

/// The trainable parameters whose gradient on each rank is a partial sum, and the group to sum
/// each over: those a PartialGradients module declares (MLA's latent projections over tp, shared
/// key/value heads over the ranks sharing them), and under sequence parallelism every whole
/// parameter over tp (norms, router, routed experts: they see this rank's part of the sequence
/// only).
std::map<std::string, dist::CommunicatorPtr> partial_gradient_parameters(ch03::Transformer& model,
                                                                         const TensorParallel& tp);

}  // namespace fivefold::ch10
