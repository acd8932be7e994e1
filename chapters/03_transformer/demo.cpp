// Chapter 03 demo: train the baseline on the synthetic corpus, evaluate it, let it answer a few
// held-out prompts, and time generation with and without the KV cache.
//
//   ./build/bin/ch03_transformer_demo [--steps 300] [--out runs/ch03-demo]

#include <cstdio>
#include <filesystem>

#include "03_transformer/checkpoint.h"
#include "03_transformer/generate.h"
#include "fivefold/cli.h"
#include "fivefold/error.h"
#include "fivefold/runtime.h"
#include "fivefold/timer.h"
#include "runtime/run.h"

using namespace fivefold::ch03;
using namespace fivefold::runtime;

int main(int argc, char** argv) {
  fivefold::ArgParser args("ch03_transformer_demo",
                           "Trains chapter 03's transformer, evaluates it and generates from it.");
  args.option("steps", "300", "training steps");
  args.option("out", "runs/ch03-demo", "output folder (replaced)");
  try {
    if (!args.parse(argc, argv)) return 0;
    fivefold::Runtime runtime;
    RunConfig config;  // the defaults: d_model 128, 4 layers, 16 x 64 tokens a step
    config.steps = config.train.total_steps = args.integer("steps");
    config.train.warmup_steps = std::min<int64_t>(config.train.warmup_steps, config.steps / 10);
    config.out_dir = args.str("out");
    config.exact_match_examples = 200;
    config.eval_every = config.save_every = 100;
    std::filesystem::remove_all(config.out_dir);
    const RunResult run = run_training(config);

    std::printf("\nheld-out loss %.3f (uniform: 5.557; unigram entropy of the corpus: 3.55)\n",
                run.eval.loss);
    std::printf("exact match on 200 held-out prompts: %.3f  (", run.exact.accuracy());
    for (const auto& [task, n] : run.exact.total)
      std::printf(" %s %lld/%lld", task.c_str(), static_cast<long long>(run.exact.correct.at(task)),
                  static_cast<long long>(n));
    std::printf(" )\n\nheld-out prompts, greedy answers:\n");
    Transformer model = load_model(run.checkpoint);
    SamplingOptions greedy;
    greedy.stop_tokens = {'\n'};
    for (int64_t i = 0; i < 6; ++i) {
      const auto example = synthetic_example(config.data.seed, Split::HeldOut, i);
      auto answer = ByteTokenizer::decode(
          generate(model, ByteTokenizer::encode("\n" + example.prompt), 8, greedy));
      if (!answer.empty() && answer.back() == '\n') answer.pop_back();
      std::printf("  %-24s -> %-8s (expected %s)\n", example.prompt.c_str(), answer.c_str(),
                  example.answer.c_str());
    }

    // The KV cache: the same 256 tokens, one position per step instead of the whole sequence.
    const auto prompt = ByteTokenizer::encode("kv a3 b7 c1 ? b>");
    SamplingOptions cached, uncached;
    uncached.use_cache = false;
    fivefold::Timer timer;
    const auto with = generate(model, prompt, 256, cached);
    const double cached_s = timer.seconds();
    timer.reset();
    const auto without = generate(model, prompt, 256, uncached);
    const double uncached_s = timer.seconds();
    std::printf(
        "\n256 new tokens: %.2f s with the KV cache, %.2f s without (%.1fx); same tokens: %s\n",
        cached_s, uncached_s, uncached_s / cached_s, with == without ? "yes" : "NO");
    std::printf(
        "checkpoint: %s (try: build/bin/fivefold generate --checkpoint %s --prompt "
        "\"12+35=\")\n",
        run.checkpoint.c_str(), config.out_dir.c_str());
    return with == without ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ch03_transformer_demo: error: %s\n", e.what());
    return 1;
  }
}
