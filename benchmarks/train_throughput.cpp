// Training throughput of chapter 03's model: tokens/s and MFU of a full optimizer step (forward,
// backward, clipping, AdamW) for a few sizes, with MFU taken against the matmul throughput
// measured in the same run (the machine's practical peak, not a datasheet figure).
//
//   build/bin/bench_train_throughput [--steps 20] [--threads 0] [--json] [--lesson-kernels]
//                                    [--compare] [--bf16] [--parts] [--profile] [--loops]
//                                    [--tiles] [--rope] [--shapes] [--precisions]
//
// The step is the training run's: with the fast paths (runtime/fast.h) unless
// --lesson-kernels asks for the lesson's code alone; --compare times both, alternating sizes.
//
// Run it alone, without OMP_WAIT_POLICY=passive: that setting (right for several processes
// sharing cores) makes a single process wait for its sleeping OpenMP threads at every operation.
//
// FLOPs per token come from chapter 02's formula, which test_ch03_model checks against the FLOPs
// LibTorch actually executes on this model.

#include <torch/csrc/autograd/profiler_legacy.h>

#include <algorithm>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "02_flops_6np/flops.h"
#include "04_rope/rope.h"
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

// Chapter 03's model at size `s` with its optimizer, as the training run sets them up: with the
// fast paths (runtime/fast.h) or the lesson's code alone; in bf16 (chapter 14's --precision bf16)
// the products in bf16 and the parameters and gradients in bf16 beside fp32 master weights.
// Also a batch of random tokens at the size's shape.
struct Bench {
  fivefold::ch03::ModelConfig config;
  fivefold::ch03::Transformer model{nullptr};
  fivefold::ch03::TrainConfig train;
  std::unique_ptr<fivefold::ch03::MasterWeights> masters;  // in bf16
  std::unique_ptr<torch::optim::AdamW> optimizer;
  fivefold::ch03::Batch batch;

  // The update after backward, as train_step does it: clipping, then AdamW; in bf16 both on the
  // masters, their gradients widened first.
  void update() {
    if (masters) masters->load_gradients();
    std::vector<torch::Tensor> stepped;
    for (const auto& [name, p] : fivefold::ch03::stepped_parameters(model, masters.get()))
      stepped.push_back(p);
    fivefold::ch03::clip_gradients(stepped, train.grad_clip);
    optimizer->step();
    if (masters) masters->store();
  }
};

Bench prepare(const Size& s, bool fast, bool bf16) {
  using namespace fivefold::ch03;
  Bench b;
  b.config.d_model = s.d_model;
  b.config.n_layers = s.n_layers;
  b.config.n_heads = b.config.n_kv_heads = s.n_heads;
  b.config.d_ff = s.d_ff;
  b.model = Transformer(b.config);
  if (fast) b.train.make_adamw = fivefold::runtime::fused_adamw;
  // The matmul kernel is process-wide: the lesson's step, timed after a fast one, unsets it.
  if (fast) fivefold::runtime::install_fast_paths(b.model); else set_matmul_kernel(nullptr);
  if (bf16) fivefold::ch14::use_precision(fivefold::ch14::Precision::Bf16, nullptr);
  if (bf16) b.masters = std::make_unique<MasterWeights>(b.model, torch::kBFloat16);
  b.optimizer = b.masters ? make_optimizer(b.masters->masters(), b.train)
                          : make_optimizer(b.model, b.train);
  auto tokens = torch::randint(b.config.vocab_size, {s.batch, s.seq + 1});
  b.batch = {tokens.narrow(1, 0, s.seq), tokens.narrow(1, 1, s.seq)};
  return b;
}

// Median seconds of a whole optimizer step, and of its parts, over `steps` steps after 3 warm-up
// steps. The parts are timed in separate steps (the same work) so that the whole is not disturbed.
struct Timing {
  double step, forward, backward, update;  // update: clipping + AdamW
};

Timing median_times(const Size& s, int64_t steps, bool fast, bool bf16 = false) {
  using namespace fivefold::ch03;
  Bench b = prepare(s, fast, bf16);
  std::vector<double> whole, forward, backward, update;
  for (int64_t i = 0; i < steps + 3; ++i) {
    fivefold::Timer timer;
    train_step(b.model, *b.optimizer, b.train, {b.batch}, i, b.masters.get());
    if (i >= 3) whole.push_back(timer.seconds());
  }
  for (int64_t i = 0; i < steps + 3; ++i) {
    b.optimizer->zero_grad();
    b.model->zero_grad();
    fivefold::Timer timer;
    auto loss = loss_of(b.model, b.batch);
    const double f = timer.seconds();
    loss.backward();
    const double fb = timer.seconds();
    b.update();
    if (i >= 3) {
      forward.push_back(f);
      backward.push_back(fb - f);
      update.push_back(timer.seconds() - fb);
    }
  }
  return {fivefold::median(whole), fivefold::median(forward), fivefold::median(backward),
          fivefold::median(update)};
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
  return fivefold::median(rates);
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
  Bench b = prepare(s, fast, bf16);
  BlockImpl& block = b.model->block(0);
  const auto positions = position_range(0, s.seq);
  const auto x = torch::randn({s.batch, s.seq, s.d_model}).requires_grad_(true);
  const auto targets = torch::randint(b.config.vocab_size, {s.batch, s.seq});
  auto median_ms = [&](const std::function<void()>& work) {
    std::vector<double> ms;
    for (int64_t i = 0; i < steps + 3; ++i) {
      fivefold::Timer timer;
      work();
      if (i >= 3) ms.push_back(timer.seconds() * 1e3);
    }
    return fivefold::median(ms);
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
  parts.push_back({"head + loss", median_ms([&] { b.model->loss(x, targets).backward(); }),
                   3 * 2 * tokens * d * static_cast<double>(b.config.vocab_size)});
  for (auto& p : b.model->parameters()) p.mutable_grad() = torch::randn_like(p) * 1e-3;
  parts.push_back({"clip + AdamW", median_ms([&] { b.update(); }), 0});
  return parts;
}

// Each operation's own time (its time less that of the operations it called) in ms a step and its
// calls a step, by name (with `shapes`, by name and its inputs' shapes): LibTorch's profiler
// around kProfiled steps after three warm-up ones.
struct OpTime {
  double ms = 0, calls = 0;
  bool product = false;  // a matrix product (mm, bmm: LibTorch's or fivefold's)
};
constexpr int kProfiled = 3;

// "name [2048, 256] [256, 704]": an operation and the shapes of its inputs.
std::string with_shapes(const torch::autograd::profiler::LegacyEvent& e) {
  std::string key = e.name();
  for (const auto& shape : e.shapes()) key += " " + c10::str(torch::IntArrayRef(shape));
  return key;
}

std::map<std::string, OpTime> profile_step(const Size& s, bool fast, bool bf16, bool shapes) {
  namespace profiler = torch::autograd::profiler;
  Bench b = prepare(s, fast, bf16);
  for (int i = 0; i < 3 + kProfiled; ++i) {
    if (i == 3)
      profiler::enableProfilerLegacy(torch::profiler::impl::ProfilerConfig(
          torch::profiler::impl::ProfilerState::CPU, /*report_input_shapes=*/shapes));
    fivefold::ch03::train_step(b.model, *b.optimizer, b.train, {b.batch}, i, b.masters.get());
  }
  std::map<std::string, OpTime> ops;
  for (const auto& events : profiler::disableProfilerLegacy()) {
    std::vector<std::pair<const profiler::LegacyEvent*, double>> open;  // and its callees' ms
    for (const auto& e : events) {
      if (e.kind() == profiler::EventKind::PushRange) {
        open.emplace_back(&e, 0.0);
      } else if (e.kind() == profiler::EventKind::PopRange && !open.empty()) {
        const auto [start, callees] = open.back();
        open.pop_back();
        const double ms = start->cpuElapsedUs(e) / 1e3;
        if (!open.empty()) open.back().second += ms;
        const std::string name = start->name();
        OpTime& op = ops[shapes ? with_shapes(*start) : name];
        const auto ends_with = [&name](const std::string& end) {
          return name.size() >= end.size() &&
                 name.compare(name.size() - end.size(), end.size(), end) == 0;
        };
        op.product = ends_with("::mm") || ends_with("::bmm");
        op.ms += (ms - callees) / kProfiled;
        op.calls += 1.0 / kProfiled;
      }
    }
  }
  return ops;
}

// --profile: per size, the operations that take most of a step (fp32, and bf16 beside with
// --bf16; with --shapes each operation by its inputs' shapes too), then the step's matrix
// products (mm, bmm) against everything else.
void print_profiles(const std::vector<Size>& sizes,
                    const std::shared_ptr<const fivefold::ch03::MatmulKernel>& kernel, bool fast,
                    bool bf16, bool shapes) {
  std::printf("threads %d; each operation's own time (less the operations it calls), ms a step, "
              "over %d steps after 3 warm-up ones (LibTorch's profiler, which adds its own "
              "overhead); %s\n",
              torch::get_num_threads(), kProfiled, fast ? "with the fast paths" : "the lesson's code");
  for (const Size& s : sizes) {
    // The products' kernel is process-wide: each fp32 step starts from the run's own again.
    fivefold::ch03::set_matmul_kernel(kernel);
    const auto fp32 = profile_step(s, fast, false, shapes);
    const auto narrow =
        bf16 ? profile_step(s, fast, true, shapes) : std::map<std::string, OpTime>{};
    fivefold::ch03::set_matmul_kernel(kernel);
    std::map<std::string, std::pair<OpTime, OpTime>> both;
    for (const auto& [name, t] : fp32) both[name].first = t;
    for (const auto& [name, t] : narrow) both[name].second = t;
    std::vector<std::pair<std::string, std::pair<OpTime, OpTime>>> rows(both.begin(), both.end());
    std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
      return a.second.first.ms + a.second.second.ms > b.second.first.ms + b.second.second.ms;
    });
    // With shapes, more rows and the name's end (where the shapes are) when it is too long.
    const int width = shapes ? 80 : 54;
    const size_t shown = shapes ? 40 : 15;
    std::printf("\n%-*s %9s %7s%s\n", width + 2, s.name, "fp32 ms", "calls",
                bf16 ? "   bf16 ms   calls" : "");
    double products[2] = {0, 0}, other[2] = {0, 0};
    for (size_t i = 0; i < rows.size(); ++i) {
      const auto& [name, t] = rows[i];
      const bool product = t.first.product || t.second.product;
      (product ? products : other)[0] += t.first.ms;
      (product ? products : other)[1] += t.second.ms;
      if (i >= shown) continue;
      const size_t cut = shapes && name.size() > size_t(width) ? name.size() - width : 0;
      std::printf("  %-*.*s %9.2f %7.0f", width, width, name.c_str() + cut, t.first.ms,
                  t.first.calls);
      if (bf16) std::printf(" %9.2f %7.0f", t.second.ms, t.second.calls);
      std::printf("\n");
    }
    std::printf("  %-*s %9.2f %7s", width, "matrix products (mm, bmm)", products[0], "");
    if (bf16) std::printf(" %9.2f", products[1]);
    std::printf("\n  %-*s %9.2f %7s", width, "everything else", other[0], "");
    if (bf16) std::printf(" %9.2f", other[1]);
    std::printf("\n");
  }
}

// The median ms of a training step of `b` under each of `variants` (each sets the step up its own
// way), the variants taking turns step by step on the one model after `warmup` rounds of them.
std::vector<double> alternating_step_ms(Bench& b, int64_t steps, int64_t warmup,
                                        const std::vector<std::function<void()>>& variants) {
  const auto n = static_cast<int64_t>(variants.size());
  std::vector<std::vector<double>> ms(variants.size());
  for (int64_t i = 0; i < n * (warmup + steps); ++i) {
    variants[i % n]();
    fivefold::Timer timer;
    fivefold::ch03::train_step(b.model, *b.optimizer, b.train, {b.batch}, i, b.masters.get());
    if (i >= n * warmup) ms[i % n].push_back(timer.seconds() * 1e3);
  }
  std::vector<double> medians;
  for (const auto& m : ms) medians.push_back(fivefold::median(m));
  return medians;
}

// Each size's step in fp32 and then in bf16, on one model per size and precision, under each of
// the variants `make` returns for it, alternating step by step (alternating_step_ms): a row per
// size and precision, its medians printed by `row` after the model and the precision.
template <typename Make, typename Row>
void alternate_each(const std::vector<Size>& sizes, int64_t steps, int64_t warmup,
                    const std::shared_ptr<const fivefold::ch03::MatmulKernel>& kernel,
                    const Make& make, const Row& row) {
  for (const Size& s : sizes) {
    for (const bool bf16 : {false, true}) {
      fivefold::ch03::set_matmul_kernel(kernel);  // process-wide: each size starts from fp32's
      Bench b = prepare(s, true, bf16);
      const auto ms = alternating_step_ms(b, steps, warmup, make(b));
      std::printf("%-22s %-9s", s.name, bf16 ? "bf16" : "fp32");
      row(ms);
    }
  }
  fivefold::ch03::set_matmul_kernel(kernel);
}

// --loops: each size's step with the fast paths' AVX-512 loops (runtime/src/avx512.cpp and
// rows.cpp: the attention tiles' softmax passes, SwiGLU, RMSNorm, RoPE) and with ATen's operations
// (the norm's plain loops) in their place, step by step alternately on one model, in fp32 and in
// bf16: the median ms of each.
void print_loops(const std::vector<Size>& sizes, int64_t steps,
                 const std::shared_ptr<const fivefold::ch03::MatmulKernel>& kernel) {
  using fivefold::runtime::set_avx512_loops;
  if (!fivefold::runtime::avx512_available()) {
    std::printf("this CPU has no AVX-512: the fast paths run ATen's operations alone\n");
    return;
  }
  std::printf(
      "threads %d; median step ms over %lld steps each way, alternating, after 3 warm-up "
      "steps each; with the fast paths\n\n%-22s %-9s %12s %12s %9s\n",
      torch::get_num_threads(), static_cast<long long>(steps), "model", "precision", "AVX-512 ms",
      "ATen ms", "speed-up");
  alternate_each(
      sizes, steps, 3, kernel,
      [](Bench&) -> std::vector<std::function<void()>> {
        return {[] { set_avx512_loops(true); }, [] { set_avx512_loops(false); }};
      },
      [](const std::vector<double>& ms) {
        std::printf(" %12.2f %12.2f %8.2fx\n", ms[0], ms[1], ms[1] / ms[0]);
      });
  set_avx512_loops(true);
}

// --tiles: each size's step with the tiled attention's queries in tiles of 64, 128 (the default)
// and 256, swapping the kernel step by step on one model, in fp32 and bf16: the median ms of each.
void print_tiles(const std::vector<Size>& sizes, int64_t steps,
                 const std::shared_ptr<const fivefold::ch03::MatmulKernel>& kernel) {
  const std::vector<int64_t> tiles = {64, 128, 256};
  std::printf(
      "threads %d; median step ms over %lld steps each, the tile sizes alternating step "
      "by step after a warm-up round; with the fast paths\n\n%-22s %-9s",
      torch::get_num_threads(), static_cast<long long>(steps), "model", "precision");
  for (int64_t tile : tiles) std::printf(" %9s %-4lld", "tile", static_cast<long long>(tile));
  std::printf("\n");
  alternate_each(
      sizes, steps, 1, kernel,
      [&tiles](Bench& b) {
        std::vector<std::function<void()>> variants;
        for (int64_t tile : tiles) {
          variants.push_back([&b, tile] {
            b.model->set_attention_kernel(
                std::make_shared<fivefold::runtime::TiledCausalAttentionKernel>(tile));
          });
        }
        return variants;
      },
      [](const std::vector<double>& ms) {
        for (double m : ms) std::printf(" %14.2f", m);
        std::printf("\n");
      });
}

// --rope: each size's step on the model with chapter 04's RoPE (the benchmark's model has no
// positions, as PyTorch's in run_vs_pytorch.sh has none), the lesson's RotaryEmbedding and the
// fast paths' FusedRotaryEmbedding swapped step by step on one model, in fp32 and in bf16.
void print_rope(const std::vector<Size>& sizes, int64_t steps,
                const std::shared_ptr<const fivefold::ch03::MatmulKernel>& kernel) {
  std::printf(
      "threads %d; median step ms over %lld steps each way, alternating, after 3 warm-up "
      "steps each; with the fast paths and RoPE (base 10000)\n\n%-22s %-9s %12s %12s %9s\n",
      torch::get_num_threads(), static_cast<long long>(steps), "model", "precision", "lesson ms",
      "fused ms", "speed-up");
  alternate_each(
      sizes, steps, 3, kernel,
      [](Bench& b) -> std::vector<std::function<void()>> {
        auto lesson = std::make_shared<const fivefold::ch04::RotaryEmbedding>(
            b.config.resolved_head_dim(), 10000.0);
        auto fused = std::make_shared<const fivefold::runtime::FusedRotaryEmbedding>(lesson);
        return {[&b, lesson] { b.model->set_position_encoding(lesson); },
                [&b, fused] { b.model->set_position_encoding(fused); }};
      },
      [](const std::vector<double>& ms) {
        std::printf(" %12.2f %12.2f %8.2fx\n", ms[0], ms[1], ms[0] / ms[1]);
      });
}

// --precisions: each size's step in fp32 and in bf16 (chapter 14's --precision bf16) on two
// models, alternating step by step, the process-wide matmul kernel swapped with them: the median
// ms of each and bf16's speed-up, a ratio the machine's swings reach both sides of alike.
void print_precisions(const std::vector<Size>& sizes, int64_t steps,
                      const std::shared_ptr<const fivefold::ch03::MatmulKernel>& kernel) {
  using fivefold::ch03::set_matmul_kernel;
  std::printf(
      "threads %d; median step ms over %lld steps each, alternating, after 3 warm-up steps "
      "each; with the fast paths\n\n%-22s %12s %12s %9s\n",
      torch::get_num_threads(), static_cast<long long>(steps), "model", "fp32 ms", "bf16 ms",
      "speed-up");
  for (const Size& s : sizes) {
    set_matmul_kernel(kernel);
    Bench fp32 = prepare(s, true, false);
    Bench bf16 = prepare(s, true, true);  // leaves chapter 14's bf16 kernel set
    const std::shared_ptr<const fivefold::ch03::MatmulKernel> kernels[2] = {
        set_matmul_kernel(kernel), kernel};  // bf16's, fp32's
    std::vector<double> ms[2];
    for (int64_t i = 0; i < 2 * (3 + steps); ++i) {
      Bench& b = i % 2 == 0 ? bf16 : fp32;
      set_matmul_kernel(kernels[i % 2]);
      fivefold::Timer timer;
      fivefold::ch03::train_step(b.model, *b.optimizer, b.train, {b.batch}, i / 2, b.masters.get());
      if (i >= 2 * 3) ms[i % 2].push_back(timer.seconds() * 1e3);
    }
    const double bf16_ms = fivefold::median(ms[0]), fp32_ms = fivefold::median(ms[1]);
    std::printf("%-22s %12.2f %12.2f %8.2fx\n", s.name, fp32_ms, bf16_ms, fp32_ms / bf16_ms);
  }
  set_matmul_kernel(kernel);
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
  args.flag("bf16",
            "time each size in bf16 too, right after fp32 (chapter 14's --precision "
            "bf16): its tokens/s and speed-up");
  args.flag("parts",
            "time each part of the step on its own instead (attention, MLP, norms, head + loss, "
            "clip + AdamW; forward and backward), with its GFLOP/s against the peak");
  args.flag("profile",
            "profile 3 steps of each size instead (LibTorch's profiler): the operations that take "
            "most of a step, each by its own time, and the matrix products against the rest; "
            "with --bf16 the bf16 step beside");
  args.flag("shapes", "with --profile: each operation by the shapes of its inputs too");
  args.flag("loops",
            "time each size's step with the fast paths' AVX-512 loops and with ATen's operations "
            "in their place instead, alternating step by step, in fp32 and bf16");
  args.flag("rope",
            "time each size's step with chapter 04's RoPE instead (the model has no positions "
            "otherwise), the lesson's and the fused one alternating step by step, in fp32 and "
            "bf16");
  args.flag("tiles",
            "time each size's step with the tiled attention's queries in tiles of 64, 128 and "
            "256 instead, alternating step by step, in fp32 and bf16");
  args.flag("precisions",
            "time each size's step in fp32 and in bf16 instead, on two models alternating step "
            "by step: bf16's speed-up over fp32 measured in one run");
  if (!args.parse(argc, argv)) return 0;
  fivefold::Runtime runtime;
  if (args.integer("threads") > 0)
    torch::set_num_threads(static_cast<int>(args.integer("threads")));

  // The practical peak: the best of square fp32 products on the same threads, on the library the
  // step multiplies with (oneDNN with the fast paths, at::mm for the lesson's code).
  const auto kernel = args.on("lesson-kernels") ? nullptr : fivefold::runtime::fast_matmul_kernel();
  fivefold::ch03::set_matmul_kernel(kernel);
  const double peak = std::max(fivefold::runtime::matmul_peak_gflops(1024),
                               fivefold::runtime::matmul_peak_gflops(2048)) *
                      1e9;
  const char* library = kernel != nullptr ? "oneDNN" : "at::mm";
  // With --bf16, the same for chapter 14's bf16 products (oneDNN's bf16 GEMM through at::mm).
  double bf16_peak = 0;
  if (args.on("bf16")) {
    fivefold::ch14::use_precision(fivefold::ch14::Precision::Bf16, nullptr);
    bf16_peak = std::max(fivefold::runtime::matmul_peak_gflops(1024),
                         fivefold::runtime::matmul_peak_gflops(2048)) *
                1e9;
    fivefold::ch03::set_matmul_kernel(kernel);
  }
  // Head dimension 32 for the smallest model, 64 (Llama's) for the others; d_ff = 8/3 d_model
  // rounded up to a multiple of 64.
  const std::vector<Size> sizes = {{"d64 L2 seq64 b4", 64, 2, 2, 192, 64, 4},
                                   {"d128 L4 seq128 b8", 128, 4, 2, 384, 128, 8},
                                   {"d256 L4 seq256 b8", 256, 4, 4, 704, 256, 8},
                                   {"d256 L4 seq256 b8 h8", 256, 4, 8, 704, 256, 8}};
  if (args.on("rope")) {
    print_rope(sizes, args.integer("steps"), kernel);
    return 0;
  }
  if (args.on("tiles")) {
    print_tiles(sizes, args.integer("steps"), kernel);
    return 0;
  }
  if (args.on("loops")) {
    print_loops(sizes, args.integer("steps"), kernel);
    return 0;
  }
  if (args.on("precisions")) {
    print_precisions(sizes, args.integer("steps"), kernel);
    return 0;
  }
  if (args.on("profile")) {
    print_profiles(sizes, kernel, !args.on("lesson-kernels"), args.on("bf16"), args.on("shapes"));
    return 0;
  }
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
        "threads %d, matmul peak %.1f GFLOP/s (%s, fp32, best of 1024^3 and 2048^3, in "
        "this run)",
        torch::get_num_threads(), peak / 1e9, library);
    if (bf16_peak > 0) std::printf(", %.1f in bf16", bf16_peak / 1e9);
    std::printf(
        ";\nlast columns: GFLOP/s of the model's own MLP matmul and attention-score "
        "bmm\n\n");
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
          "\"scores_bmm_gflops\":%.1f,\"lesson_tokens_per_s\":%.1f,\"bf16_tokens_per_s\":%.1f,"
          "\"bf16_peak_gflops\":%.1f}\n",
          s.name, static_cast<long long>(parameters), flops, seconds, t.forward, t.backward,
          t.update, tokens_per_s, mfu, peak / 1e9, mlp, scores,
          lesson > 0 ? static_cast<double>(s.batch * s.seq) / lesson : 0.0,
          bf16 > 0 ? static_cast<double>(s.batch * s.seq) / bf16 : 0.0, bf16_peak / 1e9);
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
  fivefold::restart_with_huge_pages(argv);  // as `fivefold train` runs (FIVEFOLD_HUGE_PAGES=0: not)
  return fivefold::run_guarded("bench_train_throughput", [&] { return run(argc, argv); });
}
