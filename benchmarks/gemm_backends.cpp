// The products of a training step's linear layers on two BLAS libraries, side by side in one run:
// OpenBLAS (what LibTorch's mm calls on Debian) and oneDNN's dnnl_sgemm (libdnnl, which Debian's
// LibTorch also links). For each size of bench_train_throughput, every linear map of the step
// (q, k, v, o, gate, up, down in each layer; the head), forward y = x·Wᵀ and backward
// dx = dy·W and dW = dyᵀ·x, timed on each library in alternating rounds (medians), summed over the
// step. It answers one question before any code depends on it: would a linear layer on oneDNN
// make the step faster? (Built only where libdnnl-dev is installed: scripts/setup.sh
// --benchmarks.)
//
//   build/bin/bench_gemm_backends [--rounds 7] [--threads 0]

#include <oneapi/dnnl/dnnl.h>

#include <algorithm>
#include <cstdio>
#include <vector>

#include "fivefold/cli.h"
#include "fivefold/error.h"
#include "fivefold/runtime.h"
#include "fivefold/timer.h"

namespace {

struct Size {
  const char* name;
  int64_t d_model, n_layers, d_ff, tokens;  // tokens: batch x seq
};

// C [m, n] = op(A)·op(B), op a transpose where asked; A stored as op(A) is [m, k], B as [k, n].
struct Product {
  int64_t m, n, k;
  bool trans_a, trans_b;
  int64_t count;  // how many of it a step computes
};

// The three products of a linear map in -> out over `tokens` rows, `count` of them a step.
void add_linear(std::vector<Product>& p, int64_t tokens, int64_t in, int64_t out, int64_t count) {
  p.push_back({tokens, out, in, false, true, count});  // y = x·Wᵀ
  p.push_back({tokens, in, out, false, false, count});  // dx = dy·W
  p.push_back({out, in, tokens, true, false, count});   // dW = dyᵀ·x
}

// Median seconds of one product on each library, in `rounds` alternating rounds.
std::pair<double, double> time_product(const Product& p, int64_t rounds) {
  // Stored shapes: A is [k, m] when transposed, B is [n, k] when transposed.
  const auto a = p.trans_a ? torch::randn({p.k, p.m}) : torch::randn({p.m, p.k});
  const auto b = p.trans_b ? torch::randn({p.n, p.k}) : torch::randn({p.k, p.n});
  auto c = torch::empty({p.m, p.n});
  const auto op_a = p.trans_a ? a.t() : a, op_b = p.trans_b ? b.t() : b;
  const double flops = 2.0 * static_cast<double>(p.m * p.n * p.k);
  const int reps = static_cast<int>(std::max(3.0, 2e8 / flops));
  std::vector<double> blas, dnnl;
  for (int64_t r = 0; r < rounds; ++r) {
    fivefold::Timer t;
    for (int i = 0; i < reps; ++i) at::mm_out(c, op_a, op_b);
    blas.push_back(t.seconds() / reps);
    fivefold::Timer u;
    for (int i = 0; i < reps; ++i) {
      const auto status = dnnl_sgemm(p.trans_a ? 'T' : 'N', p.trans_b ? 'T' : 'N', p.m, p.n, p.k,
                                     1.0f, a.data_ptr<float>(), a.size(1), b.data_ptr<float>(),
                                     b.size(1), 0.0f, c.data_ptr<float>(), p.n);
      FIVEFOLD_CHECK(status == dnnl_success, "dnnl_sgemm failed with status ", status);
    }
    dnnl.push_back(u.seconds() / reps);
  }
  // Both libraries computed the same product (the last one written is oneDNN's).
  FIVEFOLD_CHECK(torch::allclose(c, at::mm(op_a, op_b), 1e-4, 1e-3),
                 "oneDNN's product differs from OpenBLAS's at [", p.m, ", ", p.n, ", ", p.k, "]");
  return {fivefold::median(blas), fivefold::median(dnnl)};
}

}  // namespace

int main(int argc, char** argv) {
  return fivefold::run_guarded("bench_gemm_backends", [&] {
    fivefold::ArgParser args("bench_gemm_backends",
                             "Times a training step's linear-layer products on OpenBLAS (LibTorch's "
                             "mm) and on oneDNN (dnnl_sgemm), alternating, and prints both sums.");
    args.option("rounds", "7", "alternating rounds per product (medians)");
    args.option("threads", "0", "torch and OpenMP threads (0: LibTorch's default)");
    if (!args.parse(argc, argv)) return 0;
    fivefold::Runtime runtime;
    const int64_t rounds = args.integer("rounds");
    FIVEFOLD_CHECK(rounds >= 1, "--rounds must be >= 1, got ", rounds);
    if (args.integer("threads") > 0)
      torch::set_num_threads(static_cast<int>(args.integer("threads")));
    torch::manual_seed(0);
    // bench_train_throughput's sizes (vocabulary 259).
    const std::vector<Size> sizes = {{"d64 L2 seq64 b4", 64, 2, 192, 256},
                                     {"d128 L4 seq128 b8", 128, 4, 384, 1024},
                                     {"d256 L4 seq256 b8", 256, 4, 704, 2048}};
    std::printf("%d threads; linear-layer products of one training step, forward and backward\n\n",
                torch::get_num_threads());
    std::printf("| model | OpenBLAS (LibTorch's mm) | oneDNN (dnnl_sgemm) | OpenBLAS / oneDNN |\n"
                "|---|---:|---:|---:|\n");
    for (const Size& s : sizes) {
      std::vector<Product> products;
      add_linear(products, s.tokens, s.d_model, s.d_model, 4 * s.n_layers);  // q, k, v, o
      add_linear(products, s.tokens, s.d_model, s.d_ff, 2 * s.n_layers);     // gate, up
      add_linear(products, s.tokens, s.d_ff, s.d_model, s.n_layers);         // down
      add_linear(products, s.tokens, s.d_model, 259, 1);                      // head
      double blas = 0, dnnl = 0;
      for (const Product& p : products) {
        const auto [b, d] = time_product(p, rounds);
        blas += static_cast<double>(p.count) * b;
        dnnl += static_cast<double>(p.count) * d;
      }
      std::printf("| %s | %.2f ms | %.2f ms | %.2fx |\n", s.name, 1e3 * blas, 1e3 * dnnl,
                  blas / dnnl);
    }
    return 0;
  });
}
