#pragma once
/// @file blas.h
/// @brief Startup check that matrix multiply does not run on the reference BLAS. Debian's LibTorch
/// reaches BLAS through the alternatives system; with only the reference library installed a
/// 1024^2 matmul runs ~15x slower (4 vs 62 GFLOP/s on 2 cores, measured here).

#include <string>

namespace fivefold {

/// Which BLAS library this process has loaded.
struct BlasInfo {
  std::string library;     ///< resolved path of the loaded libblas (empty if none found)
  bool reference = false;  ///< true when it is Netlib's reference BLAS
};

/// Reads /proc/self/maps to find the BLAS library in use (deterministic, unlike a timing).
BlasInfo detect_blas();

/// Times an n x n float matmul on the current torch threads; returns GFLOP/s (best of 3).
double measure_matmul_gflops(int n = 512);

/// Warns loudly (with the measured rate) if the reference BLAS is in use. Every program calls it at
/// startup through fivefold::Runtime.
void warn_if_reference_blas();

}  // namespace fivefold
