// Training throughput of chapter 03's model: tokens/s and MFU of a full optimizer step (forward,
// backward, clipping, AdamW) for a few sizes, with MFU taken against the matmul throughput
// measured in the same run (the machine's practical peak, not a datasheet figure).
//
//   build/bin/bench_train_throughput [--steps 20] [--threads 0] [--json] [--lesson-kernels]
//                                    [--compare] [--bf16] [--parts]
//
// The step is the training run's: with the fast paths (runtime/fast.h) unless
// --lesson-kernels asks for the lesson's code alone; --compare times both, alternating sizes.
//
// Run it alone, without OMP_WAIT_POLICY=passive: that setting (right for several processes
// sharing cores) makes a single process wait for its sleeping OpenMP threads at every operation.
//
// FLOPs per token come from chapter 02's formula, which test_ch03_model checks against the FLOPs
// LibTorch actually executes on this model.

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "02_flops_6np/flops.h"
#include "14_memory/precision.h"
#include "runtime/fast.h"
#include "03_transformer/train.h"
#include "fivefold/blas.h"
#include "fivefold/cli.h"
#include "fivefold/runtime.h"
#include "fivefold/timer.h"

namespace {

struct Size {
  const char* name;
  int64_t d_model, n_layers, n_heads, d_ff, seq, batch;
};

// Median seconds of a whole optimizer step, and of its parts, over `steps` steps after 3 warm-up
// steps. The parts are timed in separate steps (the same work) so that the whole is not disturbed.
struct Timing {
  double step, forward, backward, update;  // update: clipping + AdamW
};

Timing median_times(const Size& s, int64_t steps, bool fast, bool bf16 = false) {
  using namespace fivefold::ch03;
  using namespace fivefold::runtime;
  ModelConfig config;
  config.d_model = s.d_model;
  config.n_layers = s.n_layers;
  config.n_heads = config.n_kv_heads = s.n_heads;
  config.d_ff = s.d_ff;
  Transformer model(config);
  TrainConfig train;
  if (fast) train.make_adamw = fused_adamw;
  // The matmul kernel is process-wide: the lesson's step, timed after a fast one, unsets it.
  if (fast) install_fast_paths(model); else set_matmul_kernel(nullptr);
  // Chapter 14: the products in bf16, and as the trainer keeps them the parameters and gradients
  // in bf16 beside fp32 master weights.
  if (bf16) fivefold::ch14::use_precision(fivefold::ch14::Precision::Bf16, nullptr);
  const auto masters =
      bf16 ? std::make_unique<MasterWeights>(model, torch::kBFloat16) : nullptr;
  auto optimizer =
      masters ? make_optimizer(masters->masters(), train) : make_optimizer(model, train);
  auto tokens = torch::randint(config.vocab_size, {s.batch, s.seq + 1});
  const Batch batch{tokens.narrow(1, 0, s.seq), tokens.narrow(1, 1, s.seq)};
  std::vector<double> whole, forward, backward, update;
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  for (int64_t i = 0; i < steps + 3; ++i) {
    fivefold::Timer timer;
    train_step(model, *optimizer, train, {batch}, i, masters.get());
    if (i >= 3) whole.push_back(timer.seconds());
  }
  for (int64_t i = 0; i < steps + 3; ++i) {
    optimizer->zero_grad();
    model->zero_grad();
    fivefold::Timer timer;
    auto loss = loss_of(model, batch);
    const double f = timer.seconds();
    loss.backward();
    const double b = timer.seconds();
    clip_gradients(model, train.grad_clip);
    if (masters) masters->load_gradients();
    optimizer->step();
    if (masters) masters->store();
    if (i >= 3) {
      forward.push_back(f);
      backward.push_back(b - f);
      update.push_back(timer.seconds() - b);
    }
  }
  return {median(whole), median(forward), median(backward), median(update)};
}

// GFLOP/s of one product [m, k] x [k, n] repeated `batch` times (bmm when batch > 1): the median
// of 10 back-to-back runs, each into a fresh output as in the model. Shows what BLAS sustains at
// the model's own shapes, against the square-matrix peak; a single product on `kernel` when given.
double product_gflops(const fivefold::ch03::MatmulKernel* kernel, int64_t batch, int64_t m,
                      int64_t k, int64_t n) {
  auto a = torch::randn({batch, m, k}), b = torch::randn({batch, k, n});
  auto c = torch::bmm(a, b);
  std::vector<double> rates;
  for (int i = 0; i < 10; ++i) {
    fivefold::Timer timer;
    c = batch > 1 ? torch::bmm(a, b) : kernel ? kernel->mm(a[0], b[0]) : torch::mm(a[0], b[0]);
    rates.push_back(2.0 * static_cast<double>(batch * m * k * n) / timer.seconds() / 1e9);
  }
  std::sort(rates.begin(), rates.end());
  return rates[rates.size() / 2];
}

// One part of the step on its own, forward and backward, at the model's shapes: median ms over
// `steps` runs, and its matmul FLOPs (forward x 3, chapter 02's accounting; attention's scores
// counted in full as chapter 02 counts them, though the tiled kernel computes about half).
struct Part {
  const char* name;
  double ms, flops;
};

std::vector<Part> time_parts(const Size& s, int64_t steps, bool fast, bool bf16 = false) {
  using namespace fivefold::ch03;
  using namespace fivefold::runtime;
  ModelConfig config;
  config.d_model = s.d_model;
  config.n_layers = s.n_layers;
  config.n_heads = config.n_kv_heads = s.n_heads;
  config.d_ff = s.d_ff;
  Transformer model(config);
  if (fast) install_fast_paths(model); else set_matmul_kernel(nullptr);
  if (bf16) fivefold::ch14::use_precision(fivefold::ch14::Precision::Bf16, nullptr);
  TrainConfig train;
  if (fast) train.make_adamw = fused_adamw;
  const auto masters =
      bf16 ? std::make_unique<MasterWeights>(model, torch::kBFloat16) : nullptr;
  auto optimizer =
      masters ? make_optimizer(masters->masters(), train) : make_optimizer(model, train);
  BlockImpl& block = model->block(0);
  const auto positions = position_range(0, s.seq);
  const auto x = torch::randn({s.batch, s.seq, s.d_model}).requires_grad_(true);
  const auto targets = torch::randint(config.vocab_size, {s.batch, s.seq});
  auto median_ms = [&](const std::function<void()>& work) {
    std::vector<double> ms;
    for (int64_t i = 0; i < steps + 3; ++i) {
      fivefold::Timer timer;
      work();
      if (i >= 3) ms.push_back(timer.seconds() * 1e3);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2];
  };
  const double tokens = static_cast<double>(s.batch * s.seq), d = static_cast<double>(s.d_model);
  const double f = static_cast<double>(s.d_ff), seq = static_cast<double>(s.seq);
  const double layers = static_cast<double>(s.n_layers);
  std::vector<Part> parts;
  parts.push_back({"attention", layers * median_ms([&] {
                     block.self_attn->forward(x, positions, nullptr).sum().backward();
                   }),
                   layers * 3 * (2 * tokens * 4 * d * d + 4 * tokens * seq * d)});
  parts.push_back({"MLP", layers * median_ms([&] { block.mlp->forward(x).sum().backward(); }),
                   layers * 3 * 2 * tokens * 3 * d * f});
  parts.push_back({"norms", (2 * layers + 1) * median_ms([&] {
                     block.input_layernorm->forward(x).sum().backward();
                   }),
                   0});
  parts.push_back({"head + loss", median_ms([&] { model->loss(x, targets).backward(); }),
                   3 * 2 * tokens * d * static_cast<double>(config.vocab_size)});
  for (auto& p : model->parameters()) p.mutable_grad() = torch::randn_like(p) * 1e-3;
  parts.push_back({"clip + AdamW", median_ms([&] {
                     clip_gradients(model, train.grad_clip);
                     if (masters) masters->load_gradients();
                     optimizer->step();
                     if (masters) masters->store();
                   }),
                   0});
  return parts;
}

}  // namespace

namespace {
int run(int argc, char** argv) {
  fivefold::ArgParser args("bench_train_throughput",
                           "Tokens/s and MFU of chapter 03's training step for three model sizes.");
  args.option("steps", "20", "timed steps per size (after 3 warm-up steps)");
  args.option("threads", "0", "torch threads (0: LibTorch's default)");
  args.flag("json", "print JSON lines instead of a table");
  args.flag("lesson-kernels", "the lesson's code alone, without the fast paths (fast.h)");
  args.flag("compare", "time the lesson's code too: its tokens/s and the fast paths' speed-up");
  args.flag("bf16", "time each size in bf16 too, right after fp32 (chapter 14's --precision "
            "bf16): its tokens/s and speed-up");
  args.flag("parts",
            "time each part of the step on its own instead (attention, MLP, norms, head + loss, "
            "clip + AdamW; forward and backward), with its GFLOP/s against the peak");
  if (!args.parse(argc, argv)) return 0;
  fivefold::Runtime runtime;
  if (args.integer("threads") > 0)
    torch::set_num_threads(static_cast<int>(args.integer("threads")));

  // The practical peak: the best of square fp32 products on the same threads, on the library the
  // step multiplies with (oneDNN with the fast paths, at::mm for the lesson's code).
  const auto kernel = args.on("lesson-kernels") ? nullptr : fivefold::runtime::fast_matmul_kernel();
  fivefold::ch03::set_matmul_kernel(kernel);
  const double peak =
      std::max(fivefold::ch03::matmul_peak_gflops(1024), fivefold::ch03::matmul_peak_gflops(2048)) *
      1e9;
  const char* library = kernel != nullptr ? "oneDNN" : "at::mm";
  // Head dimension 32 for the smallest model, 64 (Llama's) for the others; d_ff = 8/3 d_model
  // rounded up to a multiple of 64.
  const std::vector<Size> sizes = {{"d64 L2 seq64 b4", 64, 2, 2, 192, 64, 4},
                                   {"d128 L4 seq128 b8", 128, 4, 2, 384, 128, 8},
                                   {"d256 L4 seq256 b8", 256, 4, 4, 704, 256, 8},
                                   {"d256 L4 seq256 b8 h8", 256, 4, 8, 704, 256, 8}};
  if (args.on("parts")) {
    std::printf("threads %d, matmul peak %.1f GFLOP/s (%s); each part forward + backward on its "
                "own, summed over the step's layers; %s\n\n",
                torch::get_num_threads(), peak / 1e9, library,
                args.on("lesson-kernels") ? "the lesson's code" : "with the fast paths");
    const bool bf16 = args.on("bf16");  // each part again in bf16, right after: ms and ratio
    std::printf("%-22s %-13s %9s %9s %8s%s\n", "model", "part", "ms/step", "GFLOP/s", "of peak",
                bf16 ? "   bf16 ms  fp32/bf16" : "");
    for (const Size& s : sizes) {
      double total = 0, total_bf16 = 0;
      const bool fast = !args.on("lesson-kernels");
      const auto parts = time_parts(s, args.integer("steps"), fast);
      std::vector<Part> parts_bf16;
      if (bf16) parts_bf16 = time_parts(s, args.integer("steps"), fast, true);
      fivefold::ch03::set_matmul_kernel(kernel);
      for (size_t i = 0; i < parts.size(); ++i) {
        const Part& p = parts[i];
        total += p.ms;
        if (p.flops > 0) {
          const double rate = p.flops / (p.ms * 1e-3) / 1e9;
          std::printf("%-22s %-13s %9.2f %9.0f %7.0f%%", s.name, p.name, p.ms, rate,
                      100 * rate * 1e9 / peak);
        } else {
          std::printf("%-22s %-13s %9.2f %9s %8s", s.name, p.name, p.ms, "-", "-");
        }
        if (bf16) {
          total_bf16 += parts_bf16[i].ms;
          std::printf(" %9.2f %9.2fx", parts_bf16[i].ms, p.ms / parts_bf16[i].ms);
        }
        std::printf("\n");
      }
      std::printf("%-22s %-13s %9.2f", s.name, "sum of parts", total);
      if (bf16) std::printf(" %28.2f %9.2fx", total_bf16, total / total_bf16);
      std::printf("\n");
    }
    return 0;
  }
  if (!args.on("json")) {
    std::printf(
        "threads %d, matmul peak %.1f GFLOP/s (%s, fp32, best of 1024^3 and 2048^3, in this "
        "run);\nlast columns: GFLOP/s of the model's own MLP matmul and attention-score bmm\n\n",
        torch::get_num_threads(), peak / 1e9, library);
    std::printf("%-22s %11s %12s %9s %22s %10s %6s %9s %9s%s%s\n", "model", "parameters",
                "MFLOP/token", "step ms", "fwd / bwd / update ms", "tokens/s", "MFU", "MLP mm",
                "QK^T bmm", args.on("compare") ? "  vs lesson" : "",
                args.on("bf16") ? "  bf16 tok/s  x fp32" : "");
  }
  for (const Size& s : sizes) {
    fivefold::ch02::TransformerShape shape;
    shape.vocab_size = 259;
    shape.d_model = s.d_model;
    shape.n_layers = s.n_layers;
    shape.n_heads = shape.n_kv_heads = s.n_heads;
    shape.head_dim = s.d_model / s.n_heads;
    shape.d_ff = s.d_ff;
    shape.gated_mlp = true;
    shape.biases = shape.layer_norm = false;
    const double flops = fivefold::ch02::training_flops_per_token(shape, s.seq);
    const Timing t = median_times(s, args.integer("steps"), !args.on("lesson-kernels"));
    // The lesson's step on the same size, right after (with --compare): the fast paths' gain.
    const double lesson =
        args.on("compare") ? median_times(s, args.integer("steps"), false).step : 0.0;
    // The same step with bf16 products, right after (with --bf16).
    const double bf16 =
        args.on("bf16")
            ? median_times(s, args.integer("steps"), !args.on("lesson-kernels"), true).step
            : 0.0;
    fivefold::ch03::set_matmul_kernel(kernel);
    const double seconds = t.step;
    const double tokens_per_s = static_cast<double>(s.batch * s.seq) / seconds;
    const double mfu = fivefold::ch02::model_flops_utilization(tokens_per_s, flops, peak);
    const auto parameters = fivefold::ch02::count_parameters(shape).total;
    // GFLOP/s at the model's shapes: the MLP's up projection, and attention's scores.
    const double mlp = product_gflops(kernel.get(), 1, s.batch * s.seq, s.d_model, s.d_ff);
    const double scores = product_gflops(nullptr, s.batch * s.n_heads, s.seq, shape.head_dim, s.seq);
    if (args.on("json")) {
      std::printf(
          "{\"model\":\"%s\",\"parameters\":%lld,\"flops_per_token\":%.0f,\"step_s\":%.6f,"
          "\"forward_s\":%.6f,\"backward_s\":%.6f,\"update_s\":%.6f,"
          "\"tokens_per_s\":%.1f,\"mfu\":%.4f,\"peak_gflops\":%.1f,\"mlp_mm_gflops\":%.1f,"
          "\"scores_bmm_gflops\":%.1f,\"lesson_tokens_per_s\":%.1f,\"bf16_tokens_per_s\":%.1f}\n",
          s.name, static_cast<long long>(parameters), flops, seconds, t.forward, t.backward,
          t.update, tokens_per_s, mfu, peak / 1e9, mlp, scores,
          lesson > 0 ? static_cast<double>(s.batch * s.seq) / lesson : 0.0,
          bf16 > 0 ? static_cast<double>(s.batch * s.seq) / bf16 : 0.0);
    } else {
      char parts[64];
      std::snprintf(parts, sizeof(parts), "%.1f / %.1f / %.1f", t.forward * 1e3, t.backward * 1e3,
                    t.update * 1e3);
      std::printf("%-22s %11lld %12.2f %9.2f %22s %10.0f %6.2f %9.0f %9.0f", s.name,
                  static_cast<long long>(parameters), flops / 1e6, seconds * 1e3, parts,
                  tokens_per_s, mfu, mlp, scores);
      if (lesson > 0) std::printf(" %10.2fx", lesson / seconds);
      if (bf16 > 0) std::printf(" %10.0f %6.2fx", static_cast<double>(s.batch * s.seq) / bf16, seconds / bf16);
      std::printf("\n");
    }
  }
  return 0;
}
}  // namespace

int main(int argc, char** argv) {
  return fivefold::run_guarded("bench_train_throughput", [&] { return run(argc, argv); });
}
