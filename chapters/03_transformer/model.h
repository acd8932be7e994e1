#pragma once
/// @file model.h
/// @brief Chapter 03: the decoder-only transformer (Llama architecture): token embedding, pre-norm
/// blocks of RMSNorm, grouped-query causal self-attention and a SwiGLU MLP, a final RMSNorm and an
/// LM head. Parameter names are Hugging Face's LlamaForCausalLM names, so checkpoints interoperate.
/// The slots later chapters fill are declared where the model uses them; the seams only a later
/// chapter or the training run needs (put-off weight gradients, the matmul and norm kernels,
/// sliced parameters, a model in parts) are in seams.h.

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "02_flops_6np/flops.h"
#include "03_transformer/seams.h"

namespace fivefold::ch03 {

/// The model's dimensions (Hugging Face key in brackets).
struct ModelConfig {
  int64_t vocab_size = 259;      ///< [vocab_size] default: the byte tokenizer's
  int64_t d_model = 128;         ///< [hidden_size]
  int64_t n_layers = 4;          ///< [num_hidden_layers]
  int64_t n_heads = 4;           ///< [num_attention_heads]
  int64_t n_kv_heads = 4;        ///< [num_key_value_heads]
  int64_t head_dim = 0;          ///< [head_dim] 0: d_model / n_heads
  int64_t d_ff = 352;            ///< [intermediate_size]
  bool tied_embeddings = false;  ///< [tie_word_embeddings]
  double rms_norm_eps = 1e-5;    ///< [rms_norm_eps]
  /// [rope_theta] base of rotary position embeddings; 0: none, attention sees no positions (this
  /// chapter). A model with rope_theta > 0 needs chapter 04's encoding installed
  /// (ch04::make_model).
  double rope_theta = 0;
  /// [max_position_embeddings] the context length the model is trained for (informational here;
  /// chapter 05's context extension scales positions relative to it).
  int64_t max_position_embeddings = 2048;
  /// [rope_scaling] context extension settings, kept as config.json has them and interpreted by
  /// chapter 05 (null: none). Chapter 04's make_model refuses a model that has them.
  nlohmann::json rope_scaling;
  /// [model_type "deepseek_v3"] the config.json keys of the architectures later chapters build
  /// (chapter 06: MLA's q_lora_rank, kv_lora_rank, ...; chapter 07: the MoE keys), kept as read
  /// and written back; null: a Llama model. A model whose config has them needs those chapters'
  /// make_model: this chapter's build_model refuses it.
  nlohmann::json extensions;
  uint64_t seed = 0;  ///< initialisation seed (chapter 01: per-parameter-name generators)

  /// head_dim, or d_model / n_heads when it is 0.
  int64_t resolved_head_dim() const;
  /// Throws fivefold::Error naming the inconsistent dimension (e.g. n_heads not dividing d_model).
  void validate() const;
  /// The same dimensions as chapter 02 counts them.
  ch02::TransformerShape shape() const;
};

/// Causal scaled-dot-product attention, written out: scores = q k^T / sqrt(head_dim), keys after
/// the query's position masked, softmax over the keys, weighted sum of v. Grouped-query attention:
/// each of the n_kv_heads key/value heads serves n_heads / n_kv_heads consecutive query heads.
/// q: [batch, n_heads, seq_q, head_dim]; k, v: [batch, n_kv_heads, seq_k, head_dim] with
/// seq_q <= seq_k: the queries are the last seq_q positions (query i is at seq_k - seq_q + i), as
/// when generating with a KV cache. Returns [batch, n_heads, seq_q, head_dim]. When `lse` is given
/// it receives each query's log-sum-exp of its scaled, masked scores, [batch, n_heads, seq_q]: what
/// lets partial results over different keys be merged later (chapter 12).
/// **Exercise** (README, "The exercise").
torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, torch::Tensor* lse = nullptr);

/// What an attention kernel returns.
struct AttentionOutput {
  torch::Tensor output;  ///< [batch, n_heads, seq_q, v_dim]
  torch::Tensor lse;     ///< [batch, n_heads, seq_q]: log Σ_j exp(scale·q·k_j) over visible keys
};

/// The attention computation itself, q, k, v -> output and log-sum-exp: the slot a kernel that
/// splits the keys (chapter 12's ring and all-gather attention) or a faster one fills. Chapter
/// 03's attention and chapter 06's MLA both call it.
class AttentionKernel {
 public:
  virtual ~AttentionKernel() = default;
  /// q [batch, n_heads, seq_q, d], k [batch, n_kv_heads, seq_k, d], v [batch, n_kv_heads, seq_k,
  /// v_dim]; q_positions [seq_q] and k_positions [seq_k] (int64) are the tokens' positions in
  /// their sequence: a query sees the keys at positions <= its own. Scores are scale·q·k.
  /// Computes in fp32 at least: q, k and v of a narrower type (chapter 14's products hand on
  /// bf16) are widened first, so that softmax and the log-sum-exp never run in bf16; then compute
  /// (a kernel that takes_narrow_inputs() widens what it needs itself).
  AttentionOutput attend(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& q_positions, const torch::Tensor& k_positions,
                         double scale) const;
  /// True for a kernel that takes q, k and v in a narrower type as they come: one that rounds its
  /// products' operands itself (k and v read only as matmul_operand gives them) and keeps
  /// softmax's statistics and its output in fp32 (the fast paths' tiled kernel); attend then does
  /// not widen them first.
  virtual bool takes_narrow_inputs() const { return false; }

 protected:
  /// What the kernel does (attend's arguments; q, k and v of one type, fp32 or wider, unless
  /// takes_narrow_inputs()).
  virtual AttentionOutput compute(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, const torch::Tensor& q_positions,
                                  const torch::Tensor& k_positions, double scale) const = 0;
};

/// Chapter 03's kernel: causal_attention. It needs the layout causal_attention assumes (keys at
/// consecutive positions, queries the last of them) and refuses any other with fivefold::Error.
class CausalAttentionKernel : public AttentionKernel {
 public:
  /// Whether queries at `q_positions` and keys at `k_positions` (int64) are the layout a causal
  /// kernel of one process computes: keys at consecutive positions, the queries the last of them
  /// (any other, such as a context-parallel rank's, needs chapter 12's kernel).
  static bool causal_layout(const torch::Tensor& q_positions, const torch::Tensor& k_positions);

 protected:
  AttentionOutput compute(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                          const torch::Tensor& q_positions, const torch::Tensor& k_positions,
                          double scale) const override;
};

/// The positions first .. first + count - 1, int64 [count].
torch::Tensor position_range(int64_t first, int64_t count);

/// What one attention layer keeps of the positions seen so far, for incremental decoding: here its
/// keys and values (chapter 06's MLA keeps its compressed latent in `keys` and no values).
struct LayerCache {
  torch::Tensor keys;    ///< [batch, n_kv_heads, length, head_dim], undefined when empty
  torch::Tensor values;  ///< same shape as keys
};

/// The KV cache of a whole model: one LayerCache per block. Start empty; each forward pass with
/// the cache appends its tokens' keys and values, so the next pass computes only new positions.
struct KVCache {
  std::vector<LayerCache> layers;  ///< resized by the model on first use
  /// Positions cached so far (the position of the next token).
  int64_t length() const;
  /// Bytes of the tensors held, over all layers (what the cache formulas count).
  int64_t bytes() const;
};

/// Encodes positions into queries and keys before attention (chapter 04: rotary embeddings).
/// Chapter 03 defines the slot; later chapters fill it without changing this chapter's code.
class PositionEncoding {
 public:
  virtual ~PositionEncoding() = default;
  /// q [batch, n_heads, seq, head_dim] and k [batch, n_kv_heads, seq, head_dim] of the tokens at
  /// `positions` (int64 [seq], any order: a sequence shard need not be contiguous) -> the
  /// encoded (q, k).
  virtual std::pair<torch::Tensor, torch::Tensor> encode(const torch::Tensor& q,
                                                         const torch::Tensor& k,
                                                         const torch::Tensor& positions) const = 0;
};

/// y = x·Wᵀ for x [..., in] and W [out, in], as torch's linear without bias, with a backward that
/// can put the weight's gradient off (DeferWeightGradients). Every weight matrix of the model's
/// blocks goes through it (LinearImpl, chapter 10's split linears); its products go through the
/// MatmulKernel set, if any. With `remade` (chapter 10's sequence parallelism), x is not kept for
/// backward: the weight's gradient asks `remade` for it again (RemadeInput).
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& weight,
                     const c10::intrusive_ptr<RemadeInput>& remade = {});

/// A linear map without bias, y = x·Wᵀ through `linear`; W [out, in] is its parameter "weight",
/// drawn as torch::nn::Linear draws it (the model then initialises it, chapter 01).
class LinearImpl : public torch::nn::Module {
 public:
  /// W [out, in].
  LinearImpl(int64_t in, int64_t out);
  /// x [..., in] -> [..., out].
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;  ///< [out, in]
};
TORCH_MODULE(Linear);

/// RMSNorm: x / sqrt(mean(x²) + eps) · weight, over the last dimension.
class RMSNormImpl : public torch::nn::Module {
 public:
  /// @param dim features; @param eps added under the square root.
  RMSNormImpl(int64_t dim, double eps);
  /// x [..., dim] -> same shape, in the weight's type (a bf16 input is widened first): the formula
  /// above, or `kernel` when one is installed.
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;  ///< [dim], initialised to ones
  /// Computes the norm instead of the formula written out in forward (null: the formula).
  std::shared_ptr<const NormKernel> kernel;
  /// The eps added under the square root.
  double eps() const { return eps_; }

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

/// What a block needs from its attention: x [batch, seq, d_model] at `positions` -> same shape,
/// reading and extending the layer's cache when given one. Chapter 03 fills the slot with
/// AttentionImpl; a later chapter may install its own (chapter 06: Multi-head Latent Attention).
class AttentionLayer : public torch::nn::Module {
 public:
  /// x [batch, seq, d_model] of the tokens at `positions` (int64 [seq]) -> [batch, seq, d_model].
  /// With a cache, x holds the positions after the cached ones (0 .. length - 1); what they add
  /// is appended to it and attention sees all of them.
  virtual torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions,
                                LayerCache* cache) = 0;
  /// Applied to queries and keys; null: no positions.
  std::shared_ptr<const PositionEncoding> encoding;
  /// Computes attention from q, k, v (chapter 03's CausalAttentionKernel by default).
  std::shared_ptr<const AttentionKernel> kernel = std::make_shared<CausalAttentionKernel>();

 protected:
  /// The positions of the keys attention sees: the cached ones (0 .. cached - 1), then
  /// `positions`.
  static torch::Tensor key_positions(const torch::Tensor& positions, int64_t cached);
  /// Multi-head attention of projected tokens, before the output projection: q [batch, seq,
  /// heads·head_dim] and k, v [batch, seq, kv_heads·head_dim] -> [batch, seq, heads·head_dim].
  /// Splits the heads, encodes the positions, extends the cache, runs the kernel, merges the
  /// heads. (Chapter 10's tensor-parallel attention runs it on each rank's heads.)
  torch::Tensor attend_heads(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                             int64_t heads, int64_t kv_heads, int64_t head_dim,
                             const torch::Tensor& positions, LayerCache* cache) const;
};

/// Self-attention with q/k/v/o projections (no biases).
class AttentionImpl : public AttentionLayer {
 public:
  /// Projections sized from `config`.
  explicit AttentionImpl(const ModelConfig& config);
  /// As AttentionLayer::forward; the cache keeps keys and values.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions,
                        LayerCache* cache = nullptr) override;
  Linear q_proj{nullptr};  ///< d_model -> n_heads·head_dim
  Linear k_proj{nullptr};  ///< d_model -> n_kv_heads·head_dim
  Linear v_proj{nullptr};  ///< d_model -> n_kv_heads·head_dim
  Linear o_proj{nullptr};  ///< n_heads·head_dim -> d_model

 private:
  int64_t n_heads_, n_kv_heads_, head_dim_;
};
TORCH_MODULE(Attention);

/// What a block needs from its feed-forward part: x [batch, seq, d_model] -> same shape, each
/// position on its own. Chapter 03 fills the slot with MlpImpl; chapter 07 installs experts.
class FeedForwardLayer : public torch::nn::Module {
 public:
  /// x [batch, seq, d_model] -> [batch, seq, d_model].
  virtual torch::Tensor forward(const torch::Tensor& x) = 0;
};

/// SwiGLU MLP: down(silu(gate(x)) * up(x)).
class MlpImpl : public FeedForwardLayer {
 public:
  /// Projections sized from `config` (d_model -> d_ff -> d_model).
  explicit MlpImpl(const ModelConfig& config);
  /// x [batch, seq, d_model] -> [batch, seq, d_model].
  torch::Tensor forward(const torch::Tensor& x) override;
  Linear gate_proj{nullptr};  ///< d_model -> d_ff, through SiLU
  Linear up_proj{nullptr};    ///< d_model -> d_ff
  Linear down_proj{nullptr};  ///< d_ff -> d_model
};
TORCH_MODULE(Mlp);

/// One pre-norm block: x + attn(norm(x)), then + mlp(norm(.)).
class BlockImpl : public torch::nn::Module {
 public:
  /// Sub-modules sized from `config`; `attention` and `mlp` fill the slots when given (default:
  /// AttentionImpl, MlpImpl).
  explicit BlockImpl(const ModelConfig& config, std::shared_ptr<AttentionLayer> attention = nullptr,
                     std::shared_ptr<FeedForwardLayer> mlp = nullptr);
  /// x [batch, seq, d_model] at `positions` -> same shape; `cache` as in AttentionLayer::forward.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& positions,
                        LayerCache* cache = nullptr);
  RMSNorm input_layernorm{nullptr};           ///< before attention
  RMSNorm post_attention_layernorm{nullptr};  ///< before the MLP
  std::shared_ptr<AttentionLayer> self_attn;  ///< attention (chapter 03's AttentionImpl by default)
  std::shared_ptr<FeedForwardLayer> mlp;      ///< MLP (chapter 03's MlpImpl by default)
  /// Puts `attention` in the attention slot, under the same name (its parameters are then
  /// model.layers.{i}.self_attn.*).
  void set_attention(std::shared_ptr<AttentionLayer> attention);
  /// Puts `feed_forward` in the MLP slot, under the same name (model.layers.{i}.mlp.*).
  void set_mlp(std::shared_ptr<FeedForwardLayer> feed_forward);
};
TORCH_MODULE(Block);

/// The token embedding slot: tokens [batch, seq] int64 -> [batch, seq, d_model]. Chapter 03's
/// EmbeddingImpl looks rows up in a [vocab, d_model] table; chapter 10 installs one that holds a
/// slice of the vocabulary on each tensor-parallel rank.
class TokenEmbedding : public torch::nn::Module {
 public:
  /// tokens [batch, seq] int64 -> [batch, seq, d_model].
  virtual torch::Tensor forward(const torch::Tensor& tokens) = 0;
};

/// The embedding table: row t is token t's vector.
class EmbeddingImpl : public TokenEmbedding {
 public:
  /// A [vocab, d_model] table (initialised by the model).
  EmbeddingImpl(int64_t vocab, int64_t d_model);
  torch::Tensor forward(const torch::Tensor& tokens) override;
  torch::Tensor weight;  ///< [vocab, d_model]
};
TORCH_MODULE(Embedding);

/// The output slot: the LM head and the loss, from the final norm's output. Chapter 10 installs a
/// vocabulary-parallel version whose loss never builds the full logits.
class OutputLayer : public torch::nn::Module {
 public:
  /// hidden [..., d_model] -> logits [..., vocab].
  virtual torch::Tensor logits(const torch::Tensor& hidden) = 0;
  /// Mean next-token cross-entropy of hidden [batch, seq, d_model] against targets [batch, seq]
  /// int64; a target of -100 (PyTorch's ignore_index) is padding and counts for nothing.
  /// By default: cross-entropy of logits(hidden).
  virtual torch::Tensor loss(const torch::Tensor& hidden, const torch::Tensor& targets);
};

/// The LM head: logits = hidden · W^T, W its own [vocab, d_model] matrix (registered as
/// "lm_head.weight") or, tied, the embedding table (not registered again).
class LanguageModelHeadImpl : public OutputLayer {
 public:
  /// Its own matrix when `tied_weight` is undefined, else that tensor, shared.
  LanguageModelHeadImpl(int64_t vocab, int64_t d_model, torch::Tensor tied_weight = {});
  torch::Tensor logits(const torch::Tensor& hidden) override;
  torch::Tensor weight;  ///< [vocab, d_model]
};
TORCH_MODULE(LanguageModelHead);

/// What fills the model's slots, layer by layer. Empty members mean chapter 03's modules; a later
/// chapter's recipe returns its own (chapter 04: RoPE; chapter 06: MLA; chapter 07: experts), so
/// that the model is built once with its final modules and every parameter is drawn once.
struct ModelRecipe {
  /// The attention of layer `layer` (null: AttentionImpl).
  std::function<std::shared_ptr<AttentionLayer>(const ModelConfig&, int64_t layer)> attention;
  /// The feed-forward part of layer `layer` (null: MlpImpl).
  std::function<std::shared_ptr<FeedForwardLayer>(const ModelConfig&, int64_t layer)> mlp;
  /// The position encoding of every attention layer (null: none).
  std::shared_ptr<const PositionEncoding> position_encoding;
  /// The token embedding (null: EmbeddingImpl). Its table is its parameter "weight".
  std::function<std::shared_ptr<TokenEmbedding>(const ModelConfig&)> embedding;
  /// The output layer (null: LanguageModelHeadImpl); `tied` is the embedding's "weight" when the
  /// config ties them, else undefined.
  std::function<std::shared_ptr<OutputLayer>(const ModelConfig&, torch::Tensor tied)> output;
};

/// The trunk, registered as "model" so that names read model.layers.{i}...
class TrunkImpl : public torch::nn::Module {
 public:
  /// Embedding, the part's blocks and final norm sized from `config`, filled from `recipe`.
  TrunkImpl(const ModelConfig& config, const ModelRecipe& recipe, const ModelPart& part);
  std::shared_ptr<TokenEmbedding> embed_tokens;  ///< null when the part holds no embedding
  torch::nn::ModuleDict layers;  ///< the blocks held, keyed by their global index ("0", "1", ...)
  RMSNorm norm{nullptr};         ///< final norm (null when the part holds no head)
};
TORCH_MODULE(Trunk);

/// The language model. Parameters are initialised on construction (chapter 01: GPT-2 scheme,
/// N(0, 0.02²), o_proj and down_proj scaled by 1/sqrt(2·n_layers), norms 1), each drawn from the
/// generator of (config.seed, its Hugging Face name): the same values whatever part of the model
/// a process holds.
///
/// The forward pass runs in parts, so that a parallel chapter can run or replace one of them:
/// embed (tokens) -> forward_layers (blocks [first, last) by their global index, at given
/// positions) -> logits or loss (final norm, head).
class TransformerImpl : public torch::nn::Module {
 public:
  /// Builds and initialises `part` of the model, its slots filled from `recipe`; throws
  /// fivefold::Error for an invalid config or part.
  explicit TransformerImpl(ModelConfig config, const ModelRecipe& recipe = {},
                           const ModelPart& part = {});
  /// tokens [batch, seq] int64 -> logits [batch, seq, vocab]. With a cache, `tokens` continue the
  /// cached sequence (they sit at positions cache->length() onwards) and are appended to it.
  torch::Tensor forward(const torch::Tensor& tokens, KVCache* cache = nullptr);
  /// Part 1: tokens [batch, seq] int64 -> the embedding slot's output [batch, seq, d_model].
  torch::Tensor embed(const torch::Tensor& tokens);
  /// Part 2: blocks first .. last - 1 (held by this part) on x [batch, seq, d_model] of the tokens
  /// at `positions` (int64 [seq]) -> same shape. With a cache, positions follow the cached ones.
  /// Under chapter 10's sequence parallelism x holds this rank's slice of the sequence and
  /// `positions` the whole sequence's, which attention gathers.
  torch::Tensor forward_layers(torch::Tensor x, const torch::Tensor& positions, int64_t first,
                               int64_t last, KVCache* cache = nullptr);
  /// Part 3: final norm and head, hidden [..., d_model] -> logits [..., vocab].
  torch::Tensor logits(const torch::Tensor& hidden);
  /// Part 3 for training: final norm and the output slot's loss against targets [batch, seq].
  torch::Tensor loss(const torch::Tensor& hidden, const torch::Tensor& targets);
  /// The configuration.
  const ModelConfig& config() const { return config_; }
  /// The part of the model this process holds.
  const ModelPart& part() const { return part_; }
  /// Block `layer` (global index); throws fivefold::Error when this part does not hold it.
  BlockImpl& block(int64_t layer);
  /// The global indices of the blocks held, in order.
  std::vector<int64_t> layer_indices() const;
  /// Installs `encoding` in every attention layer (chapter 04 installs RoPE this way).
  void set_position_encoding(std::shared_ptr<const PositionEncoding> encoding);
  /// Installs `kernel` in every attention layer (chapter 12: ring attention).
  void set_attention_kernel(std::shared_ptr<const AttentionKernel> kernel);
  /// Puts `embedding` in the embedding slot (model.embed_tokens.*).
  void set_embedding(std::shared_ptr<TokenEmbedding> embedding);
  /// Puts `output` in the output slot (lm_head.*).
  void set_output_layer(std::shared_ptr<OutputLayer> output);
  /// How forward_layers runs block `layer` on x (without a cache): the block's own forward until
  /// one is set. Chapter 14's activation recomputation runs blocks without keeping what their
  /// backward needs.
  using LayerRunner = std::function<torch::Tensor(BlockImpl& block, int64_t layer,
                                                  const torch::Tensor& x,
                                                  const torch::Tensor& positions)>;
  /// Installs `runner` (an empty one: the blocks' own forward).
  void set_layer_runner(LayerRunner runner) { run_layer_ = std::move(runner); }
  /// Draws every matrix again from its (seed, name) generator (chapter 01), a sliced one (see
  /// parameter_shards) as its slice of the full matrix; the constructor does it once. A chapter
  /// that replaces a module after construction calls it, and every matrix the replacement left
  /// alone gets the value it had.
  void initialise_parameters();
  /// The parameters held as slices of the whole model's (ShardedModule), by their full names.
  /// Empty for a model that holds its tensors whole.
  std::map<std::string, TensorShard> parameter_shards() const;
  Trunk model{nullptr};                  ///< embedding, blocks, final norm
  std::shared_ptr<OutputLayer> lm_head;  ///< LanguageModelHeadImpl by default; null without head

 private:
  ModelConfig config_;
  ModelPart part_;
  LayerRunner run_layer_;
};
TORCH_MODULE(Transformer);

/// Builds a model (or a part of one) for a config: what the training run and the checkpoint
/// loader call, so that a later chapter can hand them its own recipe (chapter 04: the model with
/// RoPE installed).
using ModelBuilder = std::function<Transformer(const ModelConfig&, const ModelPart&)>;

/// The chapter 03 recipe: the model with chapter 03's modules and no position encoding. Refuses a
/// config with `extensions` (a later chapter's architecture).
Transformer build_model(const ModelConfig& config, const ModelPart& part = {});

}  // namespace fivefold::ch03
