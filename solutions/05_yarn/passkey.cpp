// Chapter 05's long-range task: pass-key rows and their evaluation.

#include "05_yarn/passkey.h"

#include <cmath>
#include <random>

#include "fivefold/error.h"
#include "fivefold/seed.h"

namespace fivefold::ch05 {

namespace {
constexpr int64_t kIgnore = -100;  // torch::cross_entropy_loss's default ignore_index

std::string words(std::mt19937_64& rng, size_t count) {
  std::uniform_int_distribution<int> letter(0, 25), word(2, 7);
  std::string text;
  while (text.size() < count) {
    for (int n = word(rng); n > 0 && text.size() < count; --n)
      text += static_cast<char>('a' + letter(rng));
    if (text.size() < count) text += ' ';
  }
  return text;
}

// "<words> key 4831. <words> key? 4831", exactly length + 1 characters; the key sits at a random
// place, so the model must find it by content, not at a fixed distance from the question.
std::string passkey_text(std::mt19937_64& rng, int64_t length) {
  std::uniform_int_distribution<int> digit(0, 9);
  std::string key;
  for (int i = 0; i < 4; ++i) key += static_cast<char>('0' + digit(rng));
  const std::string needle = "key " + key + ". ", question = " key? " + key;
  const size_t fill = static_cast<size_t>(length + 1) - needle.size() - question.size();
  const size_t before = std::uniform_int_distribution<size_t>(0, fill)(rng);
  return words(rng, before) + needle + words(rng, fill - before) + question;
}
}  // namespace

ch03::Batch passkey_batch(uint64_t seed, int64_t index, int64_t rows, int64_t length) {
  FIVEFOLD_CHECK(length >= 24 && rows >= 1, "passkey_batch: need length >= 24 and rows >= 1");
  std::mt19937_64 rng(seed_for(seed, "passkey/" + std::to_string(index)));
  auto tokens = torch::empty({rows, length + 1}, torch::kLong);
  for (int64_t r = 0; r < rows; ++r) {
    const auto row = ch03::ByteTokenizer::encode(passkey_text(rng, length));
    tokens[r] = torch::tensor(row, torch::kLong);
  }
  auto targets = torch::full({rows, length}, kIgnore, torch::kLong);
  // The last four targets are the answer digits.
  targets.narrow(1, length - 4, 4).copy_(tokens.narrow(1, length - 3, 4));
  return {tokens.narrow(1, 0, length).contiguous(), targets};
}

PasskeyReport evaluate_passkey(ch03::Transformer& model, uint64_t seed, int64_t length,
                               int64_t rows, int64_t chunk) {
  torch::NoGradGuard no_grad;
  double loss = 0;
  int64_t right = 0;
  for (int64_t start = 0; start < rows; start += chunk) {
    const int64_t n = std::min(chunk, rows - start);
    // Evaluation rows come from their own index range, never used for training.
    const ch03::Batch b = passkey_batch(seed, -1 - start, n, length);
    auto logits = model(b.inputs).narrow(1, length - 4, 4);  // [n, 4, vocab]
    auto targets = b.targets.narrow(1, length - 4, 4);       // [n, 4]
    loss += torch::cross_entropy_loss(logits.reshape({-1, logits.size(-1)}), targets.reshape({-1}))
                .item<double>() *
            static_cast<double>(n);
    right += (logits.argmax(-1) == targets).all(1).sum().item<int64_t>();
  }
  return {std::exp(loss / static_cast<double>(rows)),
          static_cast<double>(right) / static_cast<double>(rows)};
}

}  // namespace fivefold::ch05
