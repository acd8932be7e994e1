#include "fivefold/blas.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "fivefold/log.h"
#include "fivefold/timer.h"

namespace fivefold {

BlasInfo detect_blas() {
  BlasInfo info;
  std::ifstream maps("/proc/self/maps");
  std::string line;
  while (std::getline(maps, line)) {
    const auto slash = line.find('/');
    if (slash == std::string::npos) continue;
    const std::string path = line.substr(slash);
    const std::string file = std::filesystem::path(path).filename().string();
    const bool blas_like =
        file.find("blas") != std::string::npos || file.find("mkl") != std::string::npos;
    if (!blas_like || file.find("cublas") != std::string::npos) continue;
    info.library = path;
    // Debian's reference BLAS lives in .../blas/libblas.so.3; OpenBLAS in .../openblas-*/.
    const bool optimised =
        path.find("openblas") != std::string::npos || path.find("mkl") != std::string::npos ||
        path.find("blis") != std::string::npos || path.find("atlas") != std::string::npos;
    info.reference = !optimised;
    if (optimised) break;  // prefer reporting the optimised one if several are mapped
  }
  return info;
}

double measure_matmul_gflops(int n, const MatrixProduct& mm) {
  torch::NoGradGuard no_grad;
  const MatrixProduct product =
      mm ? mm : [](const at::Tensor& a, const at::Tensor& b) { return torch::mm(a, b); };
  auto a = torch::randn({n, n});
  auto b = torch::randn({n, n});
  for (int i = 0; i < 2; ++i) product(a, b);  // warm-up: the library's threads and code
  // Best of 10, each result freed after its clock stops, so that the next product can write into
  // memory the allocator already holds, as in a training step. Keeping the last result alive
  // instead (c = product(a, b), best of 3) measured 225 GFLOP/s against 375 at n = 2048 in one
  // process (2026-12-04, oneDNN, 2 threads; likely fresh pages faulted in for every result), and
  // three tries were too few on a shared machine.
  double best = 0;
  for (int i = 0; i < 10; ++i) {
    Timer timer;
    const auto c = product(a, b);
    const double seconds = timer.seconds();
    best = std::max(best, 2.0 * n * n * n / seconds / 1e9);
  }
  return best;
}

void warn_if_reference_blas() {
  const BlasInfo info = detect_blas();
  if (!info.reference) return;
  log0(LogLevel::Warn) << "matrix multiply runs on the reference BLAS (" << info.library << ") at "
                       << measure_matmul_gflops(256)
                       << " GFLOP/s: about 15x slower than OpenBLAS. Install it: "
                          "sudo apt-get install libopenblas0-openmp (or run scripts/setup.sh)";
}

}  // namespace fivefold
