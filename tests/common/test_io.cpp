// safetensors and JSON files: round trips, a file written by "another implementation" (bytes
// built here from the format's specification), rejection of malformed files, atomic writes.

#include <fcntl.h>
#include <sys/stat.h>

#include <chrono>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <thread>

#include "fivefold/error.h"
#include "fivefold/io.h"
#include "testing.h"

namespace fs = std::filesystem;
using fivefold::Error;
using namespace fivefold::io;

namespace {

// A fresh directory per test, removed afterwards.
class IoTest : public ::testing::Test {
 protected:
  std::string path(const std::string& name) const { return dir_.path(name); }
  fivefold::testing::ScratchDir dir_{"io"};
};

std::string le64(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((v >> (8 * i)) & 0xff);
  return out;
}

template <typename T>
std::string raw(std::initializer_list<T> values) {
  std::string out;
  for (T v : values) out.append(reinterpret_cast<const char*>(&v), sizeof(T));
  return out;
}

std::string file_from(const std::string& header, const std::string& data) {
  return le64(header.size()) + header + data;
}

// Expects parse_safetensors to reject `bytes` with an error naming the file and containing
// `fragment`.
void expect_rejected(const std::string& bytes, const std::string& fragment) {
  const auto parse = [&] { parse_safetensors(bytes, "test.safetensors"); };
  EXPECT_TRUE(fivefold::testing::throws_error_containing(parse, fragment));
  EXPECT_TRUE(fivefold::testing::throws_error_containing(parse, "test.safetensors"));
}

}  // namespace

TEST_F(IoTest, RoundTripsEveryDtypeShapeAndMetadata) {
  TensorMap tensors;
  tensors["f64"] = torch::randn({3, 2}, torch::kDouble);
  tensors["f32"] = torch::randn({4, 5});
  tensors["f16"] = torch::randn({7}).to(torch::kHalf);
  tensors["bf16"] = torch::randn({2, 3}).to(torch::kBFloat16);
  tensors["i64"] = torch::arange(-5, 5, torch::kLong);
  tensors["i32"] = torch::arange(0, 6, torch::kInt).view({2, 3});
  tensors["i16"] = torch::arange(-3, 3).to(torch::kShort);
  tensors["i8"] = torch::arange(-3, 3).to(torch::kChar);
  tensors["u8"] = torch::arange(0, 250, 7).to(torch::kByte);
  tensors["bool"] = torch::tensor({true, false, true});
  tensors["empty"] = torch::empty({0, 4});
  tensors["scalar"] = torch::tensor(3.25);
  tensors["strided"] = torch::randn({4, 6}).t();  // not contiguous: stored as its values
  save_safetensors(path("m.safetensors"), tensors, {{"format", "pt"}, {"step", "12"}});

  const TensorMap loaded = load_safetensors(path("m.safetensors"));
  ASSERT_EQ(loaded.size(), tensors.size());
  for (const auto& [name, tensor] : tensors) {
    ASSERT_TRUE(loaded.count(name)) << name;
    EXPECT_EQ(loaded.at(name).sizes(), tensor.sizes()) << name;
    EXPECT_TENSOR_EQ(loaded.at(name), tensor);
  }
  const auto metadata = load_safetensors_metadata(path("m.safetensors"));
  EXPECT_EQ(metadata.at("format"), "pt");
  EXPECT_EQ(metadata.at("step"), "12");
}

TEST_F(IoTest, WrittenHeaderFollowsTheFormat) {
  save_safetensors(path("w.safetensors"), {{"x", torch::ones({2, 2})}});
  const std::string bytes = read_file(path("w.safetensors"));
  uint64_t length = 0;
  std::memcpy(&length, bytes.data(), 8);
  EXPECT_EQ(length % 8, 0u) << "data should start 8-byte aligned";
  const auto header = nlohmann::json::parse(bytes.substr(8, length));
  EXPECT_EQ(header["x"]["dtype"], "F32");
  EXPECT_EQ(header["x"]["shape"], nlohmann::json({2, 2}));
  EXPECT_EQ(header["x"]["data_offsets"], nlohmann::json({0, 16}));
  EXPECT_EQ(bytes.size(), 8 + length + 16);
}

TEST_F(IoTest, ReadsAFileBuiltByHandFromTheSpecification) {
  // As another writer might lay it out: keys not in data order, spaces, metadata first.
  const std::string header =
      R"({"__metadata__": {"format": "pt"}, )"
      R"("model.embed_tokens.weight": {"dtype": "I64", "shape": [2], "data_offsets": [8, 24]}, )"
      R"("lm_head.weight": {"dtype": "F32", "shape": [2, 1], "data_offsets": [0, 8]}})";
  const std::string data = raw<float>({1.5f, -2.0f}) + raw<int64_t>({7, -9});
  std::ofstream(path("hand.safetensors"), std::ios::binary) << file_from(header, data);

  const TensorMap loaded = load_safetensors(path("hand.safetensors"));
  ASSERT_EQ(loaded.size(), 2u);
  EXPECT_TENSOR_EQ(loaded.at("lm_head.weight"), torch::tensor({1.5f, -2.0f}).view({2, 1}));
  EXPECT_TENSOR_EQ(loaded.at("model.embed_tokens.weight"),
                   torch::tensor({int64_t{7}, int64_t{-9}}));
  EXPECT_EQ(load_safetensors_metadata(path("hand.safetensors")).at("format"), "pt");
}

TEST_F(IoTest, RejectsMalformedFiles) {
  const std::string good_header =
      R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})";
  const std::string good_data = raw<float>({1.0f, 2.0f});
  const std::string good = file_from(good_header, good_data);
  ASSERT_EQ(parse_safetensors(good, "good").size(), 1u);

  expect_rejected("", "shorter than the 8-byte header length");
  expect_rejected(good.substr(0, 5), "shorter than the 8-byte header length");
  expect_rejected(good.substr(0, 20), "truncated");                  // header cut short
  expect_rejected(good.substr(0, good.size() - 3), "past the end");  // data cut short
  expect_rejected(le64(uint64_t{1} << 40) + "{}", "implausible");
  expect_rejected(file_from("{not json", ""), "not valid JSON");
  expect_rejected(file_from("[1, 2]", ""), "not a JSON object");
  expect_rejected(file_from(R"({"w": {"dtype": "F32", "shape": [2]}})", good_data),
                  "needs dtype, shape and data_offsets");
  expect_rejected(
      file_from(R"({"w": {"dtype": "Q7", "shape": [2], "data_offsets": [0, 8]}})", good_data),
      "unsupported dtype 'Q7'");
  expect_rejected(
      file_from(R"({"w": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", good_data),
      "non-negative");
  expect_rejected(
      file_from(R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", good_data),
      "need 12 bytes");
  expect_rejected(
      file_from(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}})", good_data),
      "reversed");
  expect_rejected(
      file_from(R"({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}})", good_data),
      "past the end");
  expect_rejected(file_from(good_header, good_data + "junk"), "belong to none");
  // Two tensors sharing bytes, and a hole between two tensors.
  expect_rejected(file_from(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, )"
                            R"("b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})",
                            good_data),
                  "overlapping or unused");
  expect_rejected(file_from(R"({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, )"
                            R"("b": {"dtype": "F32", "shape": [0], "data_offsets": [8, 8]}})",
                            good_data),
                  "overlapping or unused");
  expect_rejected(file_from(R"({"__metadata__": {"step": 3}})", ""), "not a string");
}

TEST_F(IoTest, MissingFileIsAClearError) {
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [&] { load_safetensors(path("absent.safetensors")); }, "absent.safetensors"));
}

TEST_F(IoTest, FailedWriteLeavesTheExistingFileIntact) {
  const std::string target = path("keep.safetensors");
  save_safetensors(target, {{"x", torch::arange(4).to(torch::kFloat)}});
  const std::string before = read_file(target);
  // A dtype safetensors cannot store: the error comes before anything is written.
  EXPECT_THROW(save_safetensors(target, {{"c", torch::zeros({2}, torch::kComplexFloat)}}), Error);
  EXPECT_EQ(read_file(target), before);
  // No temporary files are left behind, and writing into a missing directory is an error.
  for (const auto& entry : fs::directory_iterator(dir_.root())) {
    EXPECT_EQ(entry.path().filename().string().find(".tmp."), std::string::npos) << entry.path();
  }
  EXPECT_THROW(save_safetensors(path("no/such/dir/x.safetensors"), {{"x", torch::ones(1)}}), Error);
}

TEST_F(IoTest, JsonRoundTripAndErrors) {
  nlohmann::json config = {
      {"hidden_size", 64}, {"rope_scaling", nullptr}, {"architectures", {"LlamaForCausalLM"}}};
  write_json(path("config.json"), config);
  EXPECT_EQ(read_json(path("config.json")), config);
  std::ofstream(path("bad.json")) << "{\"hidden_size\": ";
  EXPECT_TRUE(
      fivefold::testing::throws_error_containing([&] { read_json(path("bad.json")); }, "bad.json"));
}

// FNV-1a's published 64-bit values (the reference test suite of Fowler, Noll and Vo): "" ->
// cbf29ce484222325, "a" -> af63dc4c8601ec8c, "foobar" -> 85944171f73967e8; and a file longer than
// the 1 MiB piece it is read in hashes as one stream (a byte changed past the first piece shows).
TEST_F(IoTest, FileFingerprintIsTheSizeAndFnv1aOfTheBytes) {
  for (const auto& [text, hash] : std::vector<std::pair<std::string, std::string>>{
           {"", "cbf29ce484222325"}, {"a", "af63dc4c8601ec8c"}, {"foobar", "85944171f73967e8"}}) {
    std::ofstream(path("f.txt"), std::ios::binary) << text;
    EXPECT_EQ(file_fingerprint(path("f.txt")),
              std::to_string(text.size()) + " bytes, fnv1a " + hash);
  }
  std::string big((1 << 20) + 100, 'x');
  std::ofstream(path("big.txt"), std::ios::binary) << big;
  const std::string before = file_fingerprint(path("big.txt"));
  EXPECT_EQ(before.substr(0, before.find(',')), "1048676 bytes");
  big[(1 << 20) + 50] = 'y';
  std::ofstream(path("big.txt"), std::ios::binary) << big;
  EXPECT_NE(file_fingerprint(path("big.txt")), before);
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [&] { file_fingerprint(path("absent.txt")); }, "absent.txt"));
}

// The lock's heartbeat: the owner refreshes the file's time; another host's lock is taken over
// once it has gone unrefreshed for the stale time (measured against a file made beside it, so no
// clocks are compared), and refused while it is fresh. Shown to fail: without the heartbeat
// thread the held lock's time stayed an hour old; with the age check off, the fresh lock of
// another host was taken over.
TEST_F(IoTest, ALockHasAHeartbeatAndAnotherHostsStaleLockIsTakenOver) {
  const std::string dir = path("run");
  fs::create_directories(dir);
  auto age_of = [&](const std::string& file) {
    struct stat s {};
    EXPECT_EQ(::stat(file.c_str(), &s), 0);
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
               .count() -
           (static_cast<double>(s.st_mtim.tv_sec) + 1e-9 * static_cast<double>(s.st_mtim.tv_nsec));
  };
  auto set_age = [&](const std::string& file, int64_t seconds) {
    struct timespec times[2];
    times[0].tv_sec = times[1].tv_sec = ::time(nullptr) - seconds;
    times[0].tv_nsec = times[1].tv_nsec = 0;
    ASSERT_EQ(::utimensat(AT_FDCWD, file.c_str(), times, 0), 0);
  };
  {
    DirectoryLock lock(dir, /*refresh_seconds=*/0.05);
    set_age(dir + "/.lock", 3600);
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    EXPECT_LT(age_of(dir + "/.lock"), 5.0);  // refreshed since
  }
  EXPECT_FALSE(fs::exists(dir + "/.lock"));
  // Another host's lock, refreshed 30 s ago: in use.
  std::ofstream(dir + "/.lock") << "4242 some-other-host\n";
  set_age(dir + "/.lock", 30);
  EXPECT_TRUE(fivefold::testing::throws_error_containing(
      [&] { DirectoryLock lock(dir); }, "in use by process 4242 on some-other-host"));
  EXPECT_TRUE(fs::exists(dir + "/.lock"));
  // Not refreshed for 10 minutes: its run is gone, and the lock is ours.
  set_age(dir + "/.lock", 600);
  {
    DirectoryLock lock(dir);
    EXPECT_EQ(read_file(dir + "/.lock"), std::to_string(::getpid()) + " " + host_name() + "\n");
  }
  EXPECT_FALSE(fs::exists(dir + "/.lock"));
  for (const auto& entry : fs::directory_iterator(dir)) ADD_FAILURE() << "left " << entry.path();
}
