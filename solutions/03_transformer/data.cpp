// Chapter 03 data: tokenizer, synthetic corpus, datasets, and the rank-independent batch sampler.

#include "03_transformer/data.h"

#include <algorithm>
#include <filesystem>
#include <random>

#include "fivefold/error.h"
#include "fivefold/io.h"
#include "fivefold/seed.h"

namespace fivefold::ch03 {

torch::Tensor batch_positions(const Batch& batch) {
  return batch.positions.defined()
             ? batch.positions
             : torch::arange(batch.inputs.size(1), torch::TensorOptions(torch::kLong));
}

std::vector<int64_t> ByteTokenizer::encode(const std::string& text, bool bos, bool eos) {
  std::vector<int64_t> tokens;
  tokens.reserve(text.size() + 2);
  if (bos) tokens.push_back(kBos);
  for (unsigned char byte : text) tokens.push_back(byte);
  if (eos) tokens.push_back(kEos);
  return tokens;
}

std::string ByteTokenizer::decode(const std::vector<int64_t>& tokens) {
  std::string text;
  for (int64_t token : tokens) {
    FIVEFOLD_CHECK(token >= 0 && token < kVocab, "ByteTokenizer: token ", token,
                   " is outside the vocabulary 0..", kVocab - 1);
    if (token < 256) text.push_back(static_cast<char>(token));
  }
  return text;
}

namespace {

// Draws one example of a uniformly chosen task.
SyntheticExample draw(std::mt19937_64& rng) {
  auto uniform = [&rng](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  auto letters = [&](int n) {
    std::string s;
    for (int i = 0; i < n; ++i) s.push_back(static_cast<char>('a' + uniform(0, 25)));
    return s;
  };
  switch (uniform(0, 3)) {
    case 0: {
      const int a = uniform(0, 99), b = uniform(0, 99);
      return {"add", std::to_string(a) + "+" + std::to_string(b) + "=", std::to_string(a + b)};
    }
    case 1: {
      const std::string word = letters(uniform(3, 6));
      return {"copy", "copy " + word + "|", word};
    }
    case 2: {
      const std::string word = letters(uniform(3, 6));
      return {"reverse", "rev " + word + "|", std::string(word.rbegin(), word.rend())};
    }
    default: {
      // 3-5 distinct keys with a digit each; ask for one of them.
      std::string keys = "abcdefghijklmnopqrstuvwxyz";
      std::shuffle(keys.begin(), keys.end(), rng);
      const int n = uniform(3, 5);
      std::string prompt = "kv";
      std::vector<int> values;
      for (int i = 0; i < n; ++i) {
        values.push_back(uniform(0, 9));
        prompt += std::string(" ") + keys[i] + std::to_string(values.back());
      }
      const int asked = uniform(0, n - 1);
      return {"recall", prompt + " ? " + keys[asked] + ">", std::to_string(values[asked])};
    }
  }
}

bool held_out(const std::string& prompt) { return seed_for(0, prompt) % 10 == 0; }

}  // namespace

SyntheticExample synthetic_example(uint64_t seed, Split split, int64_t index) {
  FIVEFOLD_CHECK(index >= 0, "synthetic_example: index must be >= 0, got ", index);
  const std::string stream = split == Split::Train ? "train" : "held_out";
  // Redraw until the prompt falls in this split (a tenth of prompts are held out): the two splits
  // share the distribution but never a prompt.
  for (int attempt = 0;; ++attempt) {
    std::mt19937_64 rng(seed_for(
        seed, "synthetic/" + stream + "/" + std::to_string(index) + "/" + std::to_string(attempt)));
    SyntheticExample example = draw(rng);
    if (held_out(example.prompt) == (split == Split::HeldOut)) return example;
  }
}

std::string synthetic_corpus(uint64_t seed, Split split, int64_t count) {
  FIVEFOLD_CHECK(count >= 1, "synthetic_corpus: count must be >= 1, got ", count);
  std::string text;
  for (int64_t i = 0; i < count; ++i) text += synthetic_example(seed, split, i).line();
  return text;
}

TokenDataset::TokenDataset(std::vector<int64_t> tokens) : tokens_(std::move(tokens)) {
  FIVEFOLD_CHECK(!tokens_.empty(), "TokenDataset: no tokens");
  for (int64_t t : tokens_) FIVEFOLD_CHECK(t >= 0, "TokenDataset: negative token id ", t);
}

TokenDataset TokenDataset::from_text_file(const std::string& path) {
  const std::string text = io::read_file(path);
  FIVEFOLD_CHECK(!text.empty(), path, ": the file is empty: nothing to train on");
  return TokenDataset(ByteTokenizer::encode(text));
}

TokenDataset TokenDataset::from_bin_file(const std::string& path) {
  const std::string bytes = io::read_file(path);
  FIVEFOLD_CHECK(!bytes.empty(), path, ": the file is empty: nothing to train on");
  FIVEFOLD_CHECK(bytes.size() % 2 == 0, path, ": ", bytes.size(),
                 " bytes is not a whole number of uint16 tokens (truncated, or not a .bin?)");
  std::vector<int64_t> tokens(bytes.size() / 2);
  for (size_t i = 0; i < tokens.size(); ++i) {  // little-endian uint16, as numpy's tofile writes
    tokens[i] = static_cast<unsigned char>(bytes[2 * i]) |
                (static_cast<int64_t>(static_cast<unsigned char>(bytes[2 * i + 1])) << 8);
  }
  return TokenDataset(std::move(tokens));
}

void TokenDataset::write_bin_file(const std::string& path, const std::vector<int64_t>& tokens) {
  std::string bytes;
  bytes.reserve(2 * tokens.size());
  for (int64_t t : tokens) {
    FIVEFOLD_CHECK(t >= 0 && t < 65536, "write_bin_file: token ", t, " does not fit in uint16");
    bytes.push_back(static_cast<char>(t & 0xff));
    bytes.push_back(static_cast<char>(t >> 8));
  }
  io::write_file_atomic(path, bytes);
}

torch::Tensor TokenDataset::tensor() const { return torch::tensor(tokens_, torch::kLong); }

int64_t TokenDataset::max_token() const {
  return *std::max_element(tokens_.begin(), tokens_.end());
}

BatchSampler::BatchSampler(const TokenDataset& dataset, int64_t seq_len, int64_t global_batch,
                           uint64_t seed)
    : tokens_(dataset.tensor()), seq_len_(seq_len), global_batch_(global_batch), seed_(seed) {
  FIVEFOLD_CHECK(seq_len >= 1 && global_batch >= 1,
                 "BatchSampler: seq_len and global_batch must be >= 1");
  FIVEFOLD_CHECK(dataset.size() >= seq_len + 1, "BatchSampler: the dataset has ", dataset.size(),
                 " tokens; a window of seq_len ", seq_len, " needs ", seq_len + 1);
}

Batch BatchSampler::batch(int64_t step, int rank, int world) const {
  FIVEFOLD_CHECK(step >= 0, "BatchSampler: step must be >= 0, got ", step);
  FIVEFOLD_CHECK(world >= 1 && rank >= 0 && rank < world, "BatchSampler: rank ", rank, " of ",
                 world);
  FIVEFOLD_CHECK(global_batch_ % world == 0, "BatchSampler: global batch ", global_batch_,
                 " does not divide into ", world, " ranks");
  // The whole global batch's window starts, from (seed, step) alone: every rank draws the same.
  const int64_t windows = tokens_.size(0) - seq_len_;  // starts 0 .. N - seq_len - 1
  auto starts = torch::randint(windows, {global_batch_, 1},
                               generator_for(seed_, "batch/" + std::to_string(step)));
  const int64_t rows = global_batch_ / world;
  starts = starts.narrow(0, rank * rows, rows);  // [rows, 1]
  auto index =
      starts + torch::arange(seq_len_ + 1, torch::kLong).view({1, -1});  // [rows, seq_len + 1]
  auto windows_tokens = tokens_.index_select(0, index.view(-1)).view({rows, seq_len_ + 1});
  return {windows_tokens.narrow(1, 0, seq_len_).contiguous(),
          windows_tokens.narrow(1, 1, seq_len_).contiguous()};
}

std::pair<TokenDataset, TokenDataset> load_datasets(const DataConfig& data, int64_t seq_len) {
  if (data.path.empty()) {
    const int64_t held_out = std::max<int64_t>(1, data.synthetic_examples / 10);
    return {
        TokenDataset(ByteTokenizer::encode(
            synthetic_corpus(data.seed, Split::Train, data.synthetic_examples))),
        TokenDataset(ByteTokenizer::encode(synthetic_corpus(data.seed, Split::HeldOut, held_out)))};
  }
  const bool bin = std::filesystem::path(data.path).extension() == ".bin";
  const TokenDataset all =
      bin ? TokenDataset::from_bin_file(data.path) : TokenDataset::from_text_file(data.path);
  // The last val_fraction of the tokens is held out; both parts need one window of seq_len + 1.
  const int64_t val = static_cast<int64_t>(static_cast<double>(all.size()) * data.val_fraction);
  FIVEFOLD_CHECK(val >= seq_len + 1 && all.size() - val >= seq_len + 1, "data '", data.path,
                 "' has ", all.size(), " tokens: too few for a training and a held-out part (",
                 data.val_fraction, ") of at least seq_len + 1 = ", seq_len + 1, " tokens each");
  auto tokens = all.tensor();
  auto to_vector = [](const torch::Tensor& t) {
    return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
  };
  return {TokenDataset(to_vector(tokens.narrow(0, 0, all.size() - val).contiguous())),
          TokenDataset(to_vector(tokens.narrow(0, all.size() - val, val).contiguous()))};
}

}  // namespace fivefold::ch03
