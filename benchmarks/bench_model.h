#pragma once
// The model the parallelism benchmarks train: chapter 03's, Llama-shaped, sized by two flags.

#include <algorithm>
#include <cstdint>

#include "03_transformer/model.h"

namespace fivefold::bench {

/// d_model and n_layers as given; heads of 64 (at least one), as many key/value heads as query
/// heads, and an MLP of 8/3·d_model rounded up to a multiple of 64 (Llama's SwiGLU width rule).
/// Positions as the caller sets them (rope_theta).
inline ch03::ModelConfig bench_model(int64_t d_model, int64_t n_layers) {
  ch03::ModelConfig config;
  config.d_model = d_model;
  config.n_layers = n_layers;
  config.n_heads = config.n_kv_heads = std::max<int64_t>(1, d_model / 64);
  config.d_ff = ((8 * d_model / 3 + 63) / 64) * 64;
  return config;
}

}  // namespace fivefold::bench
