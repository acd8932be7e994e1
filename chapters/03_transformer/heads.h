#pragma once
/// @file heads.h
/// @brief Grouped-query attention's two reshapes, shared by every attention kernel that works
/// with n_heads query heads over n_kv_heads key/value heads (chapter 12's blockwise attention, the
/// training run's tiled kernel in runtime/fast.h): each key/value head repeated for the query
/// heads it serves, and the gradients of those repeats summed back onto their head.

#include <torch/torch.h>

#include <cstdint>

namespace fivefold::ch03 {

/// t [batch, n_kv_heads, seq, d] -> [batch, heads, seq, d]: kv head j serves query heads
/// j·g .. j·g + g − 1 (g = heads / n_kv_heads); t itself when g is 1.
inline torch::Tensor expand_heads(const torch::Tensor& t, int64_t heads) {
  const int64_t group = heads / t.size(1);
  return group == 1 ? t : t.repeat_interleave(group, 1);
}

/// The gradient of expand_heads: t [batch, heads, seq, d] -> [batch, kv_heads, seq, d], each
/// kv head's g repeats summed.
inline torch::Tensor fold_heads(const torch::Tensor& t, int64_t kv_heads) {
  const int64_t group = t.size(1) / kv_heads;
  return group == 1 ? t : t.unflatten(1, {kv_heads, group}).sum(2);
}

}  // namespace fivefold::ch03
