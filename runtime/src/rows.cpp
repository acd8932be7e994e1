// RMSNorm's and RoPE's row loops (fast.h: FusedRMSNormKernel, rotate_half_split): each row of a
// [rows, d] tensor in one pass, sixteen numbers at a time in fp32 registers, on a CPU with
// AVX-512; plain loops (RMSNorm) or ATen's operations (RoPE) elsewhere. Compiled with NDEBUG, as
// avx512.cpp (CMakeLists.txt).

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "avx512.h"
#include "fivefold/error.h"
#include "runtime/fast.h"
#include "runtime/parallel.h"

namespace fivefold::runtime {

namespace {

using namespace avx512;
using ch03::at_least_fp32;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// RMSNorm of rows [first, last) of x [rows, d] in fp32, weight w in fp32 or bf16 (read widened):
// per row Σx² (sixteen running sums), rstd = 1/sqrt(Σx²/d + eps), then y = x·rstd·w.
template <typename W>
FIVEFOLD_AVX512 void rms_norm_rows(const float* x, const W* w, float* y, float* rstd, int64_t first,
                                   int64_t last, int64_t d, float eps) {
  for (int64_t r = first; r < last; ++r) {
    const float* xr = x + r * d;
    __m512 squares = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; j += 16) {
      const __m512 v = load(xr + j, first_lanes(d - j));
      squares = _mm512_fmadd_ps(v, v, squares);
    }
    const float s = 1 / std::sqrt(_mm512_reduce_add_ps(squares) / static_cast<float>(d) + eps);
    rstd[r] = s;
    const __m512 scale = _mm512_set1_ps(s);
    for (int64_t j = 0; j < d; j += 16) {
      const __mmask16 mask = first_lanes(d - j);
      store(y + r * d + j, mask,
            _mm512_mul_ps(_mm512_mul_ps(load(xr + j, mask), scale), load(w + j, mask)));
    }
  }
}

// Its backward over rows [first, last): with g = ∂y·w, ∂x = rstd·g − x·rstd³·Σ(g·x)/d; each row's
// ∂y·x·rstd added into dw (this thread's partial sum of ∂w).
template <typename W>
FIVEFOLD_AVX512 void rms_norm_backward_rows(const float* x, const W* w, const float* dy,
                                            const float* rstd, float* dx, float* dw, int64_t first,
                                            int64_t last, int64_t d) {
  for (int64_t r = first; r < last; ++r) {
    const float *xr = x + r * d, *dyr = dy + r * d;
    __m512 dot = _mm512_setzero_ps();
    for (int64_t j = 0; j < d; j += 16) {
      const __mmask16 mask = first_lanes(d - j);
      dot = _mm512_fmadd_ps(_mm512_mul_ps(load(dyr + j, mask), load(w + j, mask)),
                            load(xr + j, mask), dot);
    }
    const float s = rstd[r];
    const __m512 scale = _mm512_set1_ps(s);
    const __m512 c = _mm512_set1_ps(_mm512_reduce_add_ps(dot) * s * s * s / static_cast<float>(d));
    for (int64_t j = 0; j < d; j += 16) {
      const __mmask16 mask = first_lanes(d - j);
      const __m512 g = load(dyr + j, mask), v = load(xr + j, mask);
      store(dx + r * d + j, mask,
            _mm512_fnmadd_ps(c, v, _mm512_mul_ps(scale, _mm512_mul_ps(g, load(w + j, mask)))));
      store(dw + j, mask, _mm512_fmadd_ps(_mm512_mul_ps(g, v), scale, load(dw + j, mask)));
    }
  }
}

// RoPE's rotation of one row's half-split pairs, x's row to y's: (a, c) -> (a·cos − c·sin,
// a·sin + c·cos) with pair j = (row[j], row[half + j]); sin negated (`back`) rotates back, which is
// the rotation's backward. cos and sin: the row's position's [half] fp32.
template <typename TX, typename TY>
FIVEFOLD_AVX512 void rope_row(const TX* x, TY* y, const float* cos, const float* sin, int64_t half,
                              bool back) {
  const __m512 sign = _mm512_set1_ps(back ? -1.0f : 1.0f);
  for (int64_t j = 0; j < half; j += 16) {
    const __mmask16 mask = first_lanes(half - j);
    const __m512 a = load(x + j, mask), c = load(x + half + j, mask);
    const __m512 co = load(cos + j, mask), si = _mm512_mul_ps(sign, load(sin + j, mask));
    store(y + j, mask, rounded(_mm512_fmsub_ps(a, co, _mm512_mul_ps(c, si)), y));
    store(y + half + j, mask, rounded(_mm512_fmadd_ps(a, si, _mm512_mul_ps(c, co)), y));
  }
}

// RMSNorm as one pass forward and one backward, keeping x (the input), the weight (the parameter
// itself: no copy) and rstd. x in fp32 (the AVX-512 loops above where they run) or fp64; a weight
// narrower than x (a bf16 table, chapter 14's master weights) is read widened.
class RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
 public:
  // Whether the loops take x and the weight: x in fp32, the weight in fp32 or bf16.
  static bool loops_take(const torch::Tensor& x, const torch::Tensor& weight) {
    return x.scalar_type() == torch::kFloat && loops_take_types({weight.scalar_type()});
  }

  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, double eps) {
    const auto input = x.contiguous();
    const int64_t dim = input.size(-1), rows = input.numel() / dim;
    auto y = torch::empty_like(input);
    auto rstd = torch::empty({rows}, input.options());
    if (loops_take(input, weight)) {
      RECORD_FUNCTION("fivefold::rms_norm", std::vector<c10::IValue>({input}));
      const auto w = weight.contiguous();
      on_type(w.scalar_type(), [&](auto tag) {
        using W = decltype(tag);
        parallel_chunks(0, rows, 16, [&](int64_t first, int64_t last) {
          rms_norm_rows(input.data_ptr<float>(), w.data_ptr<W>(), y.data_ptr<float>(),
                        rstd.data_ptr<float>(), first, last, dim, static_cast<float>(eps));
        });
      });
    } else {
      const auto w = weight.to(input.scalar_type()).contiguous();
      AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "rms_norm_forward", [&] {
        const scalar_t* xs = input.data_ptr<scalar_t>();
        const scalar_t* ws = w.data_ptr<scalar_t>();
        scalar_t* ys = y.data_ptr<scalar_t>();
        scalar_t* rs = rstd.data_ptr<scalar_t>();
        parallel_chunks(0, rows, 16, [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            const scalar_t* xr = xs + r * dim;
            scalar_t squares = 0;
            for (int64_t i = 0; i < dim; ++i) squares += xr[i] * xr[i];
            const scalar_t s = 1 / std::sqrt(squares / static_cast<scalar_t>(dim) + eps);
            rs[r] = s;
            scalar_t* yr = ys + r * dim;
            for (int64_t i = 0; i < dim; ++i) yr[i] = xr[i] * s * ws[i];
          }
        });
      });
    }
    ctx->save_for_backward({input, weight, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &input = saved[0], &rstd = saved[2];
    const auto grad_y = grads[0].to(input.scalar_type()).contiguous();
    const int64_t dim = input.size(-1), rows = input.numel() / dim;
    auto grad_x = torch::empty_like(input);
    // ∂w is a sum over rows: each thread adds into its own row of `partial`.
    auto partial = torch::zeros({at::get_num_threads(), dim}, input.options());
    if (loops_take(input, saved[1])) {
      RECORD_FUNCTION("fivefold::rms_norm_backward", std::vector<c10::IValue>({input, grad_y}));
      const auto w = saved[1].contiguous();
      on_type(w.scalar_type(), [&](auto tag) {
        using W = decltype(tag);
        parallel_chunks(0, rows, 16, [&](int64_t first, int64_t last) {
          rms_norm_backward_rows(input.data_ptr<float>(), w.data_ptr<W>(), grad_y.data_ptr<float>(),
                                 rstd.data_ptr<float>(), grad_x.data_ptr<float>(),
                                 partial.data_ptr<float>() + at::get_thread_num() * dim, first,
                                 last, dim);
        });
      });
      return {grad_x, partial.sum(0), {}};
    }
    const auto w = saved[1].to(input.scalar_type()).contiguous();
    AT_DISPATCH_FLOATING_TYPES(input.scalar_type(), "rms_norm_backward", [&] {
      const scalar_t* xs = input.data_ptr<scalar_t>();
      const scalar_t* ws = w.data_ptr<scalar_t>();
      const scalar_t* gs = grad_y.data_ptr<scalar_t>();
      const scalar_t* rs = rstd.data_ptr<scalar_t>();
      scalar_t* dxs = grad_x.data_ptr<scalar_t>();
      scalar_t* parts = partial.data_ptr<scalar_t>();
      parallel_chunks(0, rows, 16, [&](int64_t begin, int64_t end) {
        scalar_t* dw = parts + at::get_thread_num() * dim;
        for (int64_t r = begin; r < end; ++r) {
          const scalar_t *xr = xs + r * dim, *gr = gs + r * dim;
          const scalar_t s = rs[r];
          scalar_t dot = 0;  // Σ_i ∂y_i·w_i·x_i
          for (int64_t i = 0; i < dim; ++i) dot += gr[i] * ws[i] * xr[i];
          const scalar_t c = dot * s * s * s / static_cast<scalar_t>(dim);
          scalar_t* dxr = dxs + r * dim;
          for (int64_t i = 0; i < dim; ++i) {
            dxr[i] = s * gr[i] * ws[i] - c * xr[i];
            dw[i] += gr[i] * xr[i] * s;
          }
        }
      });
    });
    return {grad_x, partial.sum(0), {}};
  }
};

// Every row (b, h, s) of x [B, H, S, d] to y's, each at its tensor's strides (unit stride along
// d), rotated by the angles of position s (back: by their negatives).
template <typename TX, typename TY>
void rope_rows(const torch::Tensor& x, torch::Tensor& y, const torch::Tensor& cos,
               const torch::Tensor& sin, bool back) {
  const int64_t heads = x.size(1), seq = x.size(2), half = x.size(3) / 2;
  const TX* xs = x.data_ptr<TX>();
  TY* ys = y.data_ptr<TY>();
  const float *cs = cos.data_ptr<float>(), *ss = sin.data_ptr<float>();
  parallel_chunks(0, x.size(0) * heads * seq, 64, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const int64_t b = r / (heads * seq), h = r / seq % heads, p = r % seq;
      rope_row(xs + b * x.stride(0) + h * x.stride(1) + p * x.stride(2),
               ys + b * y.stride(0) + h * y.stride(1) + p * y.stride(2), cs + p * half,
               ss + p * half, half, back);
    }
  });
}

// The rotation with ATen's operations, in fp32 at least: x's pairs turned by the angles (back: by
// their negatives), in `type`.
torch::Tensor rope_by_aten(const torch::Tensor& x, const torch::Tensor& cos,
                           const torch::Tensor& sin, bool back, at::ScalarType type) {
  const int64_t half = x.size(-1) / 2;
  const auto wide = at_least_fp32(x), s = back ? -sin : sin;
  const auto a = wide.narrow(-1, 0, half), c = wide.narrow(-1, half, half);
  return torch::cat({a * cos - c * s, a * s + c * cos}, -1).to(type);
}

// Rotates x [b, h, s, d] (any dense layout) into a new contiguous tensor of `type`; its backward
// rotates the gradient back into x's own layout and type. Keeps cos and sin only.
class HalfSplitRotation : public torch::autograd::Function<HalfSplitRotation> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& cos, const torch::Tensor& sin, int64_t type) {
    const auto out_type = static_cast<at::ScalarType>(type);
    const auto input = x.is_non_overlapping_and_dense() ? x : x.contiguous();
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["sizes"] = input.sizes().vec();
    ctx->saved_data["strides"] = input.strides().vec();
    ctx->saved_data["type"] = static_cast<int64_t>(input.scalar_type());
    if (!loops_take_types({input.scalar_type(), out_type})) {
      return rope_by_aten(input, cos, sin, /*back=*/false, out_type).contiguous();
    }
    RECORD_FUNCTION("fivefold::rope", std::vector<c10::IValue>({input}));
    auto y = torch::empty(input.sizes(), input.options().dtype(out_type));
    on_type(input.scalar_type(), [&](auto x_tag) {
      on_type(out_type, [&](auto y_tag) {
        rope_rows<decltype(x_tag), decltype(y_tag)>(input, y, cos, sin, /*back=*/false);
      });
    });
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &cos = saved[0], &sin = saved[1];
    const auto type = static_cast<at::ScalarType>(ctx->saved_data["type"].toInt());
    const auto grad_y = grads[0].contiguous();
    if (!loops_take_types({grad_y.scalar_type(), type})) {
      return {rope_by_aten(grad_y, cos, sin, /*back=*/true, type), {}, {}, {}};
    }
    RECORD_FUNCTION("fivefold::rope_backward", std::vector<c10::IValue>({grad_y}));
    auto grad_x = torch::empty_strided(ctx->saved_data["sizes"].toIntVector(),
                                       ctx->saved_data["strides"].toIntVector(),
                                       grad_y.options().dtype(type));
    on_type(grad_y.scalar_type(), [&](auto g_tag) {
      on_type(type, [&](auto x_tag) {
        rope_rows<decltype(g_tag), decltype(x_tag)>(grad_y, grad_x, cos, sin, /*back=*/true);
      });
    });
    return {grad_x, {}, {}, {}};
  }
};

}  // namespace

torch::Tensor rotate_half_split(const torch::Tensor& x, const torch::Tensor& cos,
                                const torch::Tensor& sin, at::ScalarType type) {
  FIVEFOLD_CHECK(x.dim() == 4 && x.size(3) % 2 == 0 && x.stride(3) == 1 &&
                     cos.sizes() == torch::IntArrayRef({x.size(2), x.size(3) / 2}) &&
                     sin.sizes() == cos.sizes() && cos.scalar_type() == torch::kFloat &&
                     sin.scalar_type() == torch::kFloat && cos.is_contiguous() &&
                     sin.is_contiguous(),
                 "rotate_half_split: x [b, h, s, d] (d even, unit stride) and fp32 cos, sin "
                 "[s, d/2], got x ",
                 x.sizes(), " and cos ", cos.sizes(), " ", cos.scalar_type());
  return HalfSplitRotation::apply(x, cos, sin, static_cast<int64_t>(type));
}

torch::Tensor FusedRMSNormKernel::normalize(const torch::Tensor& x, const torch::Tensor& weight,
                                            double eps) const {
  FIVEFOLD_CHECK(x.size(-1) == weight.numel() &&
                     at::promote_types(x.scalar_type(), weight.scalar_type()) == x.scalar_type(),
                 "RMSNorm: x [..., ", x.size(-1), "] ", x.scalar_type(), " against weight [",
                 weight.numel(), "] ", weight.scalar_type());
  return RMSNormFunction::apply(x, weight, eps);
}

}  // namespace fivefold::runtime
