// The training run: the loop around a chapter's step, its metrics, evaluations and checkpoints.

#include "runtime/run.h"

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <sstream>

#include "02_flops_6np/flops.h"
#include "03_transformer/checkpoint.h"
#include "14_memory/precision.h"
#include "14_memory/recompute.h"
#include "fivefold/consolidate.h"
#include "fivefold/error.h"
#include "fivefold/io.h"
#include "fivefold/log.h"
#include "fivefold/memory.h"
#include "fivefold/progress.h"
#include "fivefold/runtime.h"
#include "fivefold/timer.h"
#include "fivefold/trace.h"
#include "runtime/fast.h"
#include "runtime/settings.h"
#include "evaluation.h"

namespace fs = std::filesystem;

namespace fivefold::runtime {

using namespace fivefold::ch03;

torch::Tensor rng_state() { return at::detail::getDefaultCPUGenerator().get_state(); }

void set_rng_state(const torch::Tensor& state) {
  auto generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  generator.set_state(state);
}

std::string resolve_checkpoint(const std::string& path) {
  if (fs::exists(fs::path(path) / "config.json")) return path;
  const fs::path latest = fs::path(path) / "latest";
  FIVEFOLD_CHECK(fs::exists(latest) || !fs::exists(fs::path(path) / "settings.toml"), "'", path,
                 "' holds a training run that stopped before its first checkpoint (no 'latest'): "
                 "nothing to resume or load; train it again from the start");
  FIVEFOLD_CHECK(fs::exists(latest), "'", path,
                 "' is neither a checkpoint folder (no config.json) nor a training output folder "
                 "(no 'latest')");
  std::string name = io::read_file(latest.string());
  name.erase(name.find_last_not_of(" \n\r\t") + 1);
  const fs::path dir = fs::path(path) / name;
  if (fs::exists(dir / "config.json")) return dir.string();
  // The newest checkpoint folder there is, for the user to point `latest` at.
  std::string newest;
  for (const auto& entry : fs::directory_iterator(path)) {
    const std::string folder = entry.path().filename().string();
    if (folder.rfind("step-", 0) == 0 && fs::exists(entry.path() / "config.json"))
      newest = std::max(newest, folder);
  }
  throw Error("'" + latest.string() + "' names '" + name + "', which is not a checkpoint folder" +
              (newest.empty()
                   ? std::string(" (and the folder holds none)")
                   : "; the newest checkpoint there is '" + newest + "': write its name into '" +
                         latest.string() + "' to resume from it"));
}

namespace {

// The checkpoint OUT/latest names, or "none" (for messages).
std::string latest_checkpoint(const std::string& out_dir) {
  try {
    return resolve_checkpoint(out_dir);
  } catch (const Error&) {
    return "none";
  }
}

// Writes OUT/step-NNNNNNNN as a whole: into a temporary folder, renamed when complete; then
// `latest` points at it and folders beyond keep_checkpoints are deleted. Every rank calls it (the
// step may gather what it holds in shards); the writer writes.
std::string save_checkpoint(const RunConfig& c, TrainingStep& trainer, int64_t next_step) {
  Transformer& model = trainer.full_model();
  const io::TensorMap optimizer = trainer.optimizer_state_for_writer();  // the writer's alone
  char name[32];
  std::snprintf(name, sizeof(name), "step-%08lld", static_cast<long long>(next_step));
  const fs::path out(c.out_dir), final_dir = out / name, temp = out / (std::string(".") + name);
  if (!c.placement.writer) return final_dir.string();
  // A checkpoint is only written whole and finite: `latest` must always name one that resumes,
  // and pruning below must never leave only a poisoned one.
  auto check_finite = [&](const std::string& what, const torch::Tensor& t) {
    FIVEFOLD_CHECK(t.isfinite().all().item<bool>(), "step ", next_step, ": ", what,
                   " holds non-finite values: not saved (the last checkpoint stays '",
                   latest_checkpoint(c.out_dir), "')");
  };
  for (const auto& item : model->named_parameters()) check_finite(item.key(), item.value());
  for (const auto& [key, tensor] : optimizer) check_finite("optimizer state " + key, tensor);
  try {
    fs::remove_all(temp);
    fs::create_directories(temp);
    save_model(temp.string(), model);
    io::save_safetensors((temp / "optimizer.safetensors").string(), optimizer,
                         {{"format", "fivefold-adamw"}});
    io::save_safetensors((temp / "rng.safetensors").string(), {{"cpu", rng_state()}});
    io::write_json((temp / "trainer_state.json").string(),
                   {{"step", next_step}, {"run", run_to_json(c)}});
    io::replace_directory(temp.string(), final_dir.string());  // an older one stays until then
  } catch (const std::exception& e) {
    // A full disk, say: the part written goes (it would hold the space the next save needs).
    std::error_code ignored;
    fs::remove_all(temp, ignored);
    throw Error(detail::concat("step ", next_step, ": checkpoint not saved: ", e.what(),
                               " (the last checkpoint stays '", latest_checkpoint(c.out_dir),
                               "')"));
  }
  io::write_file_atomic((out / "latest").string(), std::string(name) + "\n");
  std::vector<fs::path> folders;
  for (const auto& entry : fs::directory_iterator(out)) {
    const std::string file = entry.path().filename().string();
    if (entry.is_directory() && file.rfind("step-", 0) == 0) folders.push_back(entry.path());
  }
  std::sort(folders.begin(), folders.end());
  for (size_t i = 0; i + static_cast<size_t>(c.keep_checkpoints) < folders.size(); ++i) {
    if (folders[i] != final_dir) fs::remove_all(folders[i]);
  }
  return final_dir.string();
}

// Deletes the staging folders (.step-NNNNNNNN) of saves that never completed: a process killed
// while it wrote one leaves it behind. Called by the writer once it holds the folder's lock, so no
// other run is writing one.
void remove_unfinished_checkpoints(const std::string& out_dir) {
  for (const auto& entry : fs::directory_iterator(out_dir)) {
    const std::string file = entry.path().filename().string();
    if (!entry.is_directory() || file.rfind(".step-", 0) != 0) continue;
    fs::remove_all(entry.path());
    log0() << "removed '" << entry.path().string() << "', a checkpoint whose save did not complete";
  }
}

// Appends one record to metrics.jsonl (when the run writes one). A row that cannot be written (a
// full disk) stops the run: it would otherwise train on with its record cut short.
void append_metrics(std::ofstream& metrics, const RunConfig& c, const nlohmann::json& record) {
  if (!metrics.is_open()) return;
  metrics << record.dump() << "\n" << std::flush;  // NaN is null
  const int error = errno;
  FIVEFOLD_CHECK(metrics.good(), "step ", record.value("step", int64_t{0}), ": writing '",
                 c.out_dir, "/metrics.jsonl' failed: ", std::strerror(error),
                 "; the run stops (the last checkpoint stays '", latest_checkpoint(c.out_dir),
                 "')");
}

// On resume, drops metrics written after the checkpoint (a run may have gone on past its last
// save before it stopped), so the file reads as one uninterrupted run.
void truncate_metrics(const std::string& path, int64_t first_step) {
  if (!fs::exists(path)) return;
  std::istringstream lines(io::read_file(path));
  std::string line, kept;
  while (std::getline(lines, line)) {
    if (line.empty()) continue;
    const auto record = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (record.is_object() && record.value("step", int64_t{0}) <= first_step) kept += line + "\n";
  }
  io::write_file_atomic(path, kept);
}

}  // namespace

ch14::RecomputeConfig recompute_config(const RunConfig& run) {
  return {ch14::parse_recompute(run.recompute), run.recompute_every, run.recompute_stages};
}

namespace {

// The recomputation a run trains with, in words.
std::string recompute_text(const RunConfig& c) {
  std::string text = c.recompute;
  if (c.recompute == "full" && c.recompute_every > 1)
    text += ", every " + std::to_string(c.recompute_every) + " blocks";
  if (c.recompute != "none" && c.recompute_stages == 1) text += ", pipeline stage 0 only";
  if (c.recompute != "none" && c.recompute_stages > 1)
    text += ", pipeline stages 0-" + std::to_string(c.recompute_stages - 1) + " only";
  return text;
}

// " (the run trained <how> <before> until now)" when a resumed run changes a setting, else "".
std::string changed(bool resume, const std::string& now, const std::string& before,
                    const char* how) {
  if (!resume || now == before) return "";
  return std::string(" (the run trained ") + how + " " + before + " until now)";
}

}  // namespace

namespace {

// Puts a process-wide matmul kernel back when it goes out of scope.
struct RestoreMatmulKernel {
  std::shared_ptr<const MatmulKernel> previous;
  ~RestoreMatmulKernel() { set_matmul_kernel(previous); }
};

}  // namespace

namespace {

// Where a run starts: the settings it trains with (a resumed run's own, and from `requested` only
// what does not change what it computes: settings.h) and, when it resumes, from where.
struct Start {
  RunConfig settings;
  int64_t first_step = 0;
  std::string checkpoint;    // the checkpoint folder resumed from
  std::string trained_with;  // the resumed run's recomputation so far
  std::string trained_in;    // and its precision
};

Start resolve_start(const RunConfig& requested, bool resume) {
  Start from;
  from.settings = requested;
  RunConfig& c = from.settings;
  if (!c.out_dir.empty()) {
    // A run's folder holds checkpoint folders; it must not be one (a later pruning of the
    // enclosing run would delete this one with it).
    for (const char* file : {"trainer_state.json", "config.json", "model.safetensors"}) {
      FIVEFOLD_CHECK(!fs::exists(fs::path(c.out_dir) / file), "'", c.out_dir,
                     "' is a checkpoint folder (it holds ", file,
                     "): give the run's output folder, which holds 'latest'");
    }
  }
  if (resume) {
    FIVEFOLD_CHECK(!requested.out_dir.empty(), "resume: no output folder given");
    from.checkpoint = resolve_checkpoint(requested.out_dir);
    const RunState state = load_run_state(from.checkpoint);
    from.trained_with = recompute_text(state.run);
    from.trained_in = state.run.precision;
    // The run's own settings; only those that do not change what it computes come from
    // `requested` (how long, how often to evaluate and save, how it is laid out): settings.h.
    c = resume_with(state.run, requested);
    from.first_step = state.step;
    FIVEFOLD_CHECK(from.first_step < c.steps, "resume: '", from.checkpoint, "' is at step ",
                   from.first_step, ", nothing to do for --steps ", c.steps);
  } else if (!c.out_dir.empty()) {
    FIVEFOLD_CHECK(!fs::exists(fs::path(c.out_dir) / "latest"), "'", c.out_dir,
                   "' already holds a training run: resume it or choose another output folder");
  }
  c.validate();
  return from;
}

// Chapter 14's precision and recomputation for the model `trainer` trains, saying what changed
// since the run resumed (`from`).
void set_precision_and_recompute(const RunConfig& c, TrainingStep& trainer, bool resume,
                                 const Start& from) {
  // Chapter 14: the products in bf16, after a look at whether this CPU computes bf16 faster.
  const std::string precision_change = changed(resume, c.precision, from.trained_in, "in");
  if (ch14::parse_precision(c.precision) == ch14::Precision::Bf16) {
    // The model's own MLP product on one micro-batch of this rank.
    const int64_t rows =
        std::max<int64_t>(1, c.batch * c.seq_len / (c.placement.data_ranks * c.micro_batches));
    const ch14::ProductSpeed speed =
        ch14::measure_product_speed(rows, c.model.d_model, c.model.d_ff);
    log0() << "precision: bf16 products (the MLP's [" << rows << ", " << c.model.d_model << "] x ["
           << c.model.d_model << ", " << c.model.d_ff << "]: " << static_cast<int>(speed.bf16)
           << " GFLOP/s in bf16, " << static_cast<int>(speed.fp32)
           << " in fp32); weights and gradients in bf16, fp32 master weights and AdamW"
           << precision_change;
    if (speed.bf16 < speed.fp32) {
      log0() << "warning: this model's products are " << speed.fp32 / speed.bf16
             << "x slower in bf16 than in fp32 here (too small to pay for the roundings, or no "
                "AVX-512 BF16 or AMX on this CPU): --precision fp32 trains faster";
    }
    ch14::use_precision(ch14::Precision::Bf16, nullptr);
  } else if (!precision_change.empty()) {
    log0() << "precision: fp32" << precision_change;
  }
  // Chapter 14, after every kernel is in place: selective recomputation wraps the one installed.
  ch14::apply_recompute(trainer.model(), recompute_config(c).for_stage(c.placement.pipeline_stage));
  const std::string recompute_change =
      changed(resume, recompute_text(c), from.trained_with, "with");
  if (c.recompute != "none" || !recompute_change.empty())
    log0() << "activation recomputation: " << recompute_text(c) << recompute_change;
}

// The output folder, which the writer owns while the run lasts: checked, locked (`lock`), its
// metrics file opened (`metrics`, cut after `first_step` when resuming) and the settings written.
// Only the writer can see its file system: every process refuses with its verdict, together.
void open_run_folder(const RunConfig& c, bool resume, int64_t first_step, std::ofstream& metrics,
                     std::unique_ptr<io::DirectoryLock>& lock) {
  const Placement& place = c.placement;
  std::string refused;  // what the writer found wrong with the folder
  if (!c.out_dir.empty() && place.writer) {
    try {
      std::error_code error;
      FIVEFOLD_CHECK(!fs::exists(c.out_dir, error) || fs::is_directory(c.out_dir, error), "'",
                     c.out_dir, "' is a file, not a folder: give --out a folder");
      fs::create_directories(c.out_dir, error);
      FIVEFOLD_CHECK(!error, "cannot make the output folder '", c.out_dir, "': ", error.message());
      lock = std::make_unique<io::DirectoryLock>(c.out_dir);
      FIVEFOLD_CHECK(resume || !fs::exists(fs::path(c.out_dir) / "latest"), "'", c.out_dir,
                     "' already holds a training run: resume it or choose another output folder");
      remove_unfinished_checkpoints(c.out_dir);
      const std::string path = c.out_dir + "/metrics.jsonl";
      if (resume) truncate_metrics(path, first_step);
      metrics.open(path, resume ? std::ios::app : std::ios::trunc);
      FIVEFOLD_CHECK(metrics.good(), "cannot write '", path, "'");
      if (!c.settings_toml.empty())
        io::write_file_atomic(c.out_dir + "/settings.toml", c.settings_toml);
    } catch (const std::exception& e) {
      refused = e.what();
    }
  }
  if (place.world) refused = first_said(refused, *place.world);  // the writer's, on every rank
  FIVEFOLD_CHECK(refused.empty(), refused);
}

}  // namespace

RunResult run_training(const RunConfig& requested, bool resume) {
  const Start from = resolve_start(requested, resume);
  RunConfig c = from.settings;
  const std::string& start = from.checkpoint;
  RunResult result;
  result.first_step = from.first_step;
  auto [train_data, val_data] = load_datasets(c.data, c.seq_len);
  const int64_t vocab = resume ? config_from_json(io::read_json(start + "/config.json")).vocab_size
                               : c.model.vocab_size;
  FIVEFOLD_CHECK(std::max(train_data.max_token(), val_data.max_token()) < vocab,
                 "the data has token id ", std::max(train_data.max_token(), val_data.max_token()),
                 " but the model's vocabulary has ", vocab, " tokens");

  // Inputs are good: build the model (from the checkpoint when resuming).
  const Placement& place = c.placement;
  const ModelBuilder build = requested.build_model ? requested.build_model : build_model;
  Transformer model = resume ? load_model(start, build) : build(c.model, ModelPart{});
  c.model = model->config();
  const BatchSampler train_batches(train_data, c.seq_len, c.batch, c.data.seed);
  const BatchSampler eval_batches(val_data, c.seq_len, c.batch, c.data.seed + 1);
  const int64_t tokens_per_step = c.batch * c.seq_len;
  double flops_per_token = ch02::training_flops_per_token(c.model.shape(), c.seq_len);
  if (!c.model.extensions.is_null()) {
    // A later chapter's architecture (MLA, MoE), which chapter 02's formula does not describe:
    // count what one forward of a batch executes instead; training is 3x forward (chapter 02).
    torch::NoGradGuard no_grad;
    ch02::FlopCounter counter;
    loss_of(model, train_batches.batch(0));
    flops_per_token = 3 * counter.flops() / static_cast<double>(tokens_per_step);
  }
  int64_t parameters = 0;
  for (const auto& p : model->parameters()) parameters += p.numel();

  // The training step owns the model from here (a sharded step keeps only its part).
  const StepFactory make_step =
      requested.make_step ? requested.make_step : [](Transformer m, const TrainConfig& t) {
        return std::unique_ptr<TrainingStep>(new SingleProcessStep(std::move(m), t));
      };
  // fast.h: the same mathematics, fewer passes; in the model the step trains, which a parallel
  // step builds itself (its tp slice, its stage, its experts).
  if (c.fast) c.train.make_adamw = fused_adamw;
  // Chapter 14: in bf16 the step keeps the parameters and gradients in bf16 and AdamW fp32
  // master weights (taken from the model's fp32 weights here, a checkpoint's when resuming).
  const bool bf16 = ch14::parse_precision(c.precision) == ch14::Precision::Bf16;
  c.train.param_dtype = bf16 ? torch::kBFloat16 : torch::kFloat;
  std::unique_ptr<TrainingStep> trainer = make_step(model, c.train);
  // The matmul kernel is process-wide: each run starts from none (a run before may have left its
  // oneDNN or bf16 kernel), installs its own, and puts back what it found when it returns.
  const RestoreMatmulKernel restore{set_matmul_kernel(nullptr)};
  if (c.fast) install_fast_paths(trainer->model());
  set_precision_and_recompute(c, *trainer, resume, from);
  if (resume) {
    const std::string path = start + "/optimizer.safetensors";
    trainer->load_optimizer_state(io::load_safetensors(path), path);
    const std::string rng = start + "/rng.safetensors";
    const io::TensorMap rng_tensors = io::load_safetensors(rng);
    FIVEFOLD_CHECK(rng_tensors.count("cpu"), "'", rng, "' has no 'cpu' generator state");
    set_rng_state(rng_tensors.at("cpu"));
  } else {
    torch::manual_seed(c.model.seed);  // anything random a later chapter adds starts seeded
  }

  std::ofstream metrics;
  std::unique_ptr<io::DirectoryLock> lock;  // the run owns its folder until it ends
  open_run_folder(c, resume, result.first_step, metrics, lock);
  for (RunObserver* o : c.observers) o->started(*trainer, result.first_step);
  // MFU: the model's FLOPs against the peak of every process doing the work.
  // The peak is the product the step multiplies with (oneDNN's with the fast paths).
  const double peak = (c.peak_gflops > 0 ? c.peak_gflops : matmul_peak_gflops(1024)) * 1e9 *
                      static_cast<double>(place.processes);
  if (c.steps > c.train.total_steps) {
    log0() << "the learning rate's cosine decay ends at step " << c.train.total_steps
           << " (the run's schedule); steps after it run at min_lr " << c.train.min_lr;
  }
  log0() << "training " << c.steps - result.first_step << " steps from step " << result.first_step
         << ": " << parameters << " parameters, " << tokens_per_step << " tokens a step, "
         << flops_per_token / 1e6 << " MFLOP a token, matmul peak " << peak / 1e9 << " GFLOP/s"
         << (place.processes > 1 ? " (all processes)" : "")
         << (malloc_on_huge_pages() ? "; malloc on huge pages" : "");

  ProgressBar bar(c.steps - result.first_step, "train", c.progress && place.writer);
  nlohmann::json latest_extra;  // what after_step reported last (its numbers join the eval lines)
  auto evaluate = [&](int64_t done) {
    Transformer& model = trainer->full_model();
    // The whole model of a step that trains a part (tp, pp: chapter 10's ModelPartStep) is built
    // apart from the one trained: it evaluates on the same kernels, not the lesson's s² softmax
    // (seen: pp 2 at 16,384 tokens killed by the OOM killer in its first evaluation).
    if (c.fast) install_fast_paths(model);
    result.eval = shared_loss(model, eval_batches, c.eval_batches, place.world);
    nlohmann::json record = {{"kind", "eval"},
                             {"step", done},
                             {"eval_loss", result.eval.loss},
                             {"eval_perplexity", result.eval.perplexity}};
    std::ostringstream line;
    line << "step " << done << ": held-out loss " << result.eval.loss << ", perplexity "
         << result.eval.perplexity;
    if (c.exact_match_examples > 0) {
      result.exact = shared_exact_match(model, c.data.seed, c.exact_match_examples, place.world);
      record["exact_match"] = result.exact.accuracy();
      line << ", exact match " << result.exact.accuracy();
      for (const auto& [task, n] : result.exact.total) {
        record["exact_match_" + task] = result.exact.accuracy(task);
        line << " (" << task << " " << result.exact.accuracy(task) << ")";
      }
    }
    for (const auto& [key, value] : latest_extra.items())
      if (value.is_number()) line << ", " << key << " " << value.get<double>();
    append_metrics(metrics, c, record);
    bar.clear();
    log0() << line.str();
  };

  for (int64_t step = result.first_step; step < c.steps; ++step) {
    // This rank's rows of the global batch, in micro-batches of equal rows (accumulation).
    const Batch local = train_batches.batch(step, static_cast<int>(place.data_rank),
                                            static_cast<int>(place.data_ranks));
    std::vector<Batch> micro;
    const auto inputs = local.inputs.chunk(c.micro_batches),
               targets = local.targets.chunk(c.micro_batches);
    for (int64_t i = 0; i < c.micro_batches; ++i) micro.push_back({inputs[i], targets[i]});

    for (RunObserver* o : c.observers) o->step_begins(step);
    Timer timer;
    const StepResult r = [&] {
      trace::Span span("step " + std::to_string(step + 1), "train");  // --trace's timeline
      return trainer->step(micro, step);
    }();
    const double seconds = timer.seconds();
    for (RunObserver* o : c.observers) o->step_ended(step, *trainer, r);
    const double tokens_per_s = static_cast<double>(tokens_per_step) / seconds;
    const double mfu = ch02::model_flops_utilization(tokens_per_s, flops_per_token, peak);
    result.losses.push_back(r.loss);
    nlohmann::json record = {{"kind", "train"},
                             {"step", step + 1},
                             {"loss", r.loss},
                             {"lr", r.lr},
                             {"grad_norm", r.grad_norm},
                             {"tokens", (step + 1) * tokens_per_step},
                             {"step_time_s", seconds},
                             {"tokens_per_s", tokens_per_s},
                             {"mfu", mfu},
                             {"peak_memory_bytes", peak_resident_bytes()}};
    if (requested.after_step) {
      latest_extra = requested.after_step(trainer->model());
      record.update(latest_extra);
    }
    append_metrics(metrics, c, record);
    // A non-finite norm means the step applied no update (StepResult); every rank sees the same
    // loss and norm, so every rank stops here, and nothing of this step is saved.
    if (!std::isfinite(r.loss) || !std::isfinite(r.grad_norm)) {
      bar.clear();
      throw Error("step " + std::to_string(step + 1) + ": the loss is " + std::to_string(r.loss) +
                  " and the gradient norm " + std::to_string(r.grad_norm) +
                  ": not finite, so the run stops" +
                  (std::isfinite(r.grad_norm) ? "" : " without applying the update") +
                  (c.out_dir.empty()
                       ? std::string()
                       : "; the last checkpoint is '" + latest_checkpoint(c.out_dir) + "'") +
                  " (a lower --lr may help)");
    }
    char status[160];
    std::snprintf(status, sizeof(status),
                  "loss %.4f | lr %.2e | norm %.3f | %.0f tok/s | MFU %.2f%% | peak %.0f MB",
                  r.loss, r.lr, r.grad_norm, tokens_per_s, 100 * mfu,
                  static_cast<double>(peak_resident_bytes()) / 1e6);
    bar.update(step + 1 - result.first_step, status);

    // The checkpoint first: an evaluation that fails never takes the step's checkpoint with it.
    const int64_t done = step + 1;
    const bool last = done == c.steps;
    if (!c.out_dir.empty() && (last || (c.save_every > 0 && done % c.save_every == 0))) {
      trace::Span span("checkpoint", "checkpoint");
      result.checkpoint = save_checkpoint(c, *trainer, done);
      for (RunObserver* o : c.observers) o->gathered_whole_model();
    }
    if (last || (c.eval_every > 0 && done % c.eval_every == 0)) {
      trace::Span span("evaluate", "eval");
      try {
        evaluate(done);
      } catch (const c10::Error& e) {  // LibTorch's, without its backtrace; ours say what they are
        throw Error("step " + std::to_string(done) +
                    ": the evaluation failed: " + e.what_without_backtrace() + "; the run stops" +
                    (c.out_dir.empty()
                         ? std::string()
                         : " (the last checkpoint is '" + latest_checkpoint(c.out_dir) + "')"));
      }
      for (RunObserver* o : c.observers) o->gathered_whole_model();
    }
  }
  bar.finish();
  return result;
}

}  // namespace fivefold::runtime
