// `linear`'s products on oneDNN (fast.h, OneDnnMatmulKernel). dnnl_sgemm is row-major BLAS:
// C = op(A)·op(B) with op a transpose where asked, each matrix given by its first element and its
// leading dimension (the stride between rows as stored).
//
// This file is compiled with NDEBUG (CMakeLists.txt), as chapter 02's counter.cpp: RecordFunction
// has a debug-only member that the NDEBUG LibTorch library does not have.

#include <ATen/record_function.h>

#include <optional>
#include <utility>
#include <vector>

#include "03_transformer/fast.h"

#ifdef FIVEFOLD_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif

#include "fivefold/error.h"

namespace fivefold::ch03 {

#ifdef FIVEFOLD_HAVE_DNNL
namespace {

// How row-major sgemm reads t [rows, cols] in place: 'N' with the row stride when its rows are
// contiguous, 'T' with the column stride when its columns are (a transposed view), or nothing.
std::optional<std::pair<char, int64_t>> layout(const torch::Tensor& t) {
  const int64_t rows = t.size(0), cols = t.size(1);
  if (t.stride(1) == 1 && t.stride(0) >= cols) return std::make_pair('N', t.stride(0));
  if (t.stride(0) == 1 && t.stride(1) >= rows) return std::make_pair('T', t.stride(1));
  return std::nullopt;
}

}  // namespace

bool OneDnnMatmulKernel::available() { return true; }

torch::Tensor OneDnnMatmulKernel::mm(const torch::Tensor& a, const torch::Tensor& b) const {
  FIVEFOLD_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0),
                 "OneDnnMatmulKernel::mm: [m, k] x [k, n], got ", a.sizes(), " x ", b.sizes());
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  const bool fits = a.scalar_type() == torch::kFloat && b.scalar_type() == torch::kFloat &&
                    a.device().is_cpu() && b.device().is_cpu() && m > 0 && n > 0 && k > 0;
  if (!fits) return a.mm(b);
  RECORD_FUNCTION("fivefold::mm", std::vector<c10::IValue>({a, b}));
  auto la = layout(a), lb = layout(b);
  const auto da = la ? a : a.contiguous(), db = lb ? b : b.contiguous();
  if (!la) la = std::make_pair('N', k);
  if (!lb) lb = std::make_pair('N', n);
  auto c = torch::empty({m, n}, a.options());
  const auto status =
      dnnl_sgemm(la->first, lb->first, m, n, k, 1.0f, da.data_ptr<float>(), la->second,
                 db.data_ptr<float>(), lb->second, 0.0f, c.data_ptr<float>(), n);
  FIVEFOLD_CHECK(status == dnnl_success, "dnnl_sgemm failed (status ", static_cast<int>(status),
                 ") on [", m, ", ", k, "] x [", k, ", ", n, "]");
  return c;
}

#else

bool OneDnnMatmulKernel::available() { return false; }

torch::Tensor OneDnnMatmulKernel::mm(const torch::Tensor& a, const torch::Tensor& b) const {
  return a.mm(b);
}

#endif

}  // namespace fivefold::ch03
