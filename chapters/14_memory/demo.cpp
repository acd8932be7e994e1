// Chapter 14 demo: one training step (forward and backward) of a Llama model with each kind of
// recomputation, at two sequence lengths: the activations alive when backward starts and the
// formula's share of them (the blocks'), the peak during the step, the time and the FLOPs.
//
//   ./build/bin/ch14_memory_demo [--seq 128,512] [--batch 2] [--repeats 3]

#include <cstdio>
#include <sstream>
#include <vector>

#include "02_flops_6np/flops.h"
#include "03_transformer/train.h"
#include "07_moe/moe.h"
#include "14_memory/plan.h"
#include "fivefold/cli.h"
#include "fivefold/error.h"
#include "fivefold/memory.h"
#include "fivefold/seed.h"
#include "fivefold/timer.h"

using namespace fivefold;
using namespace fivefold::ch14;

namespace {

void run(const std::vector<int64_t>& lengths, int64_t batch, int64_t repeats) {
  ch03::ModelConfig config;  // a Llama of d 256: 4 blocks, 8 heads of 32, 4 key/value heads
  config.d_model = 256;
  config.n_layers = 4;
  config.n_heads = 8;
  config.n_kv_heads = 4;
  config.d_ff = 688;
  config.rope_theta = 10000;
  std::printf("Llama d %lld, %lld blocks, %lld heads (%lld kv), d_ff %lld; %lld rows; lesson kernels\n\n",
              (long long)config.d_model, (long long)config.n_layers, (long long)config.n_heads,
              (long long)config.n_kv_heads, (long long)config.d_ff, (long long)batch);
  std::printf("%6s %-10s %14s %16s %14s %10s %12s\n", "seq", "recompute", "kept (MiB)",
              "blocks' formula", "peak (MiB)", "step (ms)", "GFLOP/step");
  const std::vector<std::pair<const char*, RecomputeConfig>> modes = {
      {"none", {}}, {"selective", {Recompute::Selective, 1}}, {"full", {Recompute::Full, 1}}};
  for (int64_t seq : lengths) {
    const auto tokens =
        torch::randint(0, config.vocab_size, {batch, seq}, generator_for(1, "tokens"));
    const ch03::Batch rows(tokens, tokens);
    for (const auto& [name, recompute] : modes) {
      ch03::Transformer model = ch07::make_model(config);
      apply_recompute(model, recompute);
      std::vector<double> times;
      int64_t kept = 0, peak = 0;
      double flops = 0;
      for (int64_t r = 0; r < repeats; ++r) {
        model->zero_grad();
        MemoryTracker memory;
        ch02::FlopCounter counter;
        Timer timer;
        auto loss = ch03::loss_of(model, rows);
        kept = memory.current_bytes();
        loss.backward();
        times.push_back(timer.seconds() * 1e3);
        peak = memory.peak_bytes();
        flops = counter.flops();
      }
      const double formula = static_cast<double>(
          config.n_layers * block_activation_bytes(config.shape(), batch, seq, recompute.mode));
      std::printf("%6lld %-10s %14.2f %16.2f %14.2f %10.1f %12.3f\n", (long long)seq, name,
                  kept / 1048576.0, formula / 1048576.0, peak / 1048576.0,
                  fivefold::median(times), flops / 1e9);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  ArgParser args("ch14_memory_demo", "one training step with and without recomputation");
  args.option("seq", "128,512", "sequence lengths, comma-separated");
  args.option("batch", "2", "rows");
  args.option("repeats", "3", "steps timed (the median is printed)");
  try {
    if (!args.parse(argc, argv)) return 0;
    const int64_t batch = args.integer("batch"), repeats = args.integer("repeats");
    FIVEFOLD_CHECK(batch >= 1 && repeats >= 1, "--batch and --repeats must be >= 1");
    std::vector<int64_t> lengths;
    std::stringstream list(args.str("seq"));
    for (std::string item; std::getline(list, item, ',');) lengths.push_back(std::stoll(item));
    run(lengths, batch, repeats);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}

