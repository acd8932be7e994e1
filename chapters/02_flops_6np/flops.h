#pragma once
/// @file flops.h
/// @brief Chapter 02: counting the parameters and FLOPs of a transformer, exactly and as 6N, and
/// measuring the FLOPs a real forward + backward executes.
///
/// A matmul [m, k] x [k, n] costs 2mkn FLOPs (a multiply and an add per term). A weight W of a
/// linear layer y = x W^T costs 2 |W| FLOPs per token forward, and 4 |W| backward (dL/dx and dL/dW,
/// each as big as the forward): 6 |W| per token in training. Summed over the weights that take part
/// in matmuls, that is the "6N" rule; attention's scores and weighted values add a term that grows
/// with the context. See notes/02_flops_6np.md.

#include <torch/torch.h>

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

namespace fivefold::ch02 {

/// The dimensions of a decoder-only transformer that fix its parameters and FLOPs. Two families:
/// Llama-style (RMSNorm, SwiGLU MLP, no biases, rotary positions) and GPT-2-style (LayerNorm,
/// GELU MLP, biases, learned positions).
struct TransformerShape {
  int64_t vocab_size = 0;         ///< tokens in the vocabulary
  int64_t d_model = 0;            ///< hidden size
  int64_t n_layers = 0;           ///< transformer blocks
  int64_t n_heads = 0;            ///< query heads
  int64_t n_kv_heads = 0;         ///< key/value heads (< n_heads: grouped-query attention)
  int64_t head_dim = 0;           ///< per head; usually d_model / n_heads
  int64_t d_ff = 0;               ///< MLP hidden size
  bool gated_mlp = true;          ///< SwiGLU (gate, up, down: 3 matrices) or plain (up, down: 2)
  bool biases = false;            ///< biases in every linear layer and LayerNorm (GPT-2)
  bool layer_norm = false;        ///< LayerNorm (weight and bias) instead of RMSNorm (weight)
  int64_t learned_positions = 0;  ///< rows of a learned position embedding (GPT-2), else 0
  bool tied_embeddings = false;   ///< the LM head reuses the token embedding

  /// Throws fivefold::Error naming the first inconsistent or missing dimension.
  void validate() const;
};

/// Parameters by part, as `numel` would count them.
struct ParameterCount {
  int64_t embedding = 0;  ///< token (and position) embeddings
  int64_t attention = 0;  ///< q, k, v, o projections (and biases), all layers
  int64_t mlp = 0;        ///< MLP matrices (and biases), all layers
  int64_t norms = 0;      ///< every norm's parameters, including the final one
  int64_t lm_head = 0;    ///< 0 when tied
  int64_t total = 0;      ///< the sum
  /// Everything but the embeddings (Kaplan et al.'s N).
  int64_t non_embedding() const { return total - embedding; }
  /// Weights that take part in matmuls: attention, MLP and the LM head (tied or not). Biases and
  /// norms are excluded: they cost O(1) FLOPs per parameter, not 2.
  int64_t matmul_weights = 0;
};

/// Counts parameters of `shape`.
ParameterCount count_parameters(const TransformerShape& shape);

/// Forward matmul FLOPs for one token of a sequence of `context` tokens, by component. Attention
/// is counted as executed by chapter 03's attention: the full [context x context] score matrix,
/// masked afterwards (a causal kernel would skip half of it).
struct FlopBreakdown {
  double qkv = 0;                ///< the query, key and value projections, every layer
  double attention_scores = 0;   ///< Q K^T: the token's query row against `context` keys
  double attention_values = 0;   ///< softmax(.) V: its probabilities times `context` values
  double output_projection = 0;  ///< attention's output projection back to d_model
  double mlp = 0;                ///< the MLP's matrices (gated: gate, up, down; plain: up, down)
  double lm_head = 0;            ///< the logits over the vocabulary (once, not per layer)
  /// The sum of the components.
  double total() const {
    return qkv + attention_scores + attention_values + output_projection + mlp + lm_head;
  }
};

/// Forward FLOPs per token (the matmuls: everything else is O(d) per token and left out).
/// **Exercise** (chapters/02_flops_6np/README.md, "The exercise").
FlopBreakdown forward_flops_per_token(const TransformerShape& shape, int64_t context);

/// Training FLOPs per token, forward + backward (the gradients of every product's operands);
/// the test measures them on the model's real backward. **Exercise**.
double training_flops_per_token(const TransformerShape& shape, int64_t context);

/// The 6N approximation: 6 x count_parameters(shape).matmul_weights.
double six_n_flops_per_token(const TransformerShape& shape);

/// Reads a Hugging Face config.json: Llama-family keys (model_type llama, mistral, qwen2:
/// hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads,
/// head_dim, vocab_size, tie_word_embeddings) or GPT-2 keys (n_embd, n_layer, n_head, n_inner,
/// n_positions, vocab_size). Informational keys (token ids, dtype, ...) are ignored; a key that
/// changes the architecture in a way these chapters do not build yet (experts, latent attention,
/// sliding windows, ...) is an error naming the key.
TransformerShape shape_from_hf_config(const nlohmann::json& config);

/// The analytic figures `fivefold plan` prints, as JSON (parameters, FLOPs per token exact and 6N,
/// and, when tokens > 0, training FLOPs and time at `peak_flops` x `mfu` on `devices` devices;
/// when budget > 0, the compute-optimal split of that budget).
nlohmann::json plan(const TransformerShape& shape, int64_t context, double tokens, double budget,
                    double peak_flops, double mfu, int64_t devices);

/// A compute-optimal (Chinchilla) split of a FLOP budget C = 6 N D.
struct ComputeOptimal {
  double parameters;  ///< N
  double tokens;      ///< D
};

/// Hoffmann et al. 2022 (approaches 1 and 2: N and D both grow as C^0.5, about 20 tokens per
/// parameter): N = sqrt(C / (6 * 20)), D = 20 N.
ComputeOptimal chinchilla_optimal(double budget_flops);

/// Model FLOPs utilisation: achieved model FLOPs per second over the hardware's peak.
double model_flops_utilization(double tokens_per_second, double flops_per_token, double peak_flops);

/// Counts the matmul FLOPs LibTorch executes while it is alive, on every thread (forward and
/// autograd's backward): aten::mm, addmm, bmm, baddbmm, mv, addmv and dot, from their input
/// shapes (RecordFunction callbacks). One counter may be alive at a time.
class FlopCounter {
 public:
  FlopCounter();
  ~FlopCounter();
  FlopCounter(const FlopCounter&) = delete;
  FlopCounter& operator=(const FlopCounter&) = delete;
  /// FLOPs counted so far.
  double flops() const;
  /// Sets the count back to zero.
  void reset();

 private:
  uint64_t handle_;
};

/// A Llama- or GPT-2-style model's weights drawn for `shape` (chapter 01's seeded init), keyed by
/// Hugging Face names. Used to check count_parameters against numel, and to measure FLOPs.
std::map<std::string, torch::Tensor> make_weights(const TransformerShape& shape, uint64_t seed);

/// Forward pass of that model over tokens [batch, seq]: returns logits [batch, seq, vocab].
/// Attention is written out (scores, causal mask, softmax, weighted values), as in chapter 03.
torch::Tensor forward(const TransformerShape& shape,
                      const std::map<std::string, torch::Tensor>& weights,
                      const torch::Tensor& tokens);

/// Bytes of activations a forward pass leaves for backward: the CPU storage allocated by forward()
/// and the cross-entropy loss over `tokens` that is still alive when backward would start
/// (measured with fivefold::MemoryTracker). Chapter 02 checks its structure: per layer it is
/// linear in the tokens plus exactly one fp32 [batch, heads, seq, seq] tensor, the softmax output.
int64_t measure_activation_bytes(const TransformerShape& shape,
                                 const std::map<std::string, torch::Tensor>& weights,
                                 const torch::Tensor& tokens);

}  // namespace fivefold::ch02
