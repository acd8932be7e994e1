#pragma once
// What chapter 09's tests share: a small model and the global batches every variant trains on.

#include "03_transformer/data.h"
#include "03_transformer/model.h"
#include "03_transformer/train.h"

namespace fivefold::ch09::testing {

/// 2 layers of d_model 32, 4 query and 2 key/value heads, the byte vocabulary.
inline ch03::ModelConfig small_config(bool tied) {
  ch03::ModelConfig c;
  c.d_model = 32;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.d_ff = 64;
  c.tied_embeddings = tied;
  return c;
}

/// Global batches of 8 rows x 16 tokens of the synthetic corpus (rank r takes its rows).
inline const ch03::BatchSampler& global_batches() {
  static const ch03::TokenDataset data(
      ch03::ByteTokenizer::encode(ch03::synthetic_corpus(0, ch03::Split::Train, 400)));
  static const ch03::BatchSampler sampler(data, 16, 8, 1);
  return sampler;
}

/// AdamW with a one-step warm-up and clipping small enough to act (the global norm must be right).
inline ch03::TrainConfig train_config() {
  ch03::TrainConfig t;
  t.warmup_steps = 1;
  t.total_steps = 10;
  t.grad_clip = 0.5;
  return t;
}

/// Single-device training, the reference every variant must reproduce: chapter 03's train_step on
/// the whole global batch, `steps` times, from `model` as given.
inline ch03::Transformer train_on_one_device(ch03::Transformer model, int steps) {
  auto optimizer = ch03::make_optimizer(model, train_config());
  for (int step = 0; step < steps; ++step)
    ch03::train_step(model, *optimizer, train_config(), {global_batches().batch(step)}, step);
  return model;
}

}  // namespace fivefold::ch09::testing
