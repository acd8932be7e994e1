// Chapter 04 demo: the same small model trained twice on the synthetic corpus, without positions
// (chapter 03) and with RoPE, then asked held-out prompts: what positions buy, measured.
//
//   ./build/bin/ch04_rope_demo [--steps 1500]

#include <cstdio>

#include "03_transformer/generate.h"
#include "04_rope/rope.h"
#include "fivefold/cli.h"
#include "fivefold/runtime.h"
#include "fivefold/timer.h"
#include "runtime/run.h"

using namespace fivefold::ch03;
using namespace fivefold::runtime;

namespace {
RunResult train(double rope_theta, int64_t steps) {
  RunConfig c;  // 2 layers of d_model 64, 16 x 64 tokens a step
  c.model.d_model = 64;
  c.model.n_layers = 2;
  c.model.n_heads = c.model.n_kv_heads = 2;
  c.model.d_ff = 192;
  c.model.rope_theta = rope_theta;
  c.build_model = fivefold::ch04::make_model;
  c.steps = c.train.total_steps = steps;
  c.train.warmup_steps = std::min<int64_t>(c.train.warmup_steps, steps / 10);
  c.eval_every = 0;
  c.exact_match_examples = 200;
  return run_training(c);
}
}  // namespace

int main(int argc, char** argv) {
  fivefold::ArgParser args("ch04_rope_demo",
                           "Trains the same model without and with RoPE and compares what each "
                           "answers on held-out prompts.");
  args.option("steps", "1500", "training steps for each model");
  try {
    if (!args.parse(argc, argv)) return 0;
    fivefold::Runtime runtime;
    const int64_t steps = args.integer("steps");
    fivefold::Timer timer;
    const RunResult nope = train(0, steps);
    const RunResult rope = train(10000, steps);

    std::printf("\n%-22s %10s %8s %8s %8s %8s %8s\n", "model (140 K params)", "held-out", "add",
                "copy", "reverse", "recall", "all");
    for (const auto& [name, r] : {std::pair<const char*, const RunResult&>{"no positions", nope},
                                  {"RoPE (base 10000)", rope}}) {
      std::printf("%-22s %10.3f", name, r.eval.loss);
      for (const char* task : {"add", "copy", "reverse", "recall"}) {
        std::printf(" %4lld/%-3lld", static_cast<long long>(r.exact.correct.at(task)),
                    static_cast<long long>(r.exact.total.at(task)));
      }
      std::printf(" %8.3f\n", r.exact.accuracy());
    }
    std::printf(
        "\nexact match on 200 held-out prompts after %lld steps each (%.0f s in all); chance: "
        "recall 1/10, add ~1/100, copy and reverse < 26^-3\n",
        static_cast<long long>(steps), timer.seconds());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ch04_rope_demo: error: %s\n", e.what());
    return 1;
  }
}
