// The run's settings: the table (settings.h), their checks, and trainer_state.json's "run"
// object both ways.

#include "runtime/settings.h"

#include <cstdio>
#include <type_traits>
#include <utility>

#include "03_transformer/checkpoint.h"
#include "14_memory/precision.h"
#include "14_memory/recompute.h"
#include "fivefold/error.h"
#include "fivefold/io.h"

namespace fivefold::runtime {

using namespace fivefold::ch03;

namespace {

std::string as_text(int64_t value) { return std::to_string(value); }
std::string as_text(uint64_t value) { return std::to_string(value); }
std::string as_text(bool value) { return value ? "on" : "off"; }
std::string as_text(const std::string& value) { return value; }
std::string as_text(double value) {  // 15 digits: a value typed again reads back the same
  char text[32];
  std::snprintf(text, sizeof(text), "%.15g", value);
  return text;
}

template <class T>
T from_flag(const ArgParser& args, const std::string& flag) {
  if constexpr (std::is_same_v<T, bool>) return args.on(flag);
  if constexpr (std::is_same_v<T, double>) return args.real(flag);
  if constexpr (std::is_same_v<T, std::string>) return args.str(flag);
  if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>)
    return static_cast<T>(args.integer(flag));
}

// "train.lr" names run["train"]["lr"].
nlohmann::json::json_pointer pointer(std::string key) {
  for (char& ch : key) ch = ch == '.' ? '/' : ch;
  return nlohmann::json::json_pointer("/" + key);
}

// The command line's defaults: RunConfig's, except where it writes and that it trains with
// rotary positions (chapter 04) where chapter 03's model has none.
const RunConfig& flag_defaults() {
  static const RunConfig defaults = [] {
    RunConfig d;
    d.out_dir = "runs/ch03";
    d.model.rope_theta = 10000;
    return d;
  }();
  return defaults;
}

enum class Kind { Value, Path };

// A row for the field `ref` picks out of a RunConfig (a lambda `(auto& c) -> auto&`): its flag
// (a boolean field is an on/off flag), its key in trainer_state.json, what a resume does.
template <class Ref>
Setting field(const char* flag, const char* key, OnResume on_resume, const char* help, Ref ref,
              Kind kind = Kind::Value) {
  using T = std::decay_t<decltype(ref(std::declval<RunConfig&>()))>;
  Setting s;
  s.flag = flag;
  s.key = key;
  s.on_resume = on_resume;
  s.help = help;
  s.text = [ref](const RunConfig& c) { return as_text(ref(c)); };
  if (!s.flag.empty()) {
    s.declare = [flag = s.flag, help = s.help, value = as_text(ref(flag_defaults())),
                 kind](ArgParser& args) {
      if (std::is_same_v<T, bool>) {
        args.flag(flag, help);
      } else if (kind == Kind::Path) {
        args.path_option(flag, value, help);
      } else {
        args.option(flag, value, help);
      }
    };
    s.read = [flag = s.flag, ref](const ArgParser& args, RunConfig& c) {
      ref(c) = from_flag<T>(args, flag);
    };
  }
  if (!s.key.empty()) {
    s.save = [ref](const RunConfig& c) { return nlohmann::json(ref(c)); };
    s.load = [ref](const nlohmann::json& j, RunConfig& c) { ref(c) = j.get<T>(); };
  }
  return s;
}

// A row whose flag, when not given, takes a value that follows other settings (its help says
// which), read after them.
Setting or_else(Setting s, std::function<void(RunConfig&)> otherwise) {
  s.declare = [flag = s.flag, help = s.help](ArgParser& args) { args.option(flag, "", help); };
  s.read = [flag = s.flag, read = s.read, otherwise](const ArgParser& args, RunConfig& c) {
    args.given(flag) ? read(args, c) : otherwise(c);
  };
  return s;
}

// A row of text naming one of a few choices: read through `check`, which returns the name as
// its chapter spells it or throws fivefold::Error naming the choices (before any rank talks).
Setting one_of(Setting s, std::function<std::string(const std::string&)> check) {
  s.read = [flag = s.flag, check, load = s.load](const ArgParser& args, RunConfig& c) {
    load(nlohmann::json(check(args.str(flag))), c);
  };
  return s;
}

// A row of a whole number that must be at least `minimum` (checked as it is read, before any rank
// talks); `ref` picks the field, as in `field`.
template <class Ref>
Setting at_least(Setting s, Ref ref, int64_t minimum) {
  s.read = [flag = s.flag, read = s.read, ref, minimum](const ArgParser& args, RunConfig& c) {
    read(args, c);
    FIVEFOLD_CHECK(ref(c) >= minimum, "--", flag, " must be >= ", minimum, ", got ", ref(c));
  };
  return s;
}

// A row of a whole number, as `field` makes it, that must be at least `minimum`.
template <class Ref>
Setting at_least(const char* flag, const char* key, OnResume on_resume, const char* help, Ref ref,
                 int64_t minimum) {
  return at_least(field(flag, key, on_resume, help, ref), ref, minimum);
}

// A flag that turns a setting, on by default, off.
template <class Ref>
Setting turns_off(const char* flag, const char* help, Ref ref) {
  Setting s = field(flag, "", OnResume::Invocation, help, ref);
  s.read = [flag, ref](const ArgParser& args, RunConfig& c) { ref(c) = !args.on(flag); };
  return s;
}

std::vector<Setting> make_table() {
  using R = OnResume;
  const R fixed = R::Fixed, kept = R::Kept, now = R::Invocation;
  std::vector<Setting> t;
  t.push_back(field("out", "", now, "output folder (metrics, checkpoints)",
                    [](auto& c) -> auto& { return c.out_dir; }));
  t.push_back(at_least(
      "steps", "steps", now, "train until this many optimizer steps are done",
      [](auto& c) -> auto& { return c.steps; }, 1));
  t.push_back(field("data", "data.path", fixed,
                    "text file or .bin of uint16 token ids (default: the synthetic corpus)",
                    [](auto& c) -> auto& { return c.data.path; }, Kind::Path));
  t.push_back(field("data-seed", "data.seed", fixed, "synthetic corpus and batch order seed",
                    [](auto& c) -> auto& { return c.data.seed; }));
  t.push_back(at_least(
      "synthetic-examples", "data.synthetic_examples", fixed, "lines of synthetic training text",
      [](auto& c) -> auto& { return c.data.synthetic_examples; }, 10));
  t.push_back(field(
      "val-fraction", "data.val_fraction", fixed, "share of a data file held out (its end)",
      [](auto& c) -> auto& { return c.data.val_fraction; }));
  t.push_back(at_least(
      "seq", "seq_len", fixed, "tokens per sequence", [](auto& c) -> auto& { return c.seq_len; },
      1));
  t.push_back(at_least(
      "batch", "batch", fixed, "sequences per optimizer step, over all ranks (the global batch)",
      [](auto& c) -> auto& { return c.batch; }, 1));
  t.push_back(at_least(
      "accum", "micro_batches", kept,
      "micro-batches per data-parallel rank and step (gradient accumulation, and "
      "the pipeline's micro-batches; dp x accum divides --batch)",
      [](auto& c) -> auto& { return c.micro_batches; }, 1));
  t.push_back(
      one_of(field(
                 "recompute", "recompute", kept,
                 "activation recomputation (chapter 14): none, full (whole blocks: "
                 "keep each block's input, run it again in backward) or selective "
                 "(the attention core)",
                 [](auto& c) -> auto& { return c.recompute; }),
             [](const std::string& v) { return ch14::to_string(ch14::parse_recompute(v)); }));
  const auto every = [](auto& c) -> auto& { return c.recompute_every; };
  t.push_back(at_least(field("recompute-every", "recompute_every", kept,
                             "with --recompute full: every K-th block only (blocks 0, K, 2K, ...)",
                             every),
                       every, 1));
  const auto stages = [](auto& c) -> auto& { return c.recompute_stages; };
  t.push_back(at_least(field("recompute-stages", "recompute_stages", kept,
                             "with --recompute and --pp: only the first K pipeline stages "
                             "recompute (1F1B keeps the most micro-batches in flight there); 0: "
                             "every stage",
                             stages),
                       stages, 0));
  t.push_back(one_of(field("precision", "precision", kept,
                           "what the model computes in (chapter 14): fp32, or bf16 (bf16 weights, "
                           "gradients and products beside fp32 master weights and AdamW; "
                           "norms, residuals and reductions in fp32)",
                           [](auto& c) -> auto& { return c.precision; }),
                     [](const std::string& v) { return ch14::to_string(ch14::parse_precision(v)); }));
  t.push_back(field("lr", "train.lr", fixed, "peak learning rate",
                    [](auto& c) -> auto& { return c.train.lr; }));
  t.push_back(field("min-lr", "train.min_lr", fixed, "final learning rate",
                    [](auto& c) -> auto& { return c.train.min_lr; }));
  t.push_back(at_least(
      "warmup", "train.warmup_steps", fixed, "linear warm-up steps",
      [](auto& c) -> auto& { return c.train.warmup_steps; }, 0));
  t.push_back(or_else(
      field(
          "decay-steps", "train.total_steps", fixed, "steps of the cosine decay (default: --steps)",
          [](auto& c) -> auto& { return c.train.total_steps; }),
      [](RunConfig& c) { c.train.total_steps = c.steps; }));
  t.push_back(field("weight-decay", "train.weight_decay", fixed,
                    "AdamW decoupled weight decay (matrices only)",
                    [](auto& c) -> auto& { return c.train.weight_decay; }));
  t.push_back(field("", "train.beta1", fixed, "", [](auto& c) -> auto& { return c.train.beta1; }));
  t.push_back(field("", "train.beta2", fixed, "", [](auto& c) -> auto& { return c.train.beta2; }));
  t.push_back(field("", "train.eps", fixed, "", [](auto& c) -> auto& { return c.train.eps; }));
  t.push_back(field("grad-clip", "train.grad_clip", fixed,
                    "maximum global gradient norm (0: off)",
                    [](auto& c) -> auto& { return c.train.grad_clip; }));
  t.push_back(field("decay-embeddings", "train.decay_embeddings", fixed,
                    "also apply weight decay to the token embedding",
                    [](auto& c) -> auto& { return c.train.decay_embeddings; }));
  // The model: each flag checked on resume, the whole model saved as one "model" object.
  t.push_back(field("vocab", "", fixed, "vocabulary size (259: bytes)",
                    [](auto& c) -> auto& { return c.model.vocab_size; }));
  t.push_back(field("d-model", "", fixed, "hidden size",
                    [](auto& c) -> auto& { return c.model.d_model; }));
  t.push_back(field("n-layers", "", fixed, "transformer blocks",
                    [](auto& c) -> auto& { return c.model.n_layers; }));
  t.push_back(field("n-heads", "", fixed, "query heads",
                    [](auto& c) -> auto& { return c.model.n_heads; }));
  t.push_back(or_else(field("n-kv-heads", "", fixed, "key/value heads (default: --n-heads)",
                            [](auto& c) -> auto& { return c.model.n_kv_heads; }),
                      [](RunConfig& c) { c.model.n_kv_heads = c.model.n_heads; }));
  t.push_back(field("d-ff", "", fixed, "MLP hidden size",
                    [](auto& c) -> auto& { return c.model.d_ff; }));
  t.push_back(field("tied", "", fixed, "LM head shares the embedding matrix",
                    [](auto& c) -> auto& { return c.model.tied_embeddings; }));
  t.push_back(field("rope-theta", "", fixed,
                    "rotary position base (chapter 04); 0: no positions",
                    [](auto& c) -> auto& { return c.model.rope_theta; }));
  Setting model;  // after the flags it replaces, before --seed, which it keeps
  model.flag = "model-config";
  model.key = "model";
  model.help =
      "a Hugging Face config.json for the model (llama, or deepseek_v3: MLA, chapter 06, and "
      "experts, chapter 07); replaces the model flags above";
  model.declare = [help = model.help](ArgParser& args) {
    args.path_option("model-config", "", help);
  };
  model.read = [](const ArgParser& args, RunConfig& c) {
    if (!args.str("model-config").empty())
      c.model = config_from_json(io::read_json(args.str("model-config")));
  };
  model.text = [](const RunConfig& c) { return config_to_json(c.model).dump(); };
  model.save = [](const RunConfig& c) { return config_to_json(c.model); };
  model.load = [](const nlohmann::json& j, RunConfig& c) { c.model = config_from_json(j); };
  t.push_back(model);
  t.push_back(field("seed", "", fixed, "initialisation seed",
                    [](auto& c) -> auto& { return c.model.seed; }));
  t.push_back(at_least(
      "save-every", "save_every", kept, "checkpoint interval (0: at the end)",
      [](auto& c) -> auto& { return c.save_every; }, 0));
  t.push_back(at_least(
      "keep", "keep_checkpoints", kept, "checkpoints kept",
      [](auto& c) -> auto& { return c.keep_checkpoints; }, 1));
  t.push_back(at_least(
      "eval-every", "eval_every", kept, "evaluation interval (0: at the end)",
      [](auto& c) -> auto& { return c.eval_every; }, 0));
  t.push_back(at_least(
      "eval-batches", "eval_batches", kept, "held-out batches per evaluation",
      [](auto& c) -> auto& { return c.eval_batches; }, 1));
  const auto exact = [](auto& c) -> auto& { return c.exact_match_examples; };
  t.push_back(at_least(
      or_else(field("exact-match", "exact_match_examples", kept,
                    "held-out prompts answered per evaluation (synthetic corpus; "
                    "default 100, 0 with --data)",
                    exact),
              [](RunConfig& c) { c.exact_match_examples = c.data.path.empty() ? 100 : 0; }),
      exact, 0));
  t.push_back(field("peak-gflops", "", now, "matmul peak for MFU (0: measured at start)",
                    [](auto& c) -> auto& { return c.peak_gflops; }));
  t.push_back(turns_off("no-progress", "no progress bar",
                        [](auto& c) -> auto& { return c.progress; }));
  t.push_back(turns_off("lesson-kernels",
                        "train on the lesson's code alone: the attention and RMSNorm as written "
                        "out and torch's AdamW, instead of the fast paths (runtime/fast.h) that "
                        "compute the same thing faster",
                        [](auto& c) -> auto& { return c.fast; }));
  return t;
}

}  // namespace

const std::vector<Setting>& run_settings() {
  static const std::vector<Setting> table = make_table();
  return table;
}

void declare_run_flags(ArgParser& args) {
  for (const Setting& s : run_settings())
    if (s.declare) s.declare(args);
}

RunConfig run_from_flags(const ArgParser& args) {
  RunConfig c;
  for (const Setting& s : run_settings())
    if (s.read) s.read(args, c);
  if (c.train.warmup_steps >= c.train.total_steps) c.train.warmup_steps = c.train.total_steps / 10;
  return c;
}

RunConfig resume_with(const RunConfig& saved, const RunConfig& requested) {
  RunConfig c = requested;
  for (const Setting& s : run_settings())
    if (s.on_resume == OnResume::Fixed && s.save) s.load(s.save(saved), c);
  return c;
}

RunConfig resume_from_flags(const ArgParser& args, const RunConfig& requested,
                            const RunConfig& saved) {
  std::string changed;
  RunConfig c = resume_with(saved, requested);
  for (const Setting& s : run_settings()) {
    const bool given = !s.flag.empty() && args.given(s.flag);
    if (s.on_resume == OnResume::Kept && !given && s.save) s.load(s.save(saved), c);
    if (s.on_resume != OnResume::Fixed || !given || s.text(requested) == s.text(saved)) continue;
    changed += changed.empty() ? "" : "; ";
    changed += s.key == "model" ? "--model-config describes another model than the run's"
                                : "--" + s.flag + " " + s.text(requested) + " (the run has " +
                                      s.text(saved) + ")";
  }
  FIVEFOLD_CHECK(changed.empty(), "--resume continues the run in '", requested.out_dir,
                 "' with its own settings, and these would change what it computes: ", changed,
                 ". Leave them out, or start a new run in another --out");
  return c;
}

void RunConfig::validate() const {
  model.validate();
  train.validate();
  FIVEFOLD_CHECK(seq_len >= 1 && batch >= 1 && steps >= 1,
                 "run config: seq_len, batch and steps must be >= 1");
  const int64_t slices = placement.data_ranks * micro_batches;
  FIVEFOLD_CHECK(micro_batches >= 1 && placement.data_ranks >= 1 && batch % slices == 0,
                 "run config: the batch (", batch, " rows) must split into ", placement.data_ranks,
                 " data-parallel ranks x ", micro_batches, " micro-batches of equal rows");
  FIVEFOLD_CHECK(placement.data_rank >= 0 && placement.data_rank < placement.data_ranks &&
                     placement.processes >= placement.data_ranks,
                 "run config: inconsistent placement");
  FIVEFOLD_CHECK(save_every >= 0 && eval_every >= 0 && eval_batches >= 1 &&
                     exact_match_examples >= 0 && keep_checkpoints >= 1 && peak_gflops >= 0,
                 "run config: save_every, eval_every, exact_match_examples >= 0; eval_batches, "
                 "keep_checkpoints >= 1");
  FIVEFOLD_CHECK(data.val_fraction > 0 && data.val_fraction < 1 && data.synthetic_examples >= 10,
                 "run config: val_fraction must be in (0, 1), synthetic_examples >= 10");
  FIVEFOLD_CHECK(exact_match_examples == 0 || data.path.empty(),
                 "run config: exact-match evaluation needs the synthetic corpus (no --data)");
}

nlohmann::json run_to_json(const RunConfig& c) {
  nlohmann::json run = nlohmann::json::object();
  for (const Setting& s : run_settings())
    if (s.save) run[pointer(s.key)] = s.save(c);
  return run;
}

RunConfig run_from_json(const nlohmann::json& run) {
  RunConfig c;
  for (const Setting& s : run_settings())
    if (s.load && run.contains(pointer(s.key))) s.load(run.at(pointer(s.key)), c);
  return c;
}

RunState load_run_state(const std::string& checkpoint) {
  const std::string path = checkpoint + "/trainer_state.json";
  const auto state = io::read_json(path);
  FIVEFOLD_CHECK(state.is_object() && state.contains("step") && state["step"].is_number_integer() &&
                     state.contains("run") && state["run"].is_object(),
                 "'", path,
                 "' is not a training state: it needs an integer 'step' and a 'run' "
                 "object");
  try {
    return {state["step"].get<int64_t>(), run_from_json(state["run"])};
  } catch (const nlohmann::json::exception& e) {
    throw Error("'" + path + "': a setting in 'run' has the wrong type (" + e.what() + ")");
  }
}

}  // namespace fivefold::runtime
