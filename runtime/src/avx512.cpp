// The fast paths' loops of their own (fast.h): the tiled attention's softmax passes over a tile of
// scores (causal_tile_exp) and SwiGLU's silu(gate)·up with its gradients (swiglu), each one loop
// on a CPU with AVX-512, ATen's operations elsewhere; and the switch for all of them (RMSNorm's
// and RoPE's row loops are in rows.cpp, the shared pieces in avx512.h). Compiled with NDEBUG
// (CMakeLists.txt), as chapter 02's counter.cpp: RecordFunction has a debug-only member that the
// NDEBUG LibTorch library does not have.
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

#include "avx512.h"
#include "fivefold/error.h"
#include "runtime/fast.h"
#include "runtime/parallel.h"

namespace fivefold::runtime {

namespace {

using namespace avx512;

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

// One row s[0, n): e = exp(s − m) over its first `seen` numbers, 0 after them, with m the row's
// max, or *given (a log-sum-exp) when given; returns m, and Σe (of e as stored) in *sum.
template <typename T>
FIVEFOLD_AVX512 float exp_row(T* s, int64_t seen, int64_t n, float* sum, const float* given) {
  float max = given != nullptr ? *given : 0;
  if (given == nullptr) {
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

// row(r) for every row r of a tile [rows, n], on ATen's threads (chunks of 32K numbers at least).
template <typename Row>
void each_row(int64_t rows, int64_t n, const Row& row) {
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1));
  parallel_chunks(0, rows, grain, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r) row(r);
  });
}

// Every row of a tile [rows, n], row r the query r mod t of its head, seeing keys
// 0 .. n − t + (r mod t); shifted by its max (written to max[r]) or, given `shift`, by shift[r].
template <typename T>
void exp_rows(T* scores, int64_t rows, int64_t n, int64_t t, float* max, float* sum,
              const float* shift) {
  each_row(rows, n, [&](int64_t r) {
    max[r] = exp_row(scores + r * n, n - t + r % t + 1, n, sum + r,
                     shift != nullptr ? shift + r : nullptr);
  });
}

// One row of softmax's backward in place: ds = p∘(dp − δ) over n numbers.
template <typename T>
FIVEFOLD_AVX512 void softmax_backward_row(T* ds, const T* p, float delta, int64_t n) {
  const __m512 d = _mm512_set1_ps(delta);
  for (int64_t j = 0; j < n; j += 16) {
    const __mmask16 mask = first_lanes(n - j);
    const __m512 g = _mm512_mul_ps(_mm512_sub_ps(load(ds + j, mask), d), load(p + j, mask));
    store(ds + j, mask, rounded(g, ds));
  }
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

// Runs span(first, count) over [0, n) in chunks, on ATen's threads.
template <typename Span>
void in_chunks(int64_t n, const Span& span) {
  parallel_chunks(0, n, 16384, [&](int64_t first, int64_t last) { span(first, last - first); });
}

// Whether the loops take these tensors: the loops on (an AVX-512 CPU, set_avx512_loops), and all of
// one type (fp32 or bf16), one size and contiguous.
bool loops_take(std::initializer_list<torch::Tensor> tensors) {
  const torch::Tensor& first = *tensors.begin();
  if (!loops_take_types({first.scalar_type()})) return false;
  for (const auto& t : tensors) {
    if (t.scalar_type() != first.scalar_type() || t.numel() != first.numel() || !t.is_contiguous())
      return false;
  }
  return true;
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

}  // namespace

torch::Tensor swiglu(const torch::Tensor& gate, const torch::Tensor& up) {
  FIVEFOLD_CHECK(gate.sizes() == up.sizes(), "swiglu: gate ", gate.sizes(), " and up ", up.sizes(),
                 " differ in shape");
  return SwiGLU::apply(gate, up);
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

void softmax_tile_backward(torch::Tensor& grad, const torch::Tensor& p,
                           const torch::Tensor& delta) {
  FIVEFOLD_CHECK(
      grad.dim() == 4 && p.sizes() == grad.sizes() &&
          delta.sizes() == torch::IntArrayRef({grad.size(0), grad.size(1), grad.size(2), 1}),
      "softmax_tile_backward: ∂L/∂p and p [b, h, T, n] of one shape and δ [b, h, T, 1], "
      "got ",
      grad.sizes(), ", ", p.sizes(), " and ", delta.sizes());
  if (!loops_take({grad, p})) {  // ATen's passes, each in the tile's type
    grad.sub_(delta.to(grad.scalar_type())).mul_(p);
    return;
  }
  RECORD_FUNCTION("fivefold::softmax_tile_backward", std::vector<c10::IValue>({grad, p}));
  const auto d = delta.to(torch::kFloat).contiguous();
  const int64_t n = grad.size(-1), rows = grad.numel() / std::max<int64_t>(n, 1);
  on_type(grad.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    T* g = grad.data_ptr<T>();
    const T* probabilities = p.data_ptr<T>();
    const float* deltas = d.data_ptr<float>();
    each_row(rows, n, [&](int64_t r) {
      softmax_backward_row(g + r * n, probabilities + r * n, deltas[r], n);
    });
  });
}

}  // namespace fivefold::runtime
