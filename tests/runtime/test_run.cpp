// The training run (runtime/run.h) on chapter 03's step: exact resume (bit for bit, also after a
// run went past its last checkpoint), the output folder (metrics, checkpoints, `latest`,
// pruning, saves that fail), and bad input that must fail before anything is written.

#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>

#include "03_transformer/checkpoint.h"
#include "07_moe/moe.h"
#include "fivefold/error.h"
#include "fivefold/io.h"
#include "runtime/fast.h"
#include "runtime/layout.h"
#include "runtime/run.h"
#include "testing.h"

using namespace fivefold::ch03;
using namespace fivefold::runtime;
using fivefold::testing::ScratchDir;
using fivefold::testing::throws_error_containing;
namespace fs = std::filesystem;
namespace io = fivefold::io;

namespace {
RunConfig tiny(const std::string& out, int64_t steps) {
  RunConfig c;
  c.model.d_model = 32;
  c.model.n_layers = 2;
  c.model.n_heads = 4;
  c.model.n_kv_heads = 2;
  c.model.d_ff = 64;
  c.train.warmup_steps = 2;
  c.train.total_steps = 12;
  c.data.synthetic_examples = 300;
  c.seq_len = 16;
  c.batch = 4;
  c.micro_batches = 2;
  c.steps = steps;
  c.out_dir = out;
  c.save_every = 3;
  c.eval_every = 0;
  c.eval_batches = 2;
  c.peak_gflops = 100;  // no matmul timing in tests
  c.progress = false;
  return c;
}

// The deterministic fields of metrics.jsonl (timings differ from run to run).
std::vector<nlohmann::json> metrics(const std::string& out) {
  std::vector<nlohmann::json> records;
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto record = nlohmann::json::parse(line);
    for (const char* timing : {"step_time_s", "tokens_per_s", "mfu", "peak_memory_bytes"})
      record.erase(timing);
    records.push_back(record);
  }
  return records;
}

// While alive, no file of this process grows past `bytes` (RLIMIT_FSIZE): a write beyond fails
// with EFBIG, as one on a full disk fails with ENOSPC.
class FileSizeLimit {
 public:
  explicit FileSizeLimit(rlim_t bytes) {
    previous_signal_ = std::signal(SIGXFSZ, SIG_IGN);  // the write fails instead of the process
    getrlimit(RLIMIT_FSIZE, &previous_);
    rlimit limited = previous_;
    limited.rlim_cur = bytes;
    setrlimit(RLIMIT_FSIZE, &limited);
  }
  ~FileSizeLimit() {
    setrlimit(RLIMIT_FSIZE, &previous_);
    std::signal(SIGXFSZ, previous_signal_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit previous_{};
  void (*previous_signal_)(int) = nullptr;
};

// The names in a folder.
std::set<std::string> entries_of(const std::string& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  return names;
}

void expect_same_files(const std::string& a, const std::string& b, const std::string& file) {
  EXPECT_TRUE(io::read_file(a + "/" + file) == io::read_file(b + "/" + file)) << file << " differs";
}

// Every file under `dir` with its contents, to prove a failed command changed nothing.
std::map<std::string, std::string> snapshot(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) files[entry.path().string()] = io::read_file(entry.path());
  }
  return files;
}
}  // namespace

TEST(Trainer, ResumeContinuesBitForBit) {
  ScratchDir scratch("resume");
  const std::string straight = scratch.path("straight"), stopped = scratch.path("stopped");
  const RunResult whole = run_training(tiny(straight, 12));
  ASSERT_EQ(whole.losses.size(), 12u);

  // A run that went on past its step-6 checkpoint to step 8, then died before saving again.
  RunConfig first = tiny(stopped, 8);
  first.save_every = 6;
  run_training(first);
  fs::remove_all(stopped + "/step-00000008");
  io::write_file_atomic(stopped + "/latest", "step-00000006\n");

  const RunResult rest = run_training(tiny(stopped, 12), /*resume=*/true);
  EXPECT_EQ(rest.first_step, 6);
  ASSERT_EQ(rest.losses.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(rest.losses[i], whole.losses[6 + i]) << "step " << 7 + i;
  // Weights, AdamW moments and steps, RNG: the same bytes as the uninterrupted run's.
  for (const char* file : {"model.safetensors", "optimizer.safetensors", "rng.safetensors"})
    expect_same_files(straight + "/step-00000012", stopped + "/step-00000012", file);
  // The metrics read as one run: steps 7 and 8 of the dead run were replaced, not duplicated.
  EXPECT_EQ(metrics(stopped), metrics(straight));
}

// The matmul kernel is process-wide: a bf16 run must not leave its kernel to the next run in the
// same process (seen: `fivefold calibrate`, which trains several runs, had its next run's
// attention self-check fail, and an fp32 run after a bf16 one would have multiplied in bf16).
TEST(Trainer, ARunLeavesTheNextItsOwnPrecision) {
  RunConfig fp32 = tiny("", 3);
  const RunResult first = run_training(fp32);
  RunConfig bf16 = fp32;
  bf16.precision = "bf16";
  const RunResult rounded = run_training(bf16);
  const RunResult again = run_training(fp32);
  EXPECT_EQ(again.losses, first.losses);  // bit for bit: fp32 again
  EXPECT_NE(rounded.losses, first.losses);
}

TEST(Trainer, WritesMetricsAndKeepsTheNewestCheckpoints) {
  ScratchDir scratch("layout");
  const std::string out = scratch.path("run");
  RunConfig c = tiny(out, 12);
  c.eval_every = 6;
  c.keep_checkpoints = 2;
  const RunResult r = run_training(c);
  EXPECT_EQ(r.checkpoint, out + "/step-00000012");
  EXPECT_EQ(io::read_file(out + "/latest"), "step-00000012\n");
  EXPECT_EQ(entries_of(out),
            (std::set<std::string>{"latest", "metrics.jsonl", "step-00000009", "step-00000012"}));
  for (const char* file : {"config.json", "model.safetensors", "optimizer.safetensors",
                           "rng.safetensors", "trainer_state.json"})
    EXPECT_TRUE(fs::exists(out + "/step-00000009/" + file)) << file;
  EXPECT_EQ(io::read_json(out + "/step-00000009/trainer_state.json")["step"], 9);

  std::vector<nlohmann::json> train, eval;
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto record = nlohmann::json::parse(line);
    (record["kind"] == "train" ? train : eval).push_back(record);
  }
  ASSERT_EQ(train.size(), 12u);
  for (size_t i = 0; i < train.size(); ++i) {
    EXPECT_EQ(train[i]["step"], i + 1);
    EXPECT_EQ(train[i]["loss"].get<double>(), r.losses[i]);
    EXPECT_EQ(train[i]["tokens"], (i + 1) * 4 * 16);
    EXPECT_DOUBLE_EQ(train[i]["lr"].get<double>(), learning_rate(c.train, i));
    for (const char* key : {"grad_norm", "tokens_per_s", "mfu", "peak_memory_bytes"})
      EXPECT_GT(train[i][key], 0.0);
  }
  ASSERT_EQ(eval.size(), 2u);  // steps 6 and 12
  EXPECT_EQ(eval[1]["step"], 12);
  EXPECT_DOUBLE_EQ(eval[1]["eval_loss"].get<double>(), r.eval.loss);
  // The checkpoint is a model folder like any other.
  EXPECT_EQ(load_model(resolve_checkpoint(out))->config().d_model, 32);
}

// A save that fails (a full disk; here a file-size limit) leaves nothing of itself and `latest`
// on the checkpoint before, with a message that says so; a save that a killed process left half
// written is deleted by the next run in the folder (either would hold the space the next save
// needs: seen filling a 16 MB disk under mpirun).
TEST(Trainer, ASaveThatFailsLeavesTheLastCheckpointAndNothingOfItself) {
  ScratchDir scratch("full");
  const std::string out = scratch.path("run");
  run_training(tiny(out, 6));  // step-00000003 and step-00000006
  fs::create_directories(out + "/.step-00000005");
  io::write_file_atomic(out + "/.step-00000005/model.safetensors", "half");
  {
    const FileSizeLimit limit(16 * 1024);  // below the model's weights
    EXPECT_TRUE(throws_error_containing(
        [&] { run_training(tiny(out, 9), /*resume=*/true); },
        "step 9: checkpoint not saved: writing '" + out + "/.step-00000009/model.safetensors"))
        << "the save did not fail, or said nothing of it";
  }
  const std::set<std::string> kept{"latest", "metrics.jsonl", "step-00000003", "step-00000006"};
  EXPECT_EQ(entries_of(out), kept);
  EXPECT_EQ(io::read_file(out + "/latest"), "step-00000006\n");
  // With room again, the run goes on from the checkpoint that stayed.
  const RunResult rest = run_training(tiny(out, 9), /*resume=*/true);
  EXPECT_EQ(rest.first_step, 6);
  EXPECT_EQ(io::read_file(out + "/latest"), "step-00000009\n");
}

// An evaluation that fails stops the run after the step's checkpoint, which it names (seen: every
// DeepSeek run in bf16 threw in its first evaluation, which came before the save, so the run's
// last steps were lost with it). Here an attention kernel that throws outside training.
TEST(Trainer, AnEvaluationThatFailsLeavesTheStepsCheckpoint) {
  struct ThrowsInEvaluation : AttentionKernel {
    AttentionOutput compute(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& qp, const torch::Tensor& kp,
                            double scale) const override {
      if (!torch::GradMode::is_enabled()) TORCH_CHECK(false, "no evaluation here");
      return CausalAttentionKernel().attend(q, k, v, qp, kp, scale);
    }
  };
  ScratchDir scratch("eval");
  const std::string out = scratch.path("run");
  RunConfig c = tiny(out, 4);
  c.save_every = 0;
  c.fast = false;
  c.make_step = [](Transformer model, const TrainConfig& train) {
    model->set_attention_kernel(std::make_shared<ThrowsInEvaluation>());
    return std::make_unique<SingleProcessStep>(std::move(model), train);
  };
  EXPECT_TRUE(throws_error_containing(
      [&] { run_training(c); },
      "step 4: the evaluation failed: no evaluation here; the run stops (the last checkpoint is '" +
          out + "/step-00000004')"));
  EXPECT_EQ(io::read_file(out + "/latest"), "step-00000004\n");
  EXPECT_EQ(metrics(out).size(), 4u);  // the four steps' rows, no evaluation row
}

// The memory check counts what ZeRO-3 gathers: the whole model on every rank at the last step's
// evaluation, and AdamW's moments on the writer at a checkpoint. A model whose ZeRO-3 state on 4
// ranks takes 45% of this machine's free memory (16 bytes a parameter) passes without an output
// folder (16 + 4 x 4 = 32 bytes a parameter in all: 90%) and is refused with one (32 + 8 = 40:
// 112.5%); ZeRO-2 over the same ranks (7 bytes a parameter a rank: 79%) gathers no whole copy.
TEST(Trainer, TheMemoryCheckCountsWhatZeRO3GathersOnEveryRank) {
  const int64_t available = available_memory();
  if (available == 0) GTEST_SKIP() << "no MemAvailable in /proc/meminfo";
  RunConfig c = tiny("", 1);
  c.model.d_model = 1024;
  c.model.n_heads = c.model.n_kv_heads = 16;
  c.model.d_ff = 2816;
  c.model.n_layers = 1;
  const int64_t per_layer = fivefold::ch07::count_parameters(c.model).total;  // about 12.6M
  c.model.n_layers = std::max<int64_t>(1, available * 45 / 1600 / per_layer);
  fivefold::ch15::Layout layout;
  layout.dp = 4;
  layout.zero = 3;
  EXPECT_NO_THROW(check_fits_in_memory(c, layout, 4, 4));
  c.out_dir = "run";
  EXPECT_TRUE(throws_error_containing([&] { check_fits_in_memory(c, layout, 4, 4); },
                                      "each checkpoint gathers the whole model on every rank "
                                      "and AdamW's moments on the writer"));
  layout.zero = 2;
  EXPECT_NO_THROW(check_fits_in_memory(c, layout, 4, 4));
}

// A metrics row that cannot be written stops the run (seen: on a full disk a run trained 360
// steps on after its 240th row, and the record kept one row cut in half).
TEST(Trainer, AMetricsRowThatCannotBeWrittenStopsTheRun) {
  ScratchDir scratch("metrics");
  const std::string out = scratch.path("run");
  RunConfig c = tiny(out, 12);
  c.save_every = 0;
  std::string message;
  {
    const FileSizeLimit limit(1024);  // a few rows
    try {
      run_training(c);
    } catch (const fivefold::Error& e) {
      message = e.what();
    }
  }
  EXPECT_NE(message.find(": writing '" + out +
                         "/metrics.jsonl' failed: File too large; the run "
                         "stops (the last checkpoint stays 'none')"),
            std::string::npos)
      << "the run did not stop, or said: " << message;
  EXPECT_EQ(message.rfind("step ", 0), 0u) << message;
  EXPECT_FALSE(fs::exists(out + "/latest"));
}

// A step whose whole model is built apart from the model it trains, as chapter 10's
// ModelPartStep (tp, pp) builds it: the weights copied over at each full_model(). `whole` is the
// test's, so that it outlives the run.
class SeparateWholeModelStep : public SingleProcessStep {
 public:
  SeparateWholeModelStep(Transformer model, const TrainConfig& config, Transformer& whole)
      : SingleProcessStep(std::move(model), config), whole_(whole) {}
  Transformer& full_model() override {
    Transformer& trained = SingleProcessStep::full_model();
    if (!whole_) whole_ = build_model(trained->config());
    torch::NoGradGuard no_grad;
    auto from = trained->named_parameters();
    for (auto& item : whole_->named_parameters()) item.value().copy_(from[item.key()]);
    return whole_;
  }

 private:
  Transformer& whole_;
};

// The run evaluates a whole model on the kernels it trains with: the fast paths go into a whole
// model built apart too (they did not: a pp run's evaluation at 16,384 tokens kept the lesson's
// s x s probabilities and was killed for memory), and its loss is the trained model's.
// In bf16 the fast paths go in after the bf16 kernel is set: their check of the tiled kernel
// against the lesson's must not multiply in bf16 (it did, and refused: "differ by 0.0064").
TEST(Trainer, EvaluatesTheWholeModelOnTheKernelsItTrainsWith) {
  for (const char* precision : {"fp32", "bf16"}) {
    RunConfig c = tiny("", 2);
    c.precision = precision;
    const RunResult same = run_training(c);
    Transformer whole{nullptr};
    c.make_step = [&whole](Transformer model, const TrainConfig& train) {
      return std::make_unique<SeparateWholeModelStep>(std::move(model), train, whole);
    };
    const RunResult apart = run_training(c);
    ASSERT_TRUE(whole);
    for (int64_t layer = 0; layer < c.model.n_layers; ++layer) {
      const AttentionKernel* kernel = whole->block(layer).self_attn->kernel.get();
      EXPECT_NE(dynamic_cast<const fivefold::runtime::TiledCausalAttentionKernel*>(kernel), nullptr)
          << precision << ": layer " << layer << " of the whole model evaluates on the lesson's "
          << "kernel";
    }
    EXPECT_EQ(apart.eval.loss, same.eval.loss) << precision;
  }
}

TEST(Trainer, OptimizerStateRoundTripsByName) {
  ScratchDir scratch("adam");
  RunConfig c = tiny("", 3);
  run_training(c);  // just to be sure a run without an output folder writes nothing
  Transformer model(c.model);
  auto optimizer = make_optimizer(model, c.train);
  const Batch batch = BatchSampler(TokenDataset(std::vector<int64_t>(100, 7)), 8, 2, 0).batch(0);
  train_step(model, *optimizer, c.train, {batch}, 0);
  save_optimizer(scratch.path("adam.safetensors"), model, *optimizer);
  const auto saved = io::load_safetensors(scratch.path("adam.safetensors"));
  EXPECT_EQ(saved.at("model.layers.0.self_attn.k_proj.weight.exp_avg").sizes(),
            model->block(0).self_attn->as<AttentionImpl>()->k_proj->weight.sizes());
  EXPECT_EQ(saved.at("lm_head.weight.step").item<int64_t>(), 1);

  // A different model's state (other shapes) is refused by name.
  RunConfig wider = c;
  wider.model.d_model = 64;
  Transformer other(wider.model);
  auto other_optimizer = make_optimizer(other, wider.train);
  EXPECT_TRUE(throws_error_containing(
      [&] { load_optimizer(scratch.path("adam.safetensors"), other, *other_optimizer); },
      "has shape"));
}

TEST(Trainer, RefusesBadInputBeforeWritingAnything) {
  ScratchDir scratch("bad");
  const std::string out = scratch.path("out");
  auto refused = [&](RunConfig c, const std::string& fragment, bool resume = false) {
    EXPECT_TRUE(throws_error_containing([&] { run_training(c, resume); }, fragment)) << fragment;
  };
  RunConfig missing = tiny(out, 3);
  missing.data.path = scratch.path("absent.txt");
  refused(missing, "absent.txt");
  io::write_file_atomic(scratch.path("empty.txt"), "");
  RunConfig empty = tiny(out, 3);
  empty.data.path = scratch.path("empty.txt");
  refused(empty, "empty");
  io::write_file_atomic(scratch.path("short.txt"), "only a few bytes");
  RunConfig short_file = tiny(out, 3);
  short_file.data.path = scratch.path("short.txt");
  refused(short_file, "too few");
  TokenDataset::write_bin_file(scratch.path("big.bin"), std::vector<int64_t>(400, 300));
  RunConfig big_ids = tiny(out, 3);
  big_ids.data.path = scratch.path("big.bin");
  refused(big_ids, "token id 300");
  RunConfig heads = tiny(out, 3);
  heads.model.n_heads = 5;
  refused(heads, "does not divide d_model");
  RunConfig accumulation = tiny(out, 3);
  accumulation.micro_batches = 3;
  refused(accumulation, "must split into 1 data-parallel ranks x 3 micro-batches");
  refused(tiny(out, 3), "'" + out + "'", /*resume=*/true);  // nothing to resume
  // A run stopped before its first checkpoint (its settings written, no `latest`).
  fs::create_directories(scratch.path("early"));
  io::write_file_atomic(scratch.path("early") + "/settings.toml", "steps = 3\n");
  refused(tiny(scratch.path("early"), 3),
          "holds a training run that stopped before its first checkpoint (no 'latest'): nothing "
          "to resume or load",
          /*resume=*/true);
  EXPECT_FALSE(fs::exists(out)) << "a refused run created its output folder";

  run_training(tiny(out, 3));
  const auto before = snapshot(out);
  refused(tiny(out, 6), "already holds a training run");
  refused(tiny(out, 3), "nothing to do", /*resume=*/true);
  // A corrupt checkpoint (truncated weights), then one whose shapes do not match its config.
  const std::string weights = out + "/step-00000003/model.safetensors";
  const std::string good = io::read_file(weights);
  io::write_file_atomic(weights, good.substr(0, good.size() / 2));
  const auto truncated = snapshot(out);
  refused(tiny(out, 6), "model.safetensors", /*resume=*/true);
  EXPECT_TRUE(snapshot(out) == truncated) << "a refused resume changed files";
  io::write_file_atomic(weights, good);
  auto config = io::read_json(out + "/step-00000003/config.json");
  config["intermediate_size"] = 48;
  io::write_json(out + "/step-00000003/config.json", config);
  refused(tiny(out, 6), "has shape", /*resume=*/true);
  config["intermediate_size"] = 64;
  io::write_json(out + "/step-00000003/config.json", config);
  // A training state without its step, and a generator file without the generator: each error
  // names the file.
  const std::string state_file = out + "/step-00000003/trainer_state.json";
  const auto state = io::read_json(state_file);
  auto no_step = state;
  no_step.erase("step");
  io::write_json(state_file, no_step);
  refused(tiny(out, 6), "trainer_state.json' is not a training state", /*resume=*/true);
  io::write_json(state_file, state);
  const std::string rng_file = out + "/step-00000003/rng.safetensors";
  const std::string rng = io::read_file(rng_file);
  io::save_safetensors(rng_file, {{"other", torch::zeros({1})}});
  refused(tiny(out, 6), "rng.safetensors' has no 'cpu' generator state", /*resume=*/true);
  io::write_file_atomic(rng_file, rng);
  // A `latest` that names no checkpoint (a folder deleted by hand): the newest one there is named.
  io::write_file_atomic(out + "/latest", "step-00000099\n");
  refused(tiny(out, 6),
          "names 'step-00000099', which is not a checkpoint folder; the newest checkpoint there "
          "is 'step-00000003'",
          /*resume=*/true);
  io::write_file_atomic(out + "/latest", "step-00000003\n");
  // Data that names a folder.
  RunConfig folder = tiny(scratch.path("elsewhere"), 3);
  folder.data.path = scratch.root();
  refused(folder, "is a folder, not a file");
  // An output folder that is a checkpoint folder.
  refused(tiny(out + "/step-00000003", 6), "is a checkpoint folder");
  EXPECT_TRUE(snapshot(out) == before) << "a refused command changed files";
}
