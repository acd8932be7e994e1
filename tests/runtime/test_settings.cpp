// The run's settings table (runtime/settings.h): the keys a checkpoint saves them under, the
// round trip through trainer_state.json, the flags read into a run with the defaults that follow
// other settings, and what --resume refuses, keeps and takes anew.

#include <string>
#include <vector>

#include "fivefold/cli.h"
#include "runtime/settings.h"
#include "testing.h"

using namespace fivefold::runtime;
using fivefold::ArgParser;
using fivefold::testing::throws_error_containing;

namespace {

// `fivefold train`'s run flags, parsed from `argv` (without the program name).
RunConfig from_flags(std::vector<const char*> argv, ArgParser* keep = nullptr) {
  ArgParser args("train", "test");
  declare_run_flags(args);
  argv.insert(argv.begin(), "train");
  EXPECT_TRUE(args.parse(static_cast<int>(argv.size()), argv.data()));
  RunConfig run = run_from_flags(args);
  if (keep) *keep = std::move(args);
  return run;
}

// Every key of `json` as a path ("train.lr"), sorted.
void keys(const nlohmann::json& json, const std::string& prefix, std::vector<std::string>& out) {
  for (const auto& [key, value] : json.items()) {
    if (value.is_object() && key != "model") {
      keys(value, prefix + key + ".", out);
    } else {
      out.push_back(prefix + key);
    }
  }
}

}  // namespace

TEST(Settings, SavedUnderTheCheckpointsKeys) {
  // trainer_state.json's "run" object: checkpoints written before the table still resume (and
  // those without a later setting's key, recompute, resume with its default).
  std::vector<std::string> saved;
  keys(run_to_json(RunConfig{}), "", saved);
  const std::vector<std::string> expected = {
      "batch",        "data.path",      "data.seed",          "data.synthetic_examples",
      "data.val_fraction", "eval_batches", "eval_every",      "exact_match_examples",
      "keep_checkpoints",  "micro_batches", "model",          "precision",       "recompute",
      "recompute_every",   "recompute_stages", "save_every",
      "seq_len",      "steps",          "train.beta1",        "train.beta2",
      "train.decay_embeddings", "train.eps", "train.grad_clip", "train.lr",
      "train.min_lr", "train.total_steps", "train.warmup_steps", "train.weight_decay"};
  EXPECT_EQ(saved, expected);
}

TEST(Settings, EverySavedSettingRoundTrips) {
  RunConfig c;
  c.model.d_model = 96;
  c.model.seed = 7;
  c.train.lr = 0.0123;
  c.train.beta2 = 0.99;
  c.train.decay_embeddings = true;
  c.data.path = "corpus.txt";
  c.data.seed = 5;
  c.data.val_fraction = 0.25;
  c.seq_len = 48;
  c.batch = 12;
  c.micro_batches = 3;
  c.steps = 77;
  c.eval_every = 9;
  c.exact_match_examples = 0;
  const RunConfig back = run_from_json(run_to_json(c));
  EXPECT_EQ(run_to_json(back), run_to_json(c));
  EXPECT_EQ(back.model.d_model, 96);
  EXPECT_EQ(back.model.seed, 7u);
  EXPECT_EQ(back.train.lr, 0.0123);
  EXPECT_EQ(back.train.beta2, 0.99);
  EXPECT_TRUE(back.train.decay_embeddings);
  EXPECT_EQ(back.data.path, "corpus.txt");
  EXPECT_EQ(back.data.val_fraction, 0.25);
  EXPECT_EQ(back.micro_batches, 3);
  EXPECT_EQ(back.eval_every, 9);
}

TEST(Settings, FlagsFillTheRunAndTheDefaultsThatFollowOthers) {
  const RunConfig c = from_flags({"--lr", "0.01", "--n-heads", "8", "--steps", "50",
                                  "--no-progress", "--lesson-kernels", "--tied", "--accum", "2"});
  EXPECT_EQ(c.train.lr, 0.01);
  EXPECT_EQ(c.model.n_heads, 8);
  EXPECT_EQ(c.model.n_kv_heads, 8);      // --n-kv-heads follows --n-heads
  EXPECT_EQ(c.train.total_steps, 50);    // --decay-steps follows --steps
  EXPECT_EQ(c.exact_match_examples, 100);  // the synthetic corpus
  EXPECT_EQ(c.model.rope_theta, 10000);  // the command line trains with rotary positions
  EXPECT_EQ(c.out_dir, "runs/ch03");
  EXPECT_TRUE(c.model.tied_embeddings);
  EXPECT_FALSE(c.progress);
  EXPECT_FALSE(c.fast);
  EXPECT_EQ(c.micro_batches, 2);
  EXPECT_EQ(c.train.warmup_steps, 20);
  const RunConfig short_run = from_flags({"--steps", "10", "--data", "corpus.txt"});
  EXPECT_EQ(short_run.train.warmup_steps, 1);  // a warm-up as long as the decay: a tenth
  EXPECT_EQ(short_run.exact_match_examples, 0);  // a data file: no exact-match prompts
  const RunConfig given = from_flags({"--n-kv-heads", "2", "--decay-steps", "40"});
  EXPECT_EQ(given.model.n_kv_heads, 2);
  EXPECT_EQ(given.train.total_steps, 40);
}

TEST(Settings, ResumeRefusesANewComputationAndKeepsTheRest) {
  RunConfig saved;
  saved.train.lr = 0.01;
  saved.eval_every = 7;
  saved.micro_batches = 2;
  saved.steps = 30;
  saved.out_dir = "elsewhere";
  ArgParser args("train", "test");
  // A setting that changes what the run computes is refused, each named with both values.
  RunConfig requested = from_flags({"--lr", "0.02", "--d-model", "64", "--out", "run"}, &args);
  EXPECT_TRUE(throws_error_containing(
      [&] { resume_from_flags(args, requested, saved); },
      "--lr 0.02 (the run has 0.01); --d-model 64 (the run has 128)"));
  // The same value typed again is no change.
  requested = from_flags({"--lr", "0.01", "--eval-batches", "3", "--steps", "99", "--out", "run"},
                         &args);
  const RunConfig resumed = resume_from_flags(args, requested, saved);
  EXPECT_EQ(resumed.train.lr, 0.01);
  EXPECT_EQ(resumed.train.total_steps, saved.train.total_steps);  // not --steps: the run's own
  EXPECT_EQ(resumed.eval_every, 7);     // kept, not given: the run's
  EXPECT_EQ(resumed.eval_batches, 3);   // kept, given: the flag's
  EXPECT_EQ(resumed.micro_batches, 2);  // kept, not given
  EXPECT_EQ(resumed.steps, 99);         // this invocation's
  EXPECT_EQ(resumed.out_dir, "run");
  // Without a command line (run_training): the run's computation, the request's conduct.
  const RunConfig merged = resume_with(saved, requested);
  EXPECT_EQ(merged.train.lr, 0.01);
  EXPECT_EQ(merged.micro_batches, requested.micro_batches);
  EXPECT_EQ(merged.eval_every, requested.eval_every);
  EXPECT_EQ(merged.steps, 99);
}
