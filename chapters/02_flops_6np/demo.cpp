// Chapter 02 demo: the FLOPs of a real training step, measured by the counter, next to the exact
// count and the 6N rule; then the step's speed as MFU against the matmul peak measured in this run.
//
//   ./build/bin/ch02_flops_6np_demo [--steps 3]

#include <cstdio>

#include "02_flops_6np/flops.h"
#include "fivefold/blas.h"
#include "fivefold/cli.h"
#include "fivefold/error.h"
#include "fivefold/runtime.h"
#include "fivefold/seed.h"
#include "fivefold/timer.h"

using namespace fivefold::ch02;

int main(int argc, char** argv) {
  fivefold::ArgParser args("ch02_flops_6np_demo",
                           "Measured vs analytic FLOPs of a training step, and MFU.");
  args.option("steps", "3", "timed forward+backward steps per model");
  try {
    if (!args.parse(argc, argv)) return 0;
    fivefold::Runtime runtime;
    const int steps = static_cast<int>(args.integer("steps"));
    FIVEFOLD_CHECK(steps >= 1, "--steps must be >= 1");
    struct Case {
      const char* name;
      TransformerShape shape;
      int64_t batch, seq;
    };
    const Case cases[] = {
        {"d64 L2 seq64 b4", {256, 64, 2, 4, 4, 16, 176}, 4, 64},
        {"d256 L4 seq256 b8", {256, 256, 4, 4, 4, 64, 688}, 8, 256},
        {"d256 L4 GQA(2) seq256", {256, 256, 4, 4, 2, 64, 688}, 8, 256},
    };
    const double peak = fivefold::measure_matmul_gflops(1024) * 1e9;
    std::printf("matmul peak measured now (1024^3 fp32, %d threads): %.1f GFLOP/s\n\n",
                torch::get_num_threads(), peak / 1e9);
    std::printf("%-24s %14s %14s %14s %8s %10s %8s\n", "model", "measured", "exact", "6N",
                "exact/6N", "GFLOP/s", "MFU");
    for (const auto& c : cases) {
      const auto weights = make_weights(c.shape, 0);
      auto tokens = torch::randint(c.shape.vocab_size, {c.batch, c.seq},
                                   fivefold::generator_for(0, "tokens"));
      auto step = [&] {
        auto logits = forward(c.shape, weights, tokens);
        torch::cross_entropy_loss(logits.view({-1, c.shape.vocab_size}), tokens.view({-1}))
            .backward();
      };
      double measured = 0;
      {
        FlopCounter counter;
        step();
        measured = counter.flops();
      }
      step();  // warm-up
      fivefold::Timer timer;
      for (int i = 0; i < steps; ++i) step();
      const double seconds = timer.seconds() / steps;
      const double n_tokens = static_cast<double>(c.batch * c.seq);
      const double exact = n_tokens * training_flops_per_token(c.shape, c.seq);
      const double six_n = n_tokens * six_n_flops_per_token(c.shape);
      std::printf("%-24s %14.0f %14.0f %14.0f %8.3f %10.1f %8.2f\n", c.name, measured, exact, six_n,
                  exact / six_n, measured / seconds / 1e9, measured / seconds / peak);
    }
    std::printf(
        "\nmeasured: matmul FLOPs LibTorch executed in one forward+backward (RecordFunction);\n"
        "exact: tokens x training_flops_per_token; MFU: measured FLOP/s over the matmul peak.\n");

    // Activation memory: what forward leaves alive for backward (counting allocator).
    std::printf("\n%-24s %16s %22s %12s\n", "model", "activations", "softmax outputs", "per token");
    for (const auto& c : cases) {
      auto tokens = torch::randint(c.shape.vocab_size, {c.batch, c.seq},
                                   fivefold::generator_for(0, "tokens"));
      const double bytes =
          static_cast<double>(measure_activation_bytes(c.shape, make_weights(c.shape, 0), tokens));
      // One fp32 [batch, heads, seq, seq] tensor per layer (test_ch02_shape checks it is exactly
      // that).
      const double scores = 4.0 * c.shape.n_layers * c.batch * c.shape.n_heads * c.seq * c.seq;
      std::printf("%-24s %13.2f MB %15.2f MB (%2.0f%%) %9.1f KB\n", c.name, bytes / 1e6,
                  scores / 1e6, 100 * scores / bytes, bytes / (c.batch * c.seq) / 1e3);
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
