// Chapter 06 demo: what MLA's cache costs, by formula for DeepSeek-V3 and measured on a small
// model; how fast each attention decodes with its cache; and how MLA and multi-head attention
// learn on the same budget.
//
//   ./build/bin/ch06_mla_demo [--steps 300] [--decode 256]

#include <cstdio>

#include "03_transformer/generate.h"
#include "06_mla/mla.h"
#include "fivefold/cli.h"
#include "fivefold/runtime.h"
#include "fivefold/timer.h"
#include "runtime/run.h"

using namespace fivefold;
using namespace fivefold::ch03;
using namespace fivefold::runtime;

namespace {
// d_model 128, 4 layers, 4 heads of 32; MLA: a 32-wide latent, 16 rotary features, 32 per head.
ModelConfig small(bool mla) {
  ModelConfig c;
  c.d_model = 128;
  c.n_layers = 4;
  c.n_heads = c.n_kv_heads = 4;
  c.d_ff = 352;
  c.rope_theta = 10000;
  if (mla) {
    c.extensions = {{"q_lora_rank", 64},
                    {"kv_lora_rank", 32},
                    {"qk_nope_head_dim", 32},
                    {"qk_rope_head_dim", 16},
                    {"v_head_dim", 32}};
  }
  return c;
}
}  // namespace

int main(int argc, char** argv) {
  ArgParser args("ch06_mla_demo",
                 "MLA's cache by formula and measured, decoding speed, and learning against "
                 "multi-head attention.");
  args.option("steps", "300", "training steps for each model");
  args.option("decode", "256", "tokens generated when timing decoding");
  try {
    if (!args.parse(argc, argv)) return 0;
    Runtime runtime;

    // 1. The formula, DeepSeek-V3's dimensions: 61 layers, 128 heads of 128 (+64 rotary),
    //    d_c = 512; bf16 (2 bytes a number), a 128K-token context.
    const ch06::MlaConfig v3;
    const double per_layer_bytes = 61 * 2, tokens = 131072;
    std::printf("KV cache per token, DeepSeek-V3 dimensions (61 layers, bf16):\n");
    std::printf("  %-26s %10s %14s %16s\n", "scheme", "elements", "KB / token", "GB at 128K");
    const std::pair<const char*, int64_t> schemes[] = {
        {"MHA (128 heads)", ch06::kv_cache_elements_gqa(128, 128)},
        {"GQA (8 groups)", ch06::kv_cache_elements_gqa(8, 128)},
        {"MQA (1 group)", ch06::kv_cache_elements_gqa(1, 128)},
        {"MLA (d_c 512 + rope 64)", ch06::kv_cache_elements_mla(v3)}};
    for (const auto& [name, elements] : schemes) {
      const double bytes = static_cast<double>(elements) * per_layer_bytes;
      std::printf("  %-26s %10lld %14.1f %16.1f\n", name, static_cast<long long>(elements),
                  bytes / 1e3, bytes * tokens / 1e9);
    }

    // 2. Measured on a small model: cache bytes and decoding speed with the cache.
    std::printf("\nSmall model (d_model 128, 4 layers, 4 heads), %lld tokens decoded greedily:\n",
                static_cast<long long>(args.integer("decode")));
    std::printf("  %-34s %14s %14s %12s\n", "attention", "cache bytes", "per token", "tokens/s");
    const std::vector<int64_t> prompt{72, 101, 108, 108, 111};
    for (bool mla : {false, true}) {
      Transformer model = ch06::make_model(small(mla));
      torch::NoGradGuard no_grad;
      KVCache cache;
      model(torch::tensor(prompt).unsqueeze(0), &cache);
      const int64_t per_token = cache.bytes() / static_cast<int64_t>(prompt.size());
      Timer timer;
      const auto out = generate(model, prompt, args.integer("decode"));
      const double seconds = timer.seconds();
      std::printf("  %-34s %14lld %14lld %12.0f\n",
                  mla ? "MLA, absorbed, latent cache" : "MHA, keys and values cached",
                  static_cast<long long>(per_token * (static_cast<int64_t>(prompt.size()) +
                                                      static_cast<int64_t>(out.size()))),
                  static_cast<long long>(per_token), static_cast<double>(out.size()) / seconds);
    }

    // 3. The same budget, multi-head attention against MLA.
    std::printf("\nTraining %lld steps each on the synthetic corpus (16 x 64 tokens a step):\n",
                static_cast<long long>(args.integer("steps")));
    for (bool mla : {false, true}) {
      RunConfig c;
      c.model = small(mla);
      c.build_model = ch06::make_model;
      c.steps = c.train.total_steps = args.integer("steps");
      c.train.warmup_steps = std::min<int64_t>(c.train.warmup_steps, c.steps / 10);
      c.eval_every = 0;
      c.exact_match_examples = 200;
      c.progress = false;
      const RunResult r = run_training(c);
      int64_t params = 0;
      for (const auto& p : ch06::make_model(c.model)->parameters()) params += p.numel();
      std::printf("  %-34s params %8lld  held-out loss %.3f  exact match %.3f\n",
                  mla ? "MLA" : "MHA", static_cast<long long>(params), r.eval.loss,
                  r.exact.accuracy());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ch06_mla_demo: error: %s\n", e.what());
    return 1;
  }
}
