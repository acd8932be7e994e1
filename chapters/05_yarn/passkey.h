#pragma once
/// @file passkey.h
/// @brief Chapter 05's long-range task: pass-key retrieval. A row is random words with
/// "key 4831. " somewhere among them (a uniformly random place) and " key? 4831" at the end, so
/// answering needs attention to wherever the key is, up to the whole row back. Only the four
/// answer digits are scored; everything else is unpredictable by construction.

#include <torch/torch.h>

#include <cstdint>

#include "03_transformer/data.h"
#include "03_transformer/model.h"

namespace fivefold::ch05 {

/// The tokens of `rows` pass-key rows of exactly `length` + 1 byte tokens each (the text
/// "<words> key dddd. <words> key? dddd"), as a next-token batch whose targets are -100 (ignored by the
/// loss) everywhere but the four answer digits. Deterministic in (seed, index). length >= 24.
ch03::Batch passkey_batch(uint64_t seed, int64_t index, int64_t rows, int64_t length);

/// What a model does on pass-key rows of one length.
struct PasskeyReport {
  double perplexity = 0;  ///< exp(mean loss) on the answer digits: 1 is certain, 10 is guessing
  double accuracy = 0;    ///< share of rows whose four digits are all the model's top choice
};

/// Scores `rows` rows of `length` (evaluation rows: index stream separate from training) in chunks
/// of `chunk` rows. With the correct digits fed back, "all four are the top choice" is exactly
/// what greedy generation would answer.
PasskeyReport evaluate_passkey(ch03::Transformer& model, uint64_t seed, int64_t length,
                               int64_t rows, int64_t chunk = 25);

}  // namespace fivefold::ch05
