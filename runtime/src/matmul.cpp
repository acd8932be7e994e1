// `linear`'s products on oneDNN (fast.h, OneDnnMatmulKernel). dnnl_sgemm is row-major BLAS:
// C = op(A)·op(B) with op a transpose where asked, each matrix given by its first element and its
// leading dimension (the stride between rows as stored).
//
// This file is compiled with NDEBUG (CMakeLists.txt), as chapter 02's counter.cpp: RecordFunction
// has a debug-only member that the NDEBUG LibTorch library does not have.

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <atomic>
#include <optional>
#include <utility>
#include <vector>

#include "runtime/fast.h"

#ifdef FIVEFOLD_HAVE_DNNL
#include <oneapi/dnnl/dnnl.h>
#endif

#include "fivefold/error.h"
#include "runtime/parallel.h"

namespace fivefold::runtime {

using namespace fivefold::ch03;

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

// Whether dnnl_sgemm can take the product: float CPU tensors and no empty dimension.
bool fits(const torch::Tensor& a, const torch::Tensor& b) {
  return a.scalar_type() == torch::kFloat && b.scalar_type() == torch::kFloat &&
         a.device().is_cpu() && b.device().is_cpu() && a.numel() > 0 && b.numel() > 0;
}

// An operand as sgemm reads it: t itself where its matrices (shaped like `matrix`, cols wide)
// have a layout, else a contiguous copy read 'N' with leading dimension cols.
struct Operand {
  torch::Tensor data;
  char trans;
  int64_t ld;
};
Operand sgemm_operand(const torch::Tensor& t, const torch::Tensor& matrix) {
  if (const auto l = layout(matrix)) return {t, l->first, l->second};
  return {t.contiguous(), 'N', matrix.size(1)};
}

}  // namespace

bool OneDnnMatmulKernel::available() { return true; }

torch::Tensor OneDnnMatmulKernel::mm(const torch::Tensor& a, const torch::Tensor& b) const {
  FIVEFOLD_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0),
                 "OneDnnMatmulKernel::mm: [m, k] x [k, n], got ", a.sizes(), " x ", b.sizes());
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (!fits(a, b)) return a.mm(b);
  RECORD_FUNCTION("fivefold::mm", std::vector<c10::IValue>({a, b}));
  const Operand x = sgemm_operand(a, a), y = sgemm_operand(b, b);
  auto c = torch::empty({m, n}, a.options());
  const auto status =
      dnnl_sgemm(x.trans, y.trans, m, n, k, 1.0f, x.data.data_ptr<float>(), x.ld,
                 y.data.data_ptr<float>(), y.ld, 0.0f, c.data_ptr<float>(), n);
  FIVEFOLD_CHECK(status == dnnl_success, "dnnl_sgemm failed (status ", static_cast<int>(status),
                 ") on [", m, ", ", k, "] x [", k, ", ", n, "]");
  return c;
}

torch::Tensor OneDnnMatmulKernel::bmm(const torch::Tensor& a, const torch::Tensor& b) const {
  FIVEFOLD_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(1),
                 "OneDnnMatmulKernel::bmm: [B, m, k] x [B, k, n], got ", a.sizes(), " x ",
                 b.sizes());
  const int64_t batch = a.size(0), m = a.size(1), k = a.size(2), n = b.size(2);
  if (!fits(a, b)) return at::bmm(a, b);
  RECORD_FUNCTION("fivefold::bmm", std::vector<c10::IValue>({a, b}));
  // Every matrix of a batch has the layout of the first: the strides are the batch's.
  const Operand x = sgemm_operand(a, a[0]), y = sgemm_operand(b, b[0]);
  auto c = torch::empty({batch, m, n}, a.options());
  const float *pa = x.data.data_ptr<float>(), *pb = y.data.data_ptr<float>();
  float* pc = c.data_ptr<float>();
  const int64_t sa = x.data.stride(0), sb = y.data.stride(0);
  std::atomic<int> failed{0};
  // One matrix per task: inside a parallel region oneDNN runs each sgemm on its own thread.
  parallel_chunks(0, batch, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const auto status = dnnl_sgemm(x.trans, y.trans, m, n, k, 1.0f, pa + i * sa, x.ld,
                                     pb + i * sb, y.ld, 0.0f, pc + i * m * n, n);
      if (status != dnnl_success) failed = static_cast<int>(status);
    }
  });
  FIVEFOLD_CHECK(failed == 0, "dnnl_sgemm failed (status ", failed.load(), ") on [", batch, ", ",
                 m, ", ", k, "] x [", batch, ", ", k, ", ", n, "]");
  return c;
}

#else

bool OneDnnMatmulKernel::available() { return false; }

torch::Tensor OneDnnMatmulKernel::mm(const torch::Tensor& a, const torch::Tensor& b) const {
  return a.mm(b);
}

torch::Tensor OneDnnMatmulKernel::bmm(const torch::Tensor& a, const torch::Tensor& b) const {
  return at::bmm(a, b);
}

#endif

}  // namespace fivefold::runtime
