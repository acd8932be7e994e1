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
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "03_transformer/checkpoint.h"
#include "03_transformer/evaluate.h"
#include "03_transformer/generate.h"
#include "07_moe/moe.h"
#include "11_pipeline_parallel/pipeline.h"
#include "14_memory/precision.h"
#include "15_trainer_5d/predict.h"
#include "15_trainer_5d/trainer_5d.h"
#include "commands.h"
#include "fivefold/cli.h"
#include "fivefold/error.h"
#include "fivefold/io.h"
#include "fivefold/log.h"
#include "fivefold/runtime.h"
#include "fivefold/trace.h"
#include "runtime/layout.h"
#include "runtime/measure.h"
#include "runtime/run.h"
#include "runtime/settings.h"

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

// The activations cell of rank `r`'s row: "micro-batch x in flight = peak", with recomputation
// the peak without it beside; "-" where chapter 14 derives no formula.
std::string activation_cell(const ch15::Layout& layout, const ch15::Workload& c,
                            ch14::Precision precision, int64_t r) {
  try {
    const auto kept = ch15::predicted_activations(layout, c, r, precision);
    // Under ep what a rank's experts keep follows the routing: '~', the balanced expectation.
    std::string cell = std::string(layout.ep > 1 ? "~" : "") +
                       std::to_string(kept.per_micro_batch) + " x " +
                       std::to_string(kept.in_flight) + " = " + std::to_string(kept.peak()) + " B";
    if (c.recompute.mode != ch14::Recompute::None) {
      ch15::Workload plain = c;
      plain.recompute = {};
      cell += " (" + std::to_string(ch15::predicted_activations(layout, plain, r, precision).peak()) +
              " B)";
    }
    return cell;
  } catch (const Error&) {
    return "-";  // not derived (chapter 14)
  }
}

// `fivefold train --plan N`: what the formulas say each of N ranks of `layout` holds and carries
// in one training step of `c`, printed as a table; nothing is trained and no process is started.
// Parameters and memory are counted from the rank's part of the model, built here on one
// process over offline communicators (ch15::rank_parameters).
int print_plan(const ch15::Layout& layout, const ch15::Workload& c, ch14::Precision precision,
               int64_t world_size) {
  std::printf("plan: %s on %lld processes; %lld rows of %lld tokens a step, %lld micro-batch(es)\n\n",
              layout.describe().c_str(), static_cast<long long>(world_size),
              static_cast<long long>(c.batch), static_cast<long long>(c.seq_len),
              static_cast<long long>(c.micro_batches));
  std::printf("| rank | pp, dp, cp, tp | layers | parameters | parameters + gradients + AdamW "
              "(chapter 09) | activations (chapter 14) | matmul FLOPs per step | bytes per step, "
              "by group (predicted) |\n|---:|---|---|---:|---:|---:|---:|---|\n");
  std::string unbuilt;  // why a rank's part could not be built here, if one could not
  for (int64_t r = 0; r < world_size; ++r) {
    const ch15::Layout::Place at = layout.place(r);
    const ModelPart part = layout.pp > 1 ? ch11::stage_part(c.model.n_layers, layout.pp,
                                                            layout.virtual_stages, at.pp)
                                         : ModelPart{};
    std::string layers;
    for (const auto layer : part.layers(c.model.n_layers))
      layers += (layers.empty() ? "" : ",") + std::to_string(layer);
    ch15::HeldParameters held;
    try {
      held = ch15::rank_parameters(layout, c, r);
    } catch (const Error& e) {
      unbuilt = e.what();
    }
    std::string memory = "-", parameters = "-", flops = "-";
    if (held.elements > 0) {
      memory = std::to_string(ch15::predicted_state_bytes(layout, held, c.precision).total()) +
               " B";
      parameters = std::to_string(held.elements);
      try {
        flops = std::to_string(ch15::predicted_flops(layout, c, r, held).total());
        if (layout.ep > 1) flops = "~" + flops;  // what the router sends this rank's experts
      } catch (const Error&) {
        // experts with a capacity: what they compute follows the routing
      }
    }
    const std::string activations = activation_cell(layout, c, precision, r);
    std::string bytes;
    for (const auto& [group, b] : ch15::predicted_traffic(layout, c, r, held))
      bytes += (bytes.empty() ? "" : ", ") + group + " " + std::to_string(b);
    std::printf("| %lld | %lld, %lld, %lld, %lld | %s | %s | %s | %s | %s | %s |\n",
                static_cast<long long>(r), static_cast<long long>(at.pp),
                static_cast<long long>(at.dp), static_cast<long long>(at.cp),
                static_cast<long long>(at.tp), layers.c_str(), parameters.c_str(), memory.c_str(),
                activations.c_str(), flops.c_str(), bytes.empty() ? "-" : bytes.c_str());
  }
  if (!unbuilt.empty())
    std::printf("\nParameters, memory and the groups that follow from them are not predicted "
                "here: %s\n", unbuilt.c_str());
  std::printf("\nActivations are what the rank's blocks keep for backward at once, in %s: "
              "chapter 14's block formulas for its share, one micro-batch times the most the "
              "schedule holds in flight; with recomputation, in parentheses, what they keep "
              "without it. The formulas are those of the kernels the run computes with (the fast "
              "kernels, runtime/fast.h; with --lesson-kernels chapter 14's for the lesson's), "
              "and leave out the stage's input, the head and the loss; '~': under ep, the "
              "routing's balanced expectation.\n",
              ch14::to_string(precision).c_str());
  std::printf("\nBytes are what each rank hands its communicators in one training step, FLOPs "
              "what it multiplies in its matmuls, forward and backward (the trainer prints the "
              "measured ones beside them at the end of a run); under ep both assume the router "
              "spreads every rank's tokens evenly ('~': what one rank receives follows the "
              "routing; the mean over the ranks does not).\n");
  return 0;
}

// Every rank writes its own timeline of the run to OUT/trace/rank-N.json.
void write_trace(const std::string& out_dir, int rank) {
  trace::stop();
  std::filesystem::create_directories(out_dir + "/trace");
  io::write_file_atomic(out_dir + "/trace/rank-" + std::to_string(rank) + ".json",
                        trace::chrome_trace(rank).dump());
  log0() << "timelines: " << out_dir << "/trace/rank-*.json (Chrome trace format)";
}

}  // namespace

int train(int argc, char** argv) {
  ArgParser args(
      "fivefold train",
      "Trains the chapters' transformer (chapter 03, with chapter 04's rotary positions; "
      "MLA and experts from a deepseek_v3 --model-config), on one process or under mpirun "
      "with data (chapter 09), tensor (10), pipeline (11), context (12) and expert (13) "
      "parallelism: on the built-in synthetic corpus (arithmetic, copying, reversal, key-value "
      "recall), a UTF-8 text file or a nanoGPT-style uint16 .bin. Writes OUT/metrics.jsonl and "
      "checkpoints OUT/step-N (Hugging Face layout plus optimizer and RNG state); --resume "
      "continues a run exactly.");
  args.flag("resume", "continue the run in --out from its latest checkpoint, with its settings");
  declare_run_flags(args);  // runtime/settings.h: the run's settings, one table
  declare_layout_flags(args);
  args.option("plan", "0",
              "print the plan of this run on N processes and exit: each rank's layers, "
              "parameters, memory (chapter 09's ZeRO formulas) and the bytes the formulas "
              "predict per group and step; trains nothing and needs no mpirun (0: train)");
  args.flag("trace",
            "write each rank's timeline (steps, evaluations, checkpoints, every communicator "
            "operation) to OUT/trace/rank-N.json, Chrome trace format (chrome://tracing, "
            "ui.perfetto.dev)");
  args.config_file(
      "a TOML file of settings, `name = value` for any option above (flags: true/false); "
      "options on the command line win; --data and --model-config there are read from the "
      "file's folder, --out is where you run (presets: chapters/15_trainer_5d/presets/)");
  if (!args.parse(argc, argv)) return 0;
  // Every rank sees the same flags and the same world size, so every rank refuses the same way,
  // before any communication: the layout, the settings (a resumed run's own) and then the two
  // together (chapter 15's resolve_layout).
  ch15::Layout layout = layout_from_flags(args);
  FIVEFOLD_CHECK(!args.on("trace") || !args.str("out").empty(),
                 "--trace writes into --out: give a folder");
  // --plan N: the layout on N processes, planned on this one; otherwise the launched world.
  const int64_t plan_world = args.integer("plan");
  FIVEFOLD_CHECK(plan_world >= 0, "--plan takes a number of processes, got ", plan_world);
  RunConfig c = run_from_flags(args);
  c.settings_toml = args.settings_toml();  // written as the run starts: --config reads it back
  c.model.validate();
  // A resume trains on with the checkpoint's own settings. A process that cannot read it (on a
  // machine that does not see --out) says so after the inputs' agreement below, which names it.
  std::string unread_checkpoint;
  if (args.on("resume")) {
    try {
      c = resume_from_flags(args, c, load_run_state(resolve_checkpoint(c.out_dir)).run);
    } catch (const Error& e) {
      if (plan_world > 0) throw;
      unread_checkpoint = e.what();
    }
  }
  std::optional<Runtime> runtime;
  if (plan_world == 0) runtime.emplace();
  const dist::CommunicatorPtr world = runtime ? runtime->world() : nullptr;
  const int64_t world_size = runtime ? world->size() : plan_world;
  layout = ch15::resolve_layout(layout, world_size, workload_of(c));
  if (plan_world > 0)
    return print_plan(layout, workload_of(c), ch14::parse_precision(c.precision), world_size);
  // On several machines each process reads its own files: refused together unless all read
  // the same settings, data and checkpoint (one all-gather, before the layout's collectives).
  agree_on_inputs(run_inputs(c, layout, args.on("resume")), *world);
  FIVEFOLD_CHECK(unread_checkpoint.empty(), unread_checkpoint);  // then no process could read it
  check_fits_in_memory(c, layout, runtime->launch().local_size, world_size);
  log0() << "layout: " << layout.describe() << " on " << world->size() << " processes";
  use_layout(layout, world, c);
  StepMeter meter;  // what this rank's steps did, for the report below
  c.observers.push_back(&meter);
  dist::reset_comm_stats();  // what the mesh's set-up exchanged is not the training's
  if (args.on("trace")) trace::start();
  const RunResult r = run_training(c, args.on("resume"));
  if (args.on("trace")) write_trace(c.out_dir, world->rank());
  report_measurements(layout, world, c, meter, static_cast<int64_t>(r.losses.size()));
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
  // Refused before the prompt is echoed: a refusal prints nothing on stdout.
  FIVEFOLD_CHECK(max_new >= 0, "--max-new-tokens must be >= 0, got ", max_new);
  options.validate();
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
  const int64_t examples =
      args.given("exact-match") ? args.integer("exact-match") : (data.path.empty() ? 200 : 0);
  FIVEFOLD_CHECK(examples >= 0, "--exact-match must be >= 0, got ", examples);
  FIVEFOLD_CHECK(examples == 0 || data.path.empty(),
                 "--exact-match needs the synthetic corpus (no --data)");
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
  if (examples > 0) {
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
