#pragma once
/// @file data.h
/// @brief Chapter 03 data: a byte-level tokenizer, a synthetic corpus a tiny model can learn on a
/// CPU (with a held-out split for exact-match accuracy), token datasets from text or nanoGPT-style
/// `.bin` files, and a batch sampler whose global batches do not depend on how many ranks share
/// them (so data parallelism, chapter 09, sees the same data as one device).

#include <torch/torch.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace fivefold::ch03 {

/// Bytes are tokens 0..255; three special tokens follow. Any UTF-8 (or binary) text encodes.
struct ByteTokenizer {
  static constexpr int64_t kBos = 256;    ///< beginning of sequence
  static constexpr int64_t kEos = 257;    ///< end of sequence
  static constexpr int64_t kPad = 258;    ///< padding
  static constexpr int64_t kVocab = 259;  ///< vocabulary size
  /// The bytes of `text` as tokens, optionally framed by BOS / EOS.
  static std::vector<int64_t> encode(const std::string& text, bool bos = false, bool eos = false);
  /// The bytes of `tokens`; special tokens are skipped. Throws for ids outside the vocabulary.
  static std::string decode(const std::vector<int64_t>& tokens);
};

/// The two halves of the synthetic corpus. A prompt belongs to exactly one of them (by a hash of
/// its text), so held-out accuracy measures generalisation, not memory.
enum class Split { Train, HeldOut };

/// One line of the synthetic language: `prompt` ends with the delimiter after which the model must
/// produce `answer`; the line is prompt + answer + "\n".
struct SyntheticExample {
  std::string task;    ///< "add", "copy", "reverse" or "recall"
  std::string prompt;  ///< e.g. "12+35="
  std::string answer;  ///< e.g. "47"
  /// The whole line, newline included.
  std::string line() const { return prompt + answer + "\n"; }
};

/// Example `index` of `split` for `seed`: deterministic, uniformly one of four tasks:
/// - add:     "a+b=" -> a + b, with a, b in 0..99
/// - copy:    "copy xyz|" -> "xyz" (3-6 lowercase letters)
/// - reverse: "rev xyz|" -> "zyx"
/// - recall:  "kv a3 b7 c1 ? b>" -> "7" (3-5 distinct keys, one queried)
SyntheticExample synthetic_example(uint64_t seed, Split split, int64_t index);

/// `count` examples' lines concatenated: a training text.
std::string synthetic_corpus(uint64_t seed, Split split, int64_t count);

/// A stream of tokens to train on.
class TokenDataset {
 public:
  /// Tokens given directly (each in 0..vocab-1 of the model that will read them).
  explicit TokenDataset(std::vector<int64_t> tokens);
  /// A text file, byte-tokenised. Throws fivefold::Error naming the file if it is missing or empty.
  static TokenDataset from_text_file(const std::string& path);
  /// A nanoGPT-style `.bin`: raw little-endian uint16 token ids, no header. Throws for a missing or
  /// empty file, or one whose size is not a whole number of tokens.
  static TokenDataset from_bin_file(const std::string& path);
  /// Writes `tokens` as a `.bin` (uint16, little-endian), atomically. Ids must fit in 16 bits.
  static void write_bin_file(const std::string& path, const std::vector<int64_t>& tokens);
  /// Number of tokens.
  int64_t size() const { return static_cast<int64_t>(tokens_.size()); }
  /// The tokens as a 1-D int64 tensor (shares no memory with the dataset).
  torch::Tensor tensor() const;
  /// The largest token id (for checking it against a model's vocabulary).
  int64_t max_token() const;

 private:
  std::vector<int64_t> tokens_;
};

/// Inputs and next-token targets, both [rows, seq_len] int64.
struct Batch {
  Batch() = default;
  /// A batch of whole windows (positions 0 .. seq − 1, weight 1).
  Batch(torch::Tensor inputs_, torch::Tensor targets_)
      : inputs(std::move(inputs_)), targets(std::move(targets_)) {}
  torch::Tensor inputs;   ///< tokens t .. t+seq_len-1 of each window
  torch::Tensor targets;  ///< tokens t+1 .. t+seq_len
  /// The tokens' positions in their window, int64 [seq] (undefined: 0 .. seq − 1). Chapter 12's
  /// context parallelism gives each rank some of every window's tokens, not always consecutive.
  torch::Tensor positions;
  /// How much this part's mean loss counts when the ranks' means are averaged (chapter 12: a rank
  /// holding n_r of a window's n tokens over cp ranks counts cp·n_r/n, so that unequal parts
  /// average to the window's mean; 1 otherwise).
  double loss_weight = 1.0;
};

/// batch.positions, or 0 .. seq − 1 when it has none.
torch::Tensor batch_positions(const Batch& batch);

/// Random windows of `seq_len + 1` tokens. Step k's global batch is a function of (seed, k) only:
/// `batch(k)` is all of it, and `batch(k, rank, world)` is rows [rank·B/W, (rank+1)·B/W) of the
/// same global batch. The sampler has no state, so a checkpoint's "data position" is the step
/// number.
class BatchSampler {
 public:
  /// Throws fivefold::Error if the dataset has fewer than seq_len + 1 tokens or a size is < 1.
  BatchSampler(const TokenDataset& dataset, int64_t seq_len, int64_t global_batch, uint64_t seed);
  /// This rank's rows of step `step`'s global batch. `global_batch` must divide by `world`.
  Batch batch(int64_t step, int rank = 0, int world = 1) const;

 private:
  torch::Tensor tokens_;
  int64_t seq_len_;
  int64_t global_batch_;
  uint64_t seed_;
};

/// Where a run's tokens come from.
struct DataConfig {
  std::string path;                    ///< a text file, or a `.bin`; empty: the synthetic corpus
  uint64_t seed = 0;                   ///< synthetic corpus and batch order
  int64_t synthetic_examples = 50000;  ///< lines in the synthetic training split
  double val_fraction = 0.1;           ///< of a file's tokens, held out at its end
};

/// Train and held-out tokens for `data`: the synthetic corpus's two splits (held-out: a tenth as
/// many lines), or a file's tokens split at 1 - val_fraction. Throws fivefold::Error for a
/// missing, empty or too short file.
std::pair<TokenDataset, TokenDataset> load_datasets(const DataConfig& data, int64_t seq_len);

}  // namespace fivefold::ch03
