// Chapter 03 data: tokenizer round trips, the synthetic language's answers and held-out split,
// datasets from files (and their errors), and the rank-independent batch sampler.

#include <filesystem>
#include <fstream>
#include <map>
#include <set>

#include "03_transformer/data.h"
#include "fivefold/error.h"
#include "testing.h"

namespace fs = std::filesystem;
using namespace fivefold::ch03;

TEST(ByteTokenizer, RoundTripsAnyUtf8) {
  const std::string text =
      "h\xC3\xA9llo, \xE4\xB8\x96\xE7\x95\x8C\n\t\x01";  // "héllo, 世界" + controls
  const auto tokens = ByteTokenizer::encode(text, /*bos=*/true, /*eos=*/true);
  EXPECT_EQ(tokens.front(), ByteTokenizer::kBos);
  EXPECT_EQ(tokens.back(), ByteTokenizer::kEos);
  EXPECT_EQ(tokens.size(), text.size() + 2);
  EXPECT_EQ(ByteTokenizer::decode(tokens), text);  // specials are skipped
  EXPECT_THROW(ByteTokenizer::decode({ByteTokenizer::kVocab}), fivefold::Error);
  EXPECT_THROW(ByteTokenizer::decode({-1}), fivefold::Error);
}

TEST(SyntheticCorpus, EveryAnswerIsRight) {
  std::map<std::string, int> per_task;
  for (auto split : {Split::Train, Split::HeldOut}) {
    for (int64_t i = 0; i < 2000; ++i) {
      const auto e = synthetic_example(3, split, i);
      per_task[e.task] += 1;
      if (e.task == "add") {
        const auto plus = e.prompt.find('+');
        const int a = std::stoi(e.prompt.substr(0, plus)), b = std::stoi(e.prompt.substr(plus + 1));
        EXPECT_EQ(e.answer, std::to_string(a + b)) << e.prompt;
      } else if (e.task == "copy") {
        EXPECT_EQ(e.prompt, "copy " + e.answer + "|");
      } else if (e.task == "reverse") {
        EXPECT_EQ(e.prompt, "rev " + std::string(e.answer.rbegin(), e.answer.rend()) + "|");
      } else {
        ASSERT_EQ(e.task, "recall");
        const char key = e.prompt[e.prompt.size() - 2];  // "... ? b>"
        const auto pos = e.prompt.find(std::string(" ") + key);
        ASSERT_NE(pos, std::string::npos) << e.prompt;
        EXPECT_EQ(e.answer, std::string(1, e.prompt[pos + 2])) << e.prompt;
      }
      EXPECT_EQ(e.line(), e.prompt + e.answer + "\n");
    }
  }
  for (const auto& [task, count] : per_task) {
    EXPECT_NEAR(count, 1000, 150) << task << ": the four tasks are drawn uniformly";
  }
}

TEST(SyntheticCorpus, DeterministicAndSplitsShareNoPrompt) {
  EXPECT_EQ(synthetic_example(5, Split::Train, 17).line(),
            synthetic_example(5, Split::Train, 17).line());
  EXPECT_EQ(synthetic_corpus(5, Split::HeldOut, 50), synthetic_corpus(5, Split::HeldOut, 50));
  EXPECT_NE(synthetic_corpus(5, Split::Train, 50), synthetic_corpus(6, Split::Train, 50));
  std::set<std::string> train;
  for (int64_t i = 0; i < 5000; ++i) train.insert(synthetic_example(5, Split::Train, i).prompt);
  for (int64_t i = 0; i < 1000; ++i) {
    EXPECT_EQ(train.count(synthetic_example(5, Split::HeldOut, i).prompt), 0u);
  }
  const std::string corpus = synthetic_corpus(5, Split::Train, 100);
  EXPECT_EQ(std::count(corpus.begin(), corpus.end(), '\n'), 100);
}

namespace {
class DataFiles : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return dir_.path(name); }
  fivefold::testing::ScratchDir dir_{"data"};
};
}  // namespace

TEST_F(DataFiles, BinAndTextFiles) {
  const std::vector<int64_t> tokens = {0, 1, 255, 256, 50256, 65535, 7};
  TokenDataset::write_bin_file(path("t.bin"), tokens);
  EXPECT_EQ(fs::file_size(path("t.bin")), 2 * tokens.size());
  const auto bin = TokenDataset::from_bin_file(path("t.bin"));
  EXPECT_TENSOR_EQ(bin.tensor(), torch::tensor(tokens, torch::kLong));
  EXPECT_EQ(bin.max_token(), 65535);
  // Byte order as numpy's uint16 tofile() on little-endian machines: 50256 = 0xC450 -> 50 C4.
  std::ifstream raw(path("t.bin"), std::ios::binary);
  std::string bytes((std::istreambuf_iterator<char>(raw)), std::istreambuf_iterator<char>());
  EXPECT_EQ(static_cast<unsigned char>(bytes[8]), 0x50);
  EXPECT_EQ(static_cast<unsigned char>(bytes[9]), 0xC4);

  std::ofstream(path("t.txt")) << "ab\n";
  EXPECT_TENSOR_EQ(TokenDataset::from_text_file(path("t.txt")).tensor(),
                   torch::tensor({97L, 98L, 10L}));
}

TEST_F(DataFiles, BadFilesAreClearErrors) {
  auto expect_error = [](const std::function<void()>& load, const std::string& fragment) {
    EXPECT_TRUE(fivefold::testing::throws_error_containing(load, fragment));
  };
  expect_error([&] { TokenDataset::from_text_file(path("absent.txt")); }, "absent.txt");
  std::ofstream(path("empty.txt")).close();
  expect_error([&] { TokenDataset::from_text_file(path("empty.txt")); }, "empty");
  expect_error([&] { TokenDataset::from_bin_file(path("empty.txt")); }, "empty");
  std::ofstream(path("odd.bin")) << "abc";
  expect_error([&] { TokenDataset::from_bin_file(path("odd.bin")); }, "whole number of uint16");
  expect_error([&] { TokenDataset::write_bin_file(path("x.bin"), {70000}); }, "uint16");
  EXPECT_FALSE(fs::exists(path("x.bin")));
  expect_error([&] { TokenDataset(std::vector<int64_t>{}); }, "no tokens");
}

TEST(BatchSampler, WindowsAreNextTokenPairsFromTheData) {
  const TokenDataset data(ByteTokenizer::encode(synthetic_corpus(1, Split::Train, 200)));
  const BatchSampler sampler(data, 32, 8, 42);
  const auto b = sampler.batch(0);
  EXPECT_EQ(b.inputs.sizes(), torch::IntArrayRef({8, 32}));
  EXPECT_TENSOR_EQ(b.inputs.narrow(1, 1, 31), b.targets.narrow(1, 0, 31));
  // Every row is a contiguous window of the dataset.
  const auto all = data.tensor();
  for (int64_t r = 0; r < 8; ++r) {
    bool found = false;
    for (int64_t start = 0; start + 33 <= data.size() && !found; ++start) {
      found = torch::equal(all.narrow(0, start, 32), b.inputs[r]) &&
              torch::equal(all.narrow(0, start + 1, 32), b.targets[r]);
    }
    EXPECT_TRUE(found) << "row " << r;
  }
  EXPECT_TENSOR_EQ(sampler.batch(5).inputs, BatchSampler(data, 32, 8, 42).batch(5).inputs);
  EXPECT_FALSE(torch::equal(sampler.batch(5).inputs, sampler.batch(6).inputs));
}

TEST(BatchSampler, ShardsAreSlicesOfTheGlobalBatch) {
  const TokenDataset data(ByteTokenizer::encode(synthetic_corpus(1, Split::Train, 200)));
  const BatchSampler sampler(data, 16, 8, 7);
  for (int64_t step : {0, 3, 100}) {
    const auto global = sampler.batch(step);
    for (int world : {1, 2, 4, 8}) {
      std::vector<torch::Tensor> inputs, targets;
      for (int rank = 0; rank < world; ++rank) {
        const auto part = sampler.batch(step, rank, world);
        inputs.push_back(part.inputs);
        targets.push_back(part.targets);
      }
      EXPECT_TENSOR_EQ(torch::cat(inputs, 0), global.inputs);
      EXPECT_TENSOR_EQ(torch::cat(targets, 0), global.targets);
    }
  }
  EXPECT_THROW(sampler.batch(0, 0, 3), fivefold::Error);  // 8 rows do not split into 3
  EXPECT_THROW(sampler.batch(0, 2, 2), fivefold::Error);  // no rank 2 of 2
  EXPECT_THROW(sampler.batch(-1), fivefold::Error);
  EXPECT_THROW(BatchSampler(TokenDataset({1, 2, 3}), 3, 1, 0), fivefold::Error);  // needs 4 tokens
}
