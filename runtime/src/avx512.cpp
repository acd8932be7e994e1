// The fast paths' loops of their own (fast.h): the tiled attention's softmax passes over a tile of
// scores (causal_tile_exp), SwiGLU's silu(gate)·up with its gradients (swiglu) and RMSNorm's
// forward and backward (FusedRMSNormKernel), each one loop on a CPU with AVX-512, ATen's
// operations (or, for RMSNorm, plain loops) elsewhere. Compiled with NDEBUG (CMakeLists.txt), as
// chapter 02's counter.cpp: RecordFunction has a debug-only member that the NDEBUG LibTorch
// library does not have.
//
// Why loops of our own: ATen runs mask, max, subtract and exp as four passes over a tile, and
// SwiGLU as SiLU then a product (and three passes back), and in LibTorch 1.13 its bf16 versions
// convert each element on its own (a bf16 d256 step spent 21 ms on the tiles' passes against
// fp32's 14, and 17 ms on SiLU against 13, notes/14 §6). The loops below read each number once
// (a tile's row twice, for its max), compute in fp32 registers whatever the type, and round each
// result once. The project builds for the x86-64 baseline (any CPU runs it), so these functions
// carry their own target (AVX-512 F/BW/VL/DQ) and run only where the CPU reports it, as ATen
// picks its kernels.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <immintrin.h>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <vector>

#include "fivefold/error.h"
#include "runtime/fast.h"

namespace fivefold::runtime {

namespace {

#define FIVEFOLD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

// e^x for x ≤ 0: e^x = 2^n · e^r with n = round(x · log₂e) and r = x − n·ln 2 in [−ln2/2, ln2/2]
// (ln 2 in two parts, so that n·ln 2 is exact to fp32), e^r by its Taylor series to r⁶ (relative
// error below 2e-7 on that range), and 2^n applied exactly by scalef. Below −104 the result
// underflows to 0.
FIVEFOLD_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  for (float c : {1.0f / 120, 1.0f / 24, 1.0f / 6, 0.5f, 1.0f, 1.0f}) {
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  }
  return _mm512_scalef_ps(p, n);
}

// Sixteen numbers of a row, widened to fp32 (lanes outside `mask` read as 0).
FIVEFOLD_AVX512 inline __m512 load(const float* p, __mmask16 mask) {
  return _mm512_maskz_loadu_ps(mask, p);
}
FIVEFOLD_AVX512 inline __m512 load(const c10::BFloat16* p, __mmask16 mask) {
  const __m256i half = _mm256_maskz_loadu_epi16(mask, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// v rounded to the row's type: fp32 as it is; bf16 to nearest, ties to even (c10::BFloat16's
// rounding), returned widened again so that the sum adds what is stored.
FIVEFOLD_AVX512 inline __m512 rounded(__m512 v, const float*) { return v; }
FIVEFOLD_AVX512 inline __m512 rounded(__m512 v, const c10::BFloat16*) {
  __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  bits = _mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)));
  return _mm512_castsi512_ps(_mm512_and_si512(bits, _mm512_set1_epi32(-65536)));
}

// Stores sixteen numbers already rounded to the row's type.
FIVEFOLD_AVX512 inline void store(float* p, __mmask16 mask, __m512 v) {
  _mm512_mask_storeu_ps(p, mask, v);
}
FIVEFOLD_AVX512 inline void store(c10::BFloat16* p, __mmask16 mask, __m512 v) {
  const __m512i high = _mm512_srli_epi32(_mm512_castps_si512(v), 16);
  _mm256_mask_storeu_epi16(p, mask, _mm512_cvtepi32_epi16(high));
}

inline __mmask16 first_lanes(int64_t count) {
  return count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
}

// One row s[0, n): e = exp(s − m) over its first `seen` numbers, 0 after them, with m the row's
// max, or `given` (a log-sum-exp) when it is not NaN; returns m, and Σe (of e as stored) in *sum.
template <typename T>
FIVEFOLD_AVX512 float exp_row(T* s, int64_t seen, int64_t n, float* sum, float given) {
  float max = given;
  if (std::isnan(given)) {
    __m512 most = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < seen; j += 16) {
      const __mmask16 mask = first_lanes(seen - j);
      most = _mm512_mask_max_ps(most, mask, most, load(s + j, mask));
    }
    max = _mm512_reduce_max_ps(most);
  }
  const __m512 shift = _mm512_set1_ps(max);
  __m512 total = _mm512_setzero_ps();
  for (int64_t j = 0; j < seen; j += 16) {
    const __mmask16 mask = first_lanes(seen - j);
    const __m512 e = rounded(exp_nonpositive(_mm512_sub_ps(load(s + j, mask), shift)), s);
    store(s + j, mask, e);
    total = _mm512_mask_add_ps(total, mask, total, e);
  }
  for (int64_t j = seen; j < n; j += 16) store(s + j, first_lanes(n - j), _mm512_setzero_ps());
  *sum = _mm512_reduce_add_ps(total);
  return max;
}

// Every row of a tile [rows, n], row r the query r mod t of its head, seeing keys
// 0 .. n − t + (r mod t); shifted by its max (written to max[r]) or, given `shift`, by shift[r].
template <typename T>
void exp_rows(T* scores, int64_t rows, int64_t n, int64_t t, float* max, float* sum,
              const float* shift) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) {
      const float given = shift != nullptr ? shift[r] : NAN;
      max[r] = exp_row(scores + r * n, n - t + r % t + 1, n, sum + r, given);
    }
  });
}

// σ(g) for any g, from e = exp(−|g|): 1/(1 + e) for g ≥ 0, e/(1 + e) below (no overflow).
FIVEFOLD_AVX512 inline __m512 sigmoid(__m512 g) {
  const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __m512 r = _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(_mm512_set1_ps(1.0f), e));
  return _mm512_mask_mul_ps(r, _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ), e, r);
}

// h = silu(g)·u = g·σ(g)·u over n numbers.
template <typename T>
FIVEFOLD_AVX512 void swiglu_span(const T* g, const T* u, T* h, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = first_lanes(n - j);
    const __m512 x = load(g + j, mask);
    store(h + j, mask, rounded(_mm512_mul_ps(_mm512_mul_ps(x, sigmoid(x)), load(u + j, mask)), h));
  }
}

// du = dh·silu(g) and dg = dh·u·silu'(g), silu'(g) = σ(g)·(1 + g·(1 − σ(g))), over n numbers.
template <typename T>
FIVEFOLD_AVX512 void swiglu_backward_span(const T* g, const T* u, const T* dh, T* dg, T* du,
                                          int64_t n) {
  const __m512 one = _mm512_set1_ps(1.0f);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = first_lanes(n - j);
    const __m512 x = load(g + j, mask), s = sigmoid(x), d = load(dh + j, mask);
    store(du + j, mask, rounded(_mm512_mul_ps(d, _mm512_mul_ps(x, s)), du));
    const __m512 slope = _mm512_mul_ps(s, _mm512_fmadd_ps(x, _mm512_sub_ps(one, s), one));
    store(dg + j, mask, rounded(_mm512_mul_ps(_mm512_mul_ps(d, load(u + j, mask)), slope), dg));
  }
}

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

// Runs span(first, count) over [0, n) in chunks, on ATen's threads.
template <typename Span>
void in_chunks(int64_t n, const Span& span) {
  at::parallel_for(0, n, 16384, [&](int64_t first, int64_t last) { span(first, last - first); });
}

// Whether the loops take these tensors: the loops on (an AVX-512 CPU, set_avx512_loops), and all of
// one type (fp32 or bf16), one size and contiguous.
bool loops_take(std::initializer_list<torch::Tensor> tensors) {
  if (!avx512_loops()) return false;
  const torch::Tensor& first = *tensors.begin();
  if (first.scalar_type() != torch::kFloat && first.scalar_type() != torch::kBFloat16) return false;
  for (const auto& t : tensors) {
    if (t.scalar_type() != first.scalar_type() || t.numel() != first.numel() || !t.is_contiguous())
      return false;
  }
  return true;
}

// Calls run(T{}) with T the loops' type for `type` (fp32 or bf16).
template <typename Run>
void on_type(at::ScalarType type, const Run& run) {
  if (type == torch::kFloat) {
    run(float{});
  } else {
    run(c10::BFloat16{});
  }
}

using ch03::at_least_fp32;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// silu(gate)·up keeping gate and up for backward (ATen's SiLU and product keep gate, silu(gate)
// and up): one number fewer a feature.
class SwiGLU : public torch::autograd::Function<SwiGLU> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& gate,
                               const torch::Tensor& up) {
    ctx->save_for_backward({gate, up});
    if (!loops_take({gate, up})) {  // in fp32 at least, rounded once, as the loop does
      return (torch::silu(at_least_fp32(gate)) * at_least_fp32(up)).to(gate.scalar_type());
    }
    RECORD_FUNCTION("fivefold::swiglu", std::vector<c10::IValue>({gate, up}));
    auto h = torch::empty_like(gate);
    on_type(gate.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const T *g = gate.data_ptr<T>(), *u = up.data_ptr<T>();
      T* out = h.data_ptr<T>();
      in_chunks(h.numel(), [&](int64_t first, int64_t count) {
        swiglu_span(g + first, u + first, out + first, count);
      });
    });
    return h;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &gate = saved[0], &up = saved[1];
    const auto dh = grads[0].contiguous();
    if (!loops_take({gate, up, dh})) {
      // In fp32 at least, each gradient rounded once to its input's type.
      const auto g = at_least_fp32(gate), s = torch::sigmoid(g), d = at_least_fp32(dh);
      return {(d * at_least_fp32(up) * s * (1 + g * (1 - s))).to(gate.scalar_type()),
              (d * g * s).to(up.scalar_type())};
    }
    RECORD_FUNCTION("fivefold::swiglu_backward", std::vector<c10::IValue>({gate, up, dh}));
    auto grad_gate = torch::empty_like(gate), grad_up = torch::empty_like(up);
    on_type(gate.scalar_type(), [&](auto tag) {
      using T = decltype(tag);
      const T *g = gate.data_ptr<T>(), *u = up.data_ptr<T>(), *d = dh.data_ptr<T>();
      T *dg = grad_gate.data_ptr<T>(), *du = grad_up.data_ptr<T>();
      in_chunks(dh.numel(), [&](int64_t first, int64_t count) {
        swiglu_backward_span(g + first, u + first, d + first, dg + first, du + first, count);
      });
    });
    return {grad_gate, grad_up};
  }
};

// RMSNorm as one pass forward and one backward, keeping x (the input), the weight (the parameter
// itself: no copy) and rstd. x in fp32 (the AVX-512 loops above where they run) or fp64; a weight
// narrower than x (a bf16 table, chapter 14's master weights) is read widened.
class RMSNormFunction : public torch::autograd::Function<RMSNormFunction> {
 public:
  // Whether the loops take x and the weight: x in fp32, the weight in fp32 or bf16.
  static bool loops_take(const torch::Tensor& x, const torch::Tensor& weight) {
    const auto w = weight.scalar_type();
    return avx512_loops() && x.scalar_type() == torch::kFloat &&
           (w == torch::kFloat || w == torch::kBFloat16);
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
        at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
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
        at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
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
        at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
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
      at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
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
  at::parallel_for(0, x.size(0) * heads * seq, 64, [&](int64_t first, int64_t last) {
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

bool is_loop_type(at::ScalarType type) { return type == torch::kFloat || type == torch::kBFloat16; }

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
    if (!avx512_loops() || !is_loop_type(input.scalar_type()) || !is_loop_type(out_type)) {
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
    if (!avx512_loops() || !is_loop_type(grad_y.scalar_type()) || !is_loop_type(type)) {
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

torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
  FIVEFOLD_CHECK(gate.sizes() == up.sizes(), "swiglu: gate ", gate.sizes(), " and up ", up.sizes(),
                 " differ in shape");
  return SwiGLU::apply(gate, up);
}

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

bool avx512_available() {
  static const bool has = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                          __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  return has;
}

namespace {
std::atomic<bool> loops_on{true};
}  // namespace

void set_avx512_loops(bool on) { loops_on = on; }

bool avx512_loops() { return loops_on && avx512_available(); }

TileExp causal_tile_exp(torch::Tensor& scores, const torch::Tensor& future, bool with_sum,
                        const torch::Tensor& shift) {
  const int64_t t = scores.size(-2), n = scores.size(-1);
  FIVEFOLD_CHECK(
      scores.dim() == 4 && t <= n && future.size(0) >= t && future.size(1) >= t,
      "causal_tile_exp: scores [b, h, T, end] with T <= end and a mask of at least T x T, "
      "got scores ",
      scores.sizes(), " and a mask ", future.sizes());
  const auto type = at::promote_types(scores.scalar_type(), torch::kFloat);
  const std::vector<int64_t> stats = {scores.size(0), scores.size(1), t, 1};
  FIVEFOLD_CHECK(!shift.defined() || shift.sizes() == torch::IntArrayRef(stats),
                 "causal_tile_exp: a shift of one number a query, [b, h, T, 1], got ",
                 shift.sizes());
  if (!loops_take({scores})) {
    // ATen's passes, in the scores' own type: mask, max, s − max, exp (each rounded to a bf16
    // tile's type), and the sum in fp32 at least.
    scores.narrow(-1, n - t, t).masked_fill_(future.narrow(0, 0, t).narrow(1, 0, t), -INFINITY);
    // (A shift subtracts in fp32, then rounds: a log-sum-exp is not rounded to a bf16 tile's type.)
    auto max = shift.defined() ? shift : scores.amax(-1, /*keepdim=*/true);  // a query sees itself
    scores.sub_(max).exp_();
    return {max.to(type), with_sum ? scores.sum(-1, /*keepdim=*/true, type) : torch::Tensor()};
  }
  // Recorded for profiles as an operation of its own (ATen's passes record themselves).
  RECORD_FUNCTION("fivefold::causal_tile_exp", std::vector<c10::IValue>({scores}));
  auto max = torch::empty(stats, scores.options().dtype(type));
  auto sum = torch::empty_like(max);
  const auto given = shift.defined() ? shift.to(torch::kFloat).contiguous() : torch::Tensor();
  const int64_t rows = scores.numel() / n;
  on_type(scores.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    exp_rows(scores.data_ptr<T>(), rows, n, t, max.data_ptr<float>(), sum.data_ptr<float>(),
             given.defined() ? given.data_ptr<float>() : nullptr);
  });
  return {max, with_sum ? sum : torch::Tensor()};
}

}  // namespace fivefold::runtime
