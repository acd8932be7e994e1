// fivefold train / generate / eval: chapter 03's model from the command line.
//
//   fivefold train --out runs/ch03 [--steps 300] [--data FILE] [--resume] ...
//   mpirun -np 4 fivefold train --zero 1 ...     data parallel over 4 ranks (chapter 09)
//   mpirun -np 4 fivefold train --tp 2 [--sequence-parallel] ...   tp 2 x dp 2 (chapter 10)
//   mpirun -np 4 fivefold train --pp 2 --schedule 1f1b --accum 4 ...  pp 2 x dp 2 (chapter 11)
//   mpirun -np 4 fivefold train --cp 2 ...       cp 2 x dp 2 (chapter 12)
//   mpirun -np 4 fivefold train --ep 2 --model-config moe.json ...  experts over 2 of dp 4 (13)
//   fivefold generate --checkpoint runs/ch03 --prompt "12+35=" --max-new-tokens 8 --greedy
//   fivefold generate --checkpoint DIR --prompt-ids 3,1,4 --max-new-tokens N --greedy
//   fivefold eval --checkpoint runs/ch03 [--data FILE] [--exact-match 200]
//   fivefold eval --checkpoint DIR --ids 3,1,4,1,5 --logits-out logits.safetensors

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "03_transformer/checkpoint.h"
#include "03_transformer/evaluate.h"
#include "03_transformer/generate.h"
#include "07_moe/moe.h"
#include "09_data_parallel/step.h"
#include "10_tensor_parallel/step.h"
#include "11_pipeline_parallel/pipeline.h"
#include "12_context_parallel/context_parallel.h"
#include "13_expert_parallel/expert_parallel.h"
#include "14_trainer_5d/predict.h"
#include "14_trainer_5d/trainer_5d.h"
#include "fivefold/comm_stats.h"
#include "commands.h"
#include "fivefold/cli.h"
#include "fivefold/error.h"
#include "fivefold/io.h"
#include "fivefold/log.h"
#include "fivefold/mesh.h"
#include "fivefold/runtime.h"
#include "fivefold/trace.h"
#include "runtime/layout.h"
#include "runtime/measure.h"
#include "runtime/report.h"
#include "runtime/run.h"

namespace fivefold::commands {

using namespace fivefold::ch03;
using namespace fivefold::runtime;

namespace {

// Comma-separated token ids, each checked against the vocabulary.
std::vector<int64_t> token_ids(const ArgParser& args, const std::string& flag, int64_t vocab) {
  const auto ids = args.integers(flag);
  FIVEFOLD_CHECK(!ids.empty(), "--", flag, " is empty");
  for (int64_t id : ids) {
    FIVEFOLD_CHECK(id >= 0 && id < vocab, "--", flag, ": token ", id,
                   " is outside the checkpoint's vocabulary (0..", vocab - 1, ")");
  }
  return ids;
}

// Bytes of memory the system can still give (MemAvailable in /proc/meminfo); 0 when unknown.
int64_t available_memory() {
  std::ifstream meminfo("/proc/meminfo");
  std::string key, unit;
  int64_t kib = 0;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

// Refuses, before anything is allocated, a model whose fp32 weights, gradients and AdamW state
// (chapter 09's ZeRO formula for this layout) cannot fit in this machine's available memory.
// Activations come on top, so passing this check is necessary, not sufficient.
void check_model_fits(const ModelConfig& model, int64_t dp, int zero, int local_ranks) {
  const int64_t available = available_memory();
  if (available <= 0) return;
  const int64_t psi = ch07::count_parameters(model).total;
  const auto m = ch09::zero_memory_formula(psi, dp, zero);
  const double per_rank = static_cast<double>(m.parameters + m.gradients + m.optimizer);
  const double need = per_rank * local_ranks;
  FIVEFOLD_CHECK(need <= static_cast<double>(available), "the model has ", psi,
                 " parameters: its fp32 weights, gradients and AdamW state take ", per_rank / 1e9,
                 " GB per rank (ZeRO-", zero, " over ", dp, " ranks) x ", local_ranks,
                 " ranks on this machine = ", need / 1e9, " GB, more than the ",
                 static_cast<double>(available) / 1e9,
                 " GB available (activations not counted); use a smaller model, more ranks or a "
                 "higher --zero stage");
}

// With --resume the run continues with its own settings. A flag that would change what it
// computes (model, data, batch, optimiser, schedule) is refused when it differs from the run's,
// naming each; the others (steps, evaluation, checkpoints, progress, layout) apply. Settings not
// given are the run's, not the flags' defaults.
void resumed_settings(const ArgParser& args, RunConfig& c) {
  const RunState saved = load_run_state(resolve_checkpoint(c.out_dir));
  auto num = [](double x) {  // 15 digits: a value typed again reads back the same
    char text[32];
    std::snprintf(text, sizeof(text), "%.15g", x);
    return std::string(text);
  };
  using Value = std::function<std::string(const RunConfig&)>;
  const std::vector<std::pair<const char*, Value>> fixed = {
      {"data", [](const RunConfig& r) { return r.data.path; }},
      {"data-seed", [](const RunConfig& r) { return std::to_string(r.data.seed); }},
      {"synthetic-examples",
       [](const RunConfig& r) { return std::to_string(r.data.synthetic_examples); }},
      {"val-fraction", [&](const RunConfig& r) { return num(r.data.val_fraction); }},
      {"seq", [](const RunConfig& r) { return std::to_string(r.seq_len); }},
      {"batch", [](const RunConfig& r) { return std::to_string(r.batch); }},
      {"lr", [&](const RunConfig& r) { return num(r.train.lr); }},
      {"min-lr", [&](const RunConfig& r) { return num(r.train.min_lr); }},
      {"warmup", [](const RunConfig& r) { return std::to_string(r.train.warmup_steps); }},
      {"decay-steps", [](const RunConfig& r) { return std::to_string(r.train.total_steps); }},
      {"weight-decay", [&](const RunConfig& r) { return num(r.train.weight_decay); }},
      {"decay-embeddings",
       [](const RunConfig& r) { return std::string(r.train.decay_embeddings ? "on" : "off"); }},
      {"grad-clip", [&](const RunConfig& r) { return num(r.train.grad_clip); }},
      {"vocab", [](const RunConfig& r) { return std::to_string(r.model.vocab_size); }},
      {"d-model", [](const RunConfig& r) { return std::to_string(r.model.d_model); }},
      {"n-layers", [](const RunConfig& r) { return std::to_string(r.model.n_layers); }},
      {"n-heads", [](const RunConfig& r) { return std::to_string(r.model.n_heads); }},
      {"n-kv-heads", [](const RunConfig& r) { return std::to_string(r.model.n_kv_heads); }},
      {"d-ff", [](const RunConfig& r) { return std::to_string(r.model.d_ff); }},
      {"tied",
       [](const RunConfig& r) { return std::string(r.model.tied_embeddings ? "on" : "off"); }},
      {"rope-theta", [&](const RunConfig& r) { return num(r.model.rope_theta); }},
      {"seed", [](const RunConfig& r) { return std::to_string(r.model.seed); }},
      {"model-config", [](const RunConfig& r) { return config_to_json(r.model).dump(); }}};
  std::vector<std::string> changed;
  for (const auto& [flag, value] : fixed) {
    if (!args.given(flag) || value(c) == value(saved.run)) continue;
    changed.push_back(std::string(flag) == "model-config"
                          ? "--model-config describes another model than the run's"
                          : "--" + std::string(flag) + " " + value(c) + " (the run has " +
                                value(saved.run) + ")");
  }
  std::string list;
  for (const auto& item : changed) list += (list.empty() ? "" : "; ") + item;
  FIVEFOLD_CHECK(changed.empty(), "--resume continues the run in '", c.out_dir,
                 "' with its own settings, and these would change what it computes: ", list,
                 ". Leave them out, or start a new run in another --out");
  // Settings not given are the run's own; those that may change (layout, evaluation,
  // checkpoints, steps) are taken from the flags by run_training.
  RunConfig resumed = saved.run;
  resumed.steps = c.steps;
  resumed.out_dir = c.out_dir;
  resumed.progress = c.progress;
  resumed.peak_gflops = c.peak_gflops;
  resumed.placement = c.placement;
  resumed.settings_toml = c.settings_toml;
  resumed.build_model = c.build_model;
  resumed.after_step = c.after_step;
  resumed.make_step = c.make_step;
  auto keep = [&](const char* flag, auto& field, const auto& value) {
    field = args.given(flag) ? value : field;
  };
  keep("accum", resumed.micro_batches, c.micro_batches);
  keep("save-every", resumed.save_every, c.save_every);
  keep("keep", resumed.keep_checkpoints, c.keep_checkpoints);
  keep("eval-every", resumed.eval_every, c.eval_every);
  keep("eval-batches", resumed.eval_batches, c.eval_batches);
  keep("exact-match", resumed.exact_match_examples, c.exact_match_examples);
  c = resumed;
}

}  // namespace

namespace {

// `fivefold train --plan N`: what the formulas say each of N ranks of `layout` holds and carries
// in one training step of `c`, printed as a table; nothing is trained and no process is started.
// Parameters and memory are counted from the rank's part of the model, built here on one
// process over offline communicators (ch14::rank_parameters).
int print_plan(const ch14::Layout& layout, const ch14::Workload& c, int64_t world_size) {
  std::printf("plan: %s on %lld processes; %lld rows of %lld tokens a step, %lld micro-batch(es)\n\n",
              layout.describe().c_str(), static_cast<long long>(world_size),
              static_cast<long long>(c.batch), static_cast<long long>(c.seq_len),
              static_cast<long long>(c.micro_batches));
  std::printf("| rank | pp, dp, cp, tp | layers | parameters | parameters + gradients + AdamW "
              "(chapter 09) | matmul FLOPs per step | bytes per step, by group (predicted) "
              "|\n|---:|---|---|---:|---:|---:|---|\n");
  std::string unbuilt;  // why a rank's part could not be built here, if one could not
  for (int64_t r = 0; r < world_size; ++r) {
    const ch14::Layout::Place at = layout.place(r);
    const ModelPart part = layout.pp > 1 ? ch11::stage_part(c.model.n_layers, layout.pp,
                                                            layout.virtual_stages, at.pp)
                                         : ModelPart{};
    std::string layers;
    for (const auto layer : part.layers(c.model.n_layers))
      layers += (layers.empty() ? "" : ",") + std::to_string(layer);
    ch14::HeldParameters held;
    try {
      held = ch14::rank_parameters(layout, c, r);
    } catch (const Error& e) {
      unbuilt = e.what();
    }
    std::string memory = "-", parameters = "-", flops = "-";
    if (held.elements > 0) {
      memory = std::to_string(ch14::predicted_state_bytes(layout, held).total()) + " B";
      parameters = std::to_string(held.elements);
      try {
        flops = std::to_string(ch14::predicted_flops(layout, c, r, held).total());
        if (layout.ep > 1) flops = "~" + flops;  // what the router sends this rank's experts
      } catch (const Error&) {
        // experts with a capacity: what they compute follows the routing
      }
    }
    std::string bytes;
    for (const auto& [group, b] : ch14::predicted_traffic(layout, c, r, held))
      bytes += (bytes.empty() ? "" : ", ") + group + " " + std::to_string(b);
    std::printf("| %lld | %lld, %lld, %lld, %lld | %s | %s | %s | %s | %s |\n",
                static_cast<long long>(r), static_cast<long long>(at.pp),
                static_cast<long long>(at.dp), static_cast<long long>(at.cp),
                static_cast<long long>(at.tp), layers.c_str(), parameters.c_str(), memory.c_str(),
                flops.c_str(), bytes.empty() ? "-" : bytes.c_str());
  }
  if (!unbuilt.empty())
    std::printf("\nParameters, memory and the groups that follow from them are not predicted "
                "here: %s\n", unbuilt.c_str());
  std::printf("\nBytes are what each rank hands its communicators in one training step, FLOPs "
              "what it multiplies in its matmuls, forward and backward (the trainer prints the "
              "measured ones beside them at the end of a run); under ep both assume the router "
              "spreads every rank's tokens evenly ('~': what one rank receives follows the "
              "routing; the mean over the ranks does not).\n");
  return 0;
}

}  // namespace

int train(int argc, char** argv) {
  const RunConfig d;  // defaults, shown in --help
  ArgParser args(
      "fivefold train",
      "Trains the chapters' transformer (chapter 03, with chapter 04's rotary positions; "
      "MLA and experts from a deepseek_v3 --model-config), on one process or under mpirun "
      "with data (chapter 09), tensor (10) and pipeline (11) parallelism: on the built-in "
      "synthetic "
      "corpus (arithmetic, copying, reversal, key-value recall), a UTF-8 text file or "
      "a nanoGPT-style uint16 .bin. Writes OUT/metrics.jsonl and checkpoints "
      "OUT/step-N (Hugging Face layout plus optimizer and RNG state); --resume "
      "continues a run exactly.");
  args.option("out", "runs/ch03", "output folder (metrics, checkpoints)");
  args.flag("resume", "continue the run in --out from its latest checkpoint, with its settings");
  args.option("steps", std::to_string(d.steps), "train until this many optimizer steps are done");
  args.path_option("data", "",
                   "text file or .bin of uint16 token ids (default: the synthetic corpus)");
  args.option("data-seed", "0", "synthetic corpus and batch order seed");
  args.option("synthetic-examples", std::to_string(d.data.synthetic_examples),
              "lines of synthetic training text");
  args.option("val-fraction", "0.1", "share of a data file held out (its end)");
  args.option("seq", std::to_string(d.seq_len), "tokens per sequence");
  args.option("batch", std::to_string(d.batch),
              "sequences per optimizer step, over all ranks (the global batch)");
  args.option("accum", "1",
              "micro-batches per data-parallel rank and step (gradient accumulation, and the "
              "pipeline's micro-batches; dp x accum divides --batch)");
  args.option("dp", "", "data-parallel ranks (default: the world size / (tp x pp x cp))");
  args.option("zero", "0",
              "with --dp > 1: 0 DDP, 1 shard AdamW's state, 2 and the gradients, 3 and the "
              "parameters (ZeRO, chapter 09)");
  args.option("tp", "1",
              "tensor-parallel ranks (chapter 10): each matrix split over them; tp divides the "
              "heads and the key/value heads");
  args.flag("sequence-parallel",
            "with --tp > 1: norms and residuals on each rank's part of the sequence (chapter 10)");
  args.option("pp", "1",
              "pipeline ranks (chapter 11): the layers cut into consecutive stages, as even as "
              "they split");
  args.option("schedule", "1f1b",
              "with --pp > 1: gpipe, 1f1b, interleaved (--virtual-stages, accum a multiple of "
              "pp) or zb (zero-bubble ZB-H1)");
  args.option("virtual-stages", "1",
              "with --schedule interleaved: stages per pipeline rank (pp x this <= layers)");
  args.option("cp", "1",
              "context-parallel ranks (chapter 12): each holds part of every sequence's tokens; "
              "keys and values travel between them");
  args.option("cp-layout", "zigzag",
              "with --cp > 1: zigzag (chunks r and 2cp-1-r of 2cp: equal causal work; seq a "
              "multiple of 2cp) or contiguous (consecutive slices, uneven allowed)");
  args.option("cp-attention", "ring",
              "with --cp > 1: ring (keys and values passed around, overlapped with compute) or "
              "allgather (gathered whole before attention)");
  args.option("ep", "1",
              "expert-parallel ranks (chapter 13): each MoE layer's routed experts split over "
              "them, tokens sent to their experts by all-to-all; ep divides dp x cp and the "
              "experts; with --dp, --cp, --tp, --pp and --zero");
  args.option("lr", "3e-3", "peak learning rate").option("min-lr", "3e-4", "final learning rate");
  args.option("warmup", "20", "linear warm-up steps");
  args.option("decay-steps", "", "steps of the cosine decay (default: --steps)");
  args.option("weight-decay", "0.1", "AdamW decoupled weight decay (matrices only)");
  args.flag("decay-embeddings", "also apply weight decay to the token embedding");
  args.option("grad-clip", "1.0", "maximum global gradient norm (0: off)");
  args.option("vocab", std::to_string(d.model.vocab_size), "vocabulary size (259: bytes)");
  args.option("d-model", std::to_string(d.model.d_model), "hidden size");
  args.option("n-layers", std::to_string(d.model.n_layers), "transformer blocks");
  args.option("n-heads", std::to_string(d.model.n_heads), "query heads");
  args.option("n-kv-heads", "", "key/value heads (default: --n-heads)");
  args.option("d-ff", std::to_string(d.model.d_ff), "MLP hidden size");
  args.flag("tied", "LM head shares the embedding matrix");
  args.option("rope-theta", "10000", "rotary position base (chapter 04); 0: no positions");
  args.path_option("model-config", "",
              "a Hugging Face config.json for the model (llama, or deepseek_v3: MLA, chapter "
              "06, and experts, chapter 07); replaces the model flags above");
  args.option("seed", "0", "initialisation seed");
  args.option("save-every", std::to_string(d.save_every), "checkpoint interval (0: at the end)");
  args.option("keep", std::to_string(d.keep_checkpoints), "checkpoints kept");
  args.option("eval-every", std::to_string(d.eval_every), "evaluation interval (0: at the end)");
  args.option("eval-batches", std::to_string(d.eval_batches), "held-out batches per evaluation");
  args.option("exact-match", "",
              "held-out prompts answered per evaluation (synthetic corpus; "
              "default 100, 0 with --data)");
  args.option("peak-gflops", "0", "matmul peak for MFU (0: measured at start)");
  args.flag("no-progress", "no progress bar");
  args.option("plan", "0",
              "print the plan of this run on N processes and exit: each rank's layers, "
              "parameters, memory (chapter 09's ZeRO formulas) and the bytes the formulas "
              "predict per group and step; trains nothing and needs no mpirun (0: train)");
  args.flag("lesson-kernels",
            "train on the lesson's code alone: the attention and RMSNorm as written out and "
            "torch's AdamW, instead of the fast paths (runtime/fast.h) that "
            "compute the same thing faster");
  args.flag("trace",
            "write each rank's timeline (steps, evaluations, checkpoints, every communicator "
            "operation) to OUT/trace/rank-N.json, Chrome trace format (chrome://tracing, "
            "ui.perfetto.dev)");
  args.config_file(
      "a TOML file of settings, `name = value` for any option above (flags: true/false); "
      "options on the command line win; --data and --model-config there are read from the "
      "file's folder, --out is where you run (presets: chapters/14_trainer_5d/presets/)");
  if (!args.parse(argc, argv)) return 0;
  // The layout, read from the flags and checked (chapter 14's resolve_layout) before anything
  // starts: every rank sees the same flags and the same world size, so every rank refuses the
  // same way, before any communication.
  ch14::Layout layout;
  layout.dp = args.given("dp") ? args.integer("dp") : 0;
  layout.tp = args.integer("tp");
  layout.pp = args.integer("pp");
  layout.cp = args.integer("cp");
  layout.ep = args.integer("ep");
  layout.zero = static_cast<int>(args.integer("zero"));
  layout.sequence_parallel = args.on("sequence-parallel");
  layout.schedule = args.str("schedule");
  layout.virtual_stages = args.integer("virtual-stages");
  layout.cp_layout = ch12::parse_cp_layout(args.str("cp-layout"));
  layout.cp_attention = ch12::parse_cp_attention(args.str("cp-attention"));
  // A choice of how a dimension runs, other than its default, without the dimension is a
  // mistake (the defaults themselves may stand, as in a settings.toml read back on one process).
  const ch14::Layout defaults;
  FIVEFOLD_CHECK(layout.pp > 1 || (layout.schedule == defaults.schedule &&
                                   layout.virtual_stages == defaults.virtual_stages),
                 "--schedule and --virtual-stages choose how a pipeline runs: they need --pp 2 "
                 "or more");
  FIVEFOLD_CHECK(layout.cp > 1 || (layout.cp_layout == defaults.cp_layout &&
                                   layout.cp_attention == defaults.cp_attention),
                 "--cp-layout and --cp-attention choose how context parallelism splits and "
                 "attends: they need --cp 2 or more");
  FIVEFOLD_CHECK(!args.on("trace") || !args.str("out").empty(),
                 "--trace writes into --out: give a folder");
  // --plan N: the layout on N processes, planned on this one; otherwise the launched world.
  const int64_t plan_world = args.integer("plan");
  FIVEFOLD_CHECK(plan_world >= 0, "--plan takes a number of processes, got ", plan_world);
  std::optional<Runtime> runtime;
  dist::CommunicatorPtr world;
  if (plan_world == 0) {
    runtime.emplace();
    world = runtime->world();
  }
  const int64_t world_size = plan_world > 0 ? plan_world : world->size();

  RunConfig c;
  c.out_dir = args.str("out");
  c.steps = args.integer("steps");
  c.data.path = args.str("data");
  c.data.seed = static_cast<uint64_t>(args.integer("data-seed"));
  c.data.synthetic_examples = args.integer("synthetic-examples");
  c.data.val_fraction = args.real("val-fraction");
  c.seq_len = args.integer("seq");
  c.batch = args.integer("batch");
  c.micro_batches = args.integer("accum");
  c.train.lr = args.real("lr");
  c.train.min_lr = args.real("min-lr");
  c.train.warmup_steps = args.integer("warmup");
  c.train.total_steps = args.given("decay-steps") ? args.integer("decay-steps") : c.steps;
  c.train.weight_decay = args.real("weight-decay");
  c.train.decay_embeddings = args.on("decay-embeddings");
  c.train.grad_clip = args.real("grad-clip");
  c.fast = !args.on("lesson-kernels");
  c.model.vocab_size = args.integer("vocab");
  c.model.d_model = args.integer("d-model");
  c.model.n_layers = args.integer("n-layers");
  c.model.n_heads = args.integer("n-heads");
  c.model.n_kv_heads = args.given("n-kv-heads") ? args.integer("n-kv-heads") : c.model.n_heads;
  c.model.d_ff = args.integer("d-ff");
  c.model.tied_embeddings = args.on("tied");
  c.model.rope_theta = args.real("rope-theta");
  if (!args.str("model-config").empty())
    c.model = ch03::config_from_json(io::read_json(args.str("model-config")));
  c.model.seed = static_cast<uint64_t>(args.integer("seed"));
  // Refused before the mesh's communicators exist: the model and sequence the run will have (a
  // resumed run's own, read from its checkpoint's files), and again below after the resume.
  c.model.validate();
  RunConfig planned = c;
  if (args.on("resume")) {
    planned = load_run_state(resolve_checkpoint(c.out_dir)).run;
    if (args.given("accum")) planned.micro_batches = c.micro_batches;
  }
  layout = ch14::resolve_layout(layout, world_size, workload_of(planned));
  c.save_every = args.integer("save-every");
  c.keep_checkpoints = args.integer("keep");
  c.eval_every = args.integer("eval-every");
  c.eval_batches = args.integer("eval-batches");
  c.exact_match_examples =
      args.given("exact-match") ? args.integer("exact-match") : (c.data.path.empty() ? 100 : 0);
  c.peak_gflops = args.real("peak-gflops");
  c.progress = !args.on("no-progress");
  // The settings of this invocation (flags, config file, defaults), written as the run starts:
  // --config reads it back.
  c.settings_toml = args.settings_toml();
  if (c.train.warmup_steps >= c.train.total_steps) c.train.warmup_steps = c.train.total_steps / 10;
  if (args.on("resume")) resumed_settings(args, c);
  c.model.validate();
  layout = ch14::resolve_layout(layout, world_size, workload_of(c));
  if (plan_world > 0) return print_plan(layout, workload_of(c), world_size);
  check_model_fits(c.model, layout.dp * layout.cp, layout.zero, runtime->launch().local_size);
  log0() << "layout: " << layout.describe() << " on " << world->size() << " processes";
  use_layout(layout, world, c);
  StepMeter meter;  // what this rank's steps did, for the report below
  c.observers.push_back(&meter);
  dist::reset_comm_stats();  // what the mesh's set-up exchanged is not the training's
  if (args.on("trace")) trace::start();
  const RunResult r = run_training(c, args.on("resume"));
  if (args.on("trace")) {  // every rank writes its own timeline
    trace::stop();
    const std::string path =
        c.out_dir + "/trace/rank-" + std::to_string(world->rank()) + ".json";
    std::filesystem::create_directories(c.out_dir + "/trace");
    io::write_file_atomic(path, trace::chrome_trace(world->rank()).dump());
    log0() << "timelines: " << c.out_dir << "/trace/rank-*.json (Chrome trace format)";
  }
  // What each group carried and each rank's peak memory, measured in this run, beside what the
  // formulas say for this rank's part (built again here, offline: what --plan counts).
  const ch14::Workload work = workload_of(c);
  Transformer held_model = meter.held();
  const ch14::TrainableCounts counted = ch14::count_trainable(held_model);
  ch14::HeldParameters held;
  static_cast<ch14::TrainableCounts&>(held) = counted;
  try {
    held = ch14::rank_parameters(layout, work, static_cast<int64_t>(world->rank()));
  } catch (const Error&) {
    // a part that cannot be built offline: the run's own counts, and no tp prediction
  }
  if (held.elements != counted.elements || held.tensors != counted.tensors)
    log(LogLevel::Warn) << "the plan's part of the model holds " << held.elements << " parameters in "
                        << held.tensors << " tensors, the run's " << counted.elements << " in "
                        << counted.tensors << ": the predictions below follow the plan's";
  const int64_t steps = static_cast<int64_t>(r.losses.size());
  const auto rank = static_cast<int64_t>(world->rank());
  runtime::RankMeasurement mine = runtime::measure_rank(meter.training_comm());
  mine.predicted_bytes = ch14::predicted_run_traffic(layout, work, rank, held, steps,
                                                     meter.steps_after_whole_model());
  if (steps > 0) {
    mine.state_bytes = meter.state().total();
    mine.matmul_flops = meter.step_flops();
  }
  if (held.elements > 0) mine.predicted_state_bytes = ch14::predicted_state_bytes(layout, held).total();
  try {
    mine.predicted_matmul_flops = ch14::predicted_flops(layout, work, rank, held).total();
  } catch (const Error&) {
    // no matrices known (a part not built offline) or experts with a capacity: not predicted
  }
  mine.flops_exact_per_rank = layout.ep == 1;  // under ep each rank computes what it was sent
  const auto measured = runtime::gather_measurements(world, mine);
  if (c.placement.writer && steps > 0) {
    log0() << "measured over " << steps << " training steps (payload bytes handed to each "
           << "communicator; evaluation and checkpoints not counted), beside chapters 09-13's "
           << "formulas (per training step; '-': no formula here; '~': ep's balanced-routing "
           << "expectation):\n"
           << runtime::measurement_table(measured, steps);
    if (!c.out_dir.empty()) {
      nlohmann::json report = runtime::measurement_json(measured, steps);
      report["layout"] = layout.describe();
      report["steps"] = steps;
      io::write_json(c.out_dir + "/measured.json", report);
    }
  }
  log0() << "done: " << r.losses.size() << " steps, final training loss "
         << (r.losses.empty() ? 0.0 : r.losses.back()) << ", held-out loss " << r.eval.loss
         << ", checkpoint " << (r.checkpoint.empty() ? "(none)" : r.checkpoint);
  return 0;
}

int generate(int argc, char** argv) {
  ArgParser args("fivefold generate",
                 "Continues a prompt with a checkpoint's model (KV cache). With --prompt-ids, "
                 "prints the new token ids comma-separated on one line; with --prompt, the "
                 "text (byte tokenizer).");
  args.option("checkpoint", "", "checkpoint folder, or a training output folder (its latest)");
  args.option("prompt", "", "prompt text (byte tokens)");
  args.option("prompt-ids", "", "prompt token ids, e.g. 3,1,4");
  args.option("max-new-tokens", "32", "tokens to generate at most");
  args.flag("greedy",
            "always take the most likely token (the default unless --temperature or "
            "--top-k is given)");
  args.option("temperature", "1.0", "divides the logits before sampling");
  args.option("top-k", "0", "sample among the k most likely tokens (0: all)");
  args.option("seed", "0", "sampling seed");
  args.option("stop-ids", "", "stop after one of these ids (default with --prompt: newline)");
  args.flag("no-cache", "recompute the whole sequence for every token");
  if (!args.parse(argc, argv)) return 0;
  FIVEFOLD_CHECK(args.given("checkpoint"), "fivefold generate: --checkpoint is required");
  FIVEFOLD_CHECK(args.given("prompt") != args.given("prompt-ids"),
                 "fivefold generate: give exactly one of --prompt and --prompt-ids");
  Runtime runtime;
  Transformer model = ch07::load_model(resolve_checkpoint(args.str("checkpoint")));
  const int64_t vocab = model->config().vocab_size;

  SamplingOptions options;
  options.greedy = args.on("greedy") || !(args.given("temperature") || args.given("top-k"));
  options.temperature = args.real("temperature");
  options.top_k = args.integer("top-k");
  options.seed = static_cast<uint64_t>(args.integer("seed"));
  options.use_cache = !args.on("no-cache");
  if (args.given("stop-ids")) options.stop_tokens = token_ids(args, "stop-ids", vocab);

  std::vector<int64_t> prompt;
  if (args.given("prompt-ids")) {
    prompt = token_ids(args, "prompt-ids", vocab);
  } else {
    FIVEFOLD_CHECK(vocab >= ByteTokenizer::kVocab, "--prompt needs the byte tokenizer's ",
                   ByteTokenizer::kVocab, " tokens; this checkpoint has ", vocab,
                   ": use --prompt-ids");
    prompt = ByteTokenizer::encode(args.str("prompt"));
    FIVEFOLD_CHECK(!prompt.empty(), "--prompt is empty");
    if (!args.given("stop-ids")) options.stop_tokens = {'\n'};
  }
  const int64_t max_new = args.integer("max-new-tokens");
  const int64_t trained = model->config().max_position_embeddings;
  if (static_cast<int64_t>(prompt.size()) + max_new > trained) {
    log(LogLevel::Warn) << "generating up to " << static_cast<int64_t>(prompt.size()) + max_new
                        << " positions, beyond the " << trained
                        << " the model was trained for (max_position_embeddings): expect it "
                           "to degrade there (chapter 05 extends the context)";
  }
  // Tokens are printed as they come: ids comma-separated, or the text after the prompt.
  const bool ids = args.given("prompt-ids");
  bool first = true, line_ended = false;
  if (!ids) std::fputs(args.str("prompt").c_str(), stdout);
  options.on_token = [&](int64_t token) {
    if (ids) {
      std::printf(first ? "%lld" : ",%lld", static_cast<long long>(token));
    } else {
      const std::string piece = ByteTokenizer::decode({token});
      std::fputs(piece.c_str(), stdout);
      line_ended = piece == "\n";  // a stop token that ends the line
    }
    first = false;
    std::fflush(stdout);
  };
  ch03::generate(model, prompt, max_new, options);
  if (!line_ended) std::printf("\n");
  return 0;
}

int eval(int argc, char** argv) {
  ArgParser args("fivefold eval",
                 "Evaluates a checkpoint: mean loss and perplexity on held-out batches (the "
                 "synthetic corpus's held-out split, or the end of --data) and exact-match "
                 "accuracy on synthetic prompts; or, with --ids and --logits-out, writes the "
                 "logits of one sequence as a float32 tensor 'logits' [seq, vocab].");
  args.option("checkpoint", "", "checkpoint folder, or a training output folder (its latest)");
  args.option("ids", "", "token ids of one sequence, e.g. 3,1,4,1,5 (with --logits-out)");
  args.option("logits-out", "", "safetensors file for the logits of --ids");
  args.option("data", "", "text file or .bin (default: the synthetic corpus)");
  args.option("data-seed", "0", "synthetic corpus and batch seed");
  args.option("val-fraction", "0.1", "share of a data file held out (its end)");
  args.option("seq", "64", "tokens per sequence").option("batch", "16", "sequences per batch");
  args.option("split", "held-out", "which split to score: held-out or train");
  args.option("batches", "16", "batches to score");
  args.option("exact-match", "", "synthetic prompts of the split to answer (default 200; 0: none)");
  if (!args.parse(argc, argv)) return 0;
  FIVEFOLD_CHECK(args.given("checkpoint"), "fivefold eval: --checkpoint is required");
  FIVEFOLD_CHECK(args.given("ids") == args.given("logits-out"),
                 "fivefold eval: --ids and --logits-out go together");
  Runtime runtime;
  const std::string dir = resolve_checkpoint(args.str("checkpoint"));
  Transformer model = ch07::load_model(dir);

  if (args.given("ids")) {
    const auto ids = token_ids(args, "ids", model->config().vocab_size);
    torch::NoGradGuard no_grad;
    auto logits = model(torch::tensor(ids, torch::kLong).unsqueeze(0))[0];  // [seq, vocab]
    io::save_safetensors(args.str("logits-out"), {{"logits", logits.contiguous()}});
    log() << "wrote logits " << logits.sizes() << " to " << args.str("logits-out");
    return 0;
  }
  DataConfig data;
  data.path = args.str("data");
  data.seed = static_cast<uint64_t>(args.integer("data-seed"));
  data.val_fraction = args.real("val-fraction");
  const int64_t seq = args.integer("seq"), batch = args.integer("batch");
  FIVEFOLD_CHECK(seq >= 1 && batch >= 1 && args.integer("batches") >= 1,
                 "--seq, --batch and --batches must be >= 1");
  const std::string split_name = args.str("split");
  FIVEFOLD_CHECK(split_name == "held-out" || split_name == "train",
                 "--split must be held-out or train, got '", split_name, "'");
  const Split split = split_name == "train" ? Split::Train : Split::HeldOut;
  const auto datasets = load_datasets(data, seq);
  const TokenDataset& tokens = split == Split::Train ? datasets.first : datasets.second;
  FIVEFOLD_CHECK(tokens.max_token() < model->config().vocab_size, "the data has token id ",
                 tokens.max_token(), " but the checkpoint's vocabulary has ",
                 model->config().vocab_size, " tokens");
  // Held out: the same batches a training run evaluates on (seed + 1, see trainer.cpp).
  const BatchSampler sampler(tokens, seq, batch, data.seed + (split == Split::Train ? 0 : 1));
  const LossReport loss = evaluate_loss(model, sampler, args.integer("batches"));
  std::printf("checkpoint %s\n%s loss %.4f  perplexity %.3f  (%lld tokens)\n", dir.c_str(),
              split_name.c_str(), loss.loss, loss.perplexity, static_cast<long long>(loss.tokens));
  const int64_t examples =
      args.given("exact-match") ? args.integer("exact-match") : (data.path.empty() ? 200 : 0);
  if (examples > 0) {
    FIVEFOLD_CHECK(data.path.empty(), "--exact-match needs the synthetic corpus (no --data)");
    const ExactMatchReport exact = exact_match(model, data.seed, split, examples);
    std::printf("exact match %.3f over %lld %s prompts:", exact.accuracy(),
                static_cast<long long>(examples), split_name.c_str());
    for (const auto& [task, n] : exact.total)
      std::printf("  %s %.3f (%lld)", task.c_str(), exact.accuracy(task),
                  static_cast<long long>(n));
    std::printf("\n");
  }
  return 0;
}

}  // namespace fivefold::commands
