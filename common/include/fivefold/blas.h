#pragma once
/// @file blas.h
/// @brief Startup check that matrix multiply does not run on the reference BLAS. Debian's LibTorch
/// reaches BLAS through the alternatives system; with only the reference library installed a
/// 1024^2 matmul runs ~15x slower (4 vs 62 GFLOP/s on 2 cores, measured here).

#include <functional>
#include <string>

namespace at {
class Tensor;
}

namespace fivefold {

/// Which BLAS library this process has loaded.
struct BlasInfo {
  std::string library;     ///< resolved path of the loaded libblas (empty if none found)
  bool reference = false;  ///< true when it is Netlib's reference BLAS
};

/// Reads /proc/self/maps to find the BLAS library in use (deterministic, unlike a timing).
BlasInfo detect_blas();

/// A matrix product a [m, k] x b [k, n] -> [m, n].
using MatrixProduct = std::function<at::Tensor(const at::Tensor&, const at::Tensor&)>;

/// Times an n x n float product on the current torch threads; returns GFLOP/s (the best of 10
/// after 2 warm-up products). The product is `mm` when given (a library other than torch's own),
/// torch::mm otherwise.
double measure_matmul_gflops(int n = 512, const MatrixProduct& mm = {});

/// Warns loudly (with the measured rate) if the reference BLAS is in use. Every program calls it at
/// startup through fivefold::Runtime.
void warn_if_reference_blas();

}  // namespace fivefold
