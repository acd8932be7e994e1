#pragma once
/// @file rope.h
/// @brief Chapter 04: rotary position embeddings (RoPE, Su et al. 2021). Each pair of a query's or
/// key's features is rotated by an angle proportional to the token's position, m·θ_i with
/// θ_i = base^(-2i/d), so that the score q_m·k_n depends on the positions only through m − n.
///
/// Two pair layouts are in use. **Interleaved**: pairs (x_{2i}, x_{2i+1}), as in Meta's and
/// DeepSeek's reference code. **Half-split**: pairs (x_i, x_{i+d/2}), as in Hugging Face's
/// `rotate_half`. They compute the same function up to a permutation of the q/k projection rows
/// (interleaved_to_half_split); checkpoints here use Hugging Face's layout.

#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>

#include "03_transformer/model.h"

namespace fivefold::ch04 {

/// Which features form a rotated pair.
enum class RopeLayout {
  HalfSplit,   ///< (x_i, x_{i+d/2}): Hugging Face
  Interleaved  ///< (x_{2i}, x_{2i+1}): Meta, DeepSeek
};

/// θ_i = base^(-2i/d) for i = 0 .. d/2 − 1, float64 [d/2]. Pair i turns by m·θ_i at position m:
/// pair 0 once per token, the last pair once every ~base tokens.
torch::Tensor rope_frequencies(int64_t head_dim, double base);

/// cos(m·θ_i) and sin(m·θ_i) for positions m = first .. first + count − 1: two float32
/// [count, d/2] tensors (angles computed in float64).
std::pair<torch::Tensor, torch::Tensor> rope_angles(const torch::Tensor& frequencies, int64_t first,
                                                    int64_t count);
/// The same at any positions (int64 [count], e.g. a sequence shard that is not contiguous).
std::pair<torch::Tensor, torch::Tensor> rope_angles(const torch::Tensor& frequencies,
                                                    const torch::Tensor& positions);

/// Rotates each pair of x's last dimension: (a, b) -> (a·cos − b·sin, a·sin + b·cos).
/// x [..., seq, head_dim]; cos, sin [seq, head_dim/2] (broadcast over the leading dimensions).
/// **Exercise** (README, "The exercise").
torch::Tensor apply_rope(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                         RopeLayout layout);

/// The same rotation in complex numbers, for the lesson and as a check: each interleaved pair is
/// z = x_{2i} + i·x_{2i+1}, and z·e^{i·m·θ_i} is its rotation. x [..., seq, head_dim], float32 or
/// float64; positions first .. first + seq − 1.
torch::Tensor apply_rope_complex(const torch::Tensor& x, int64_t first, double base);

/// The permutation P, as indices [d], with half_split(x[P]) == interleaved(x)[P]: half-split
/// feature j is interleaved feature P[j] (P = 0, 2, 4, ..., 1, 3, 5, ...). Applied to the rows of
/// q_proj and k_proj (per head), it converts Meta-layout weights to Hugging Face's.
torch::Tensor interleaved_to_half_split(int64_t head_dim);

/// RoPE as chapter 03's position encoding: cos/sin precomputed for `cached_positions` positions
/// (computed on the fly beyond them), applied to q and k.
class RotaryEmbedding : public ch03::PositionEncoding {
 public:
  /// Throws fivefold::Error for an odd head_dim or a non-positive base.
  RotaryEmbedding(int64_t head_dim, double base, RopeLayout layout = RopeLayout::HalfSplit,
                  int64_t cached_positions = 4096);
  /// q, k [batch, heads, seq, head_dim] at `positions` (int64 [seq]) -> rotated (q, k).
  std::pair<torch::Tensor, torch::Tensor> encode(const torch::Tensor& q, const torch::Tensor& k,
                                                 const torch::Tensor& positions) const override;
  /// cos and sin at `positions` (int64 [seq]), float32 [seq, head_dim/2]: the cached rows, or
  /// computed beyond the cache. What encode rotates by; the training run's fused RoPE
  /// (runtime/fast.h) reads them here.
  std::pair<torch::Tensor, torch::Tensor> angles(const torch::Tensor& positions) const;
  /// The pair layout it rotates.
  RopeLayout layout() const { return layout_; }

 private:
  RopeLayout layout_;
  torch::Tensor frequencies_;  // [d/2] float64
  torch::Tensor cos_, sin_;    // [cached_positions, d/2] float32
};

/// Chapter 04's recipe: chapter 03's modules, with RoPE (Hugging Face layout) as the position
/// encoding when config.rope_theta > 0. Refuses configs that need a later chapter.
ch03::ModelRecipe recipe(const ch03::ModelConfig& config);

/// The model (or `part` of it) from recipe(config); a ch03::ModelBuilder.
ch03::Transformer make_model(const ch03::ModelConfig& config, const ch03::ModelPart& part = {});

/// ch03::load_model with make_model: a Llama checkpoint with `rope_theta` computes what
/// `transformers` computes.
ch03::Transformer load_model(const std::string& dir);

}  // namespace fivefold::ch04
