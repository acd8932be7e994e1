// Chapter 01 demo: the standard deviation of activations and gradients through a 48-layer network
// under each initialisation scheme, and of the residual stream of a 48-branch pre-norm stack with
// and without GPT-2's residual scaling. Every number is measured in this run.
//
//   ./build/ch01_weight_init_demo [--depth 48] [--width 256] [--batch 512] [--seed 0]

#include <cmath>
#include <cstdio>

#include "01_weight_init/weight_init.h"
#include "fivefold/cli.h"
#include "fivefold/error.h"
#include "fivefold/runtime.h"

using namespace fivefold::ch01;

int main(int argc, char** argv) {
  fivefold::ArgParser args("ch01_weight_init_demo",
                           "Activation and gradient scale with depth, per init scheme.");
  args.option("depth", "48", "layers").option("width", "256", "features per layer");
  args.option("batch", "512", "inputs").option("seed", "0", "global seed");
  try {
    if (!args.parse(argc, argv)) return 0;
    fivefold::Runtime runtime;
    const int64_t depth = args.integer("depth"), width = args.integer("width"),
                  batch = args.integer("batch");
    const auto seed = static_cast<uint64_t>(args.integer("seed"));
    FIVEFOLD_CHECK(depth >= 2 && width >= 1 && batch >= 2,
                   "need --depth >= 2, --width >= 1, --batch >= 2");

    struct Row {
      const char* label;
      InitSpec spec;
    };
    const Row rows[] = {
        {"LibTorch default U(+-1/sqrt(n)), relu", {Scheme::LibTorchDefault, Activation::ReLU}},
        {"Xavier/Glorot normal, relu", {Scheme::Xavier, Activation::ReLU}},
        {"Kaiming (variance-preserving), relu", {Scheme::Kaiming, Activation::ReLU}},
        {"fixed std 0.02, relu", {Scheme::FixedStd, Activation::ReLU, 0.02}},
        {"fixed std 0.1, relu", {Scheme::FixedStd, Activation::ReLU, 0.1}},
        {"Kaiming (variance-preserving), tanh", {Scheme::Kaiming, Activation::Tanh}},
        {"Kaiming (variance-preserving), silu", {Scheme::Kaiming, Activation::SiLU}},
        {"Kaiming, linear (no activation)", {Scheme::Kaiming, Activation::Linear}},
    };
    const int64_t marks[] = {1, depth / 4, depth / 2, depth};
    std::printf(
        "Deep MLP: %lld layers of %lld, batch %lld; std of layer outputs (a) and of weight "
        "gradients (g)\n\n",
        static_cast<long long>(depth), static_cast<long long>(width),
        static_cast<long long>(batch));
    std::printf("%-40s", "scheme");
    for (int64_t m : marks) std::printf("  a@%-8lld", static_cast<long long>(m));
    std::printf("  g@1        g@%-8lld\n", static_cast<long long>(depth));
    for (const auto& row : rows) {
      const auto profile = mlp_profile(depth, width, batch, row.spec, seed);
      std::printf("%-40s", row.label);
      for (int64_t m : marks) std::printf("  %-10.3g", profile.activation_std[m - 1]);
      std::printf("  %-10.3g %-10.3g\n", profile.gradient_std.front(), profile.gradient_std.back());
    }
    std::printf("\nE[f(y)^2] for y ~ N(0,1) and the gains: derived 1/sqrt(E[f^2]) vs LibTorch's\n");
    for (auto a : {Activation::Linear, Activation::ReLU, Activation::Tanh, Activation::SiLU}) {
      const double m = activation_second_moment(a);
      std::printf("  %-7s E[f^2] = %.4f   gain %.4f   LibTorch gain %.4f\n",
                  activation_name(a).c_str(), m, 1.0 / std::sqrt(m), libtorch_gain(a));
    }

    // Residual stream: each of `depth` branches adds variance 2·w²·σ_in²·σ_out² (notes/01).
    struct Stack {
      const char* label;
      InitSpec in, out;
    };
    InitSpec gpt2{Scheme::Gpt2, Activation::ReLU, 0.02, depth / 2};
    InitSpec gpt2_scaled = gpt2;
    gpt2_scaled.residual_projection = true;
    const Stack stacks[] = {
        {"LibTorch default", {Scheme::LibTorchDefault}, {Scheme::LibTorchDefault}},
        {"Xavier/Glorot", {Scheme::Xavier}, {Scheme::Xavier}},
        {"Kaiming (relu in, linear out)", {Scheme::Kaiming, Activation::ReLU}, {Scheme::Kaiming}},
        {"GPT-2 std 0.02, no scaling", gpt2, gpt2},
        {"GPT-2 with 0.02/sqrt(2 n_layer) out", gpt2, gpt2_scaled},
    };
    std::printf(
        "\nPre-norm residual stack, %lld branches h += W_out relu(W_in rmsnorm(h)): std of the "
        "residual\n"
        "stream (h) and of the W_in gradients (g)\n\n%-40s",
        static_cast<long long>(depth), "scheme");
    for (int64_t m : marks) std::printf("  h@%-8lld", static_cast<long long>(m));
    std::printf("  g@1        g@%-8lld\n", static_cast<long long>(depth));
    for (const auto& stack : stacks) {
      const auto profile = residual_profile(depth, width, batch, stack.in, stack.out, seed);
      std::printf("%-40s", stack.label);
      for (int64_t m : marks) std::printf("  %-10.4g", profile.activation_std[m - 1]);
      std::printf("  %-10.3g %-10.3g\n", profile.gradient_std.front(), profile.gradient_std.back());
    }
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
