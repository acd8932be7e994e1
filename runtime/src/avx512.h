#pragma once
// The AVX-512 loops' shared pieces (avx512.cpp, rows.cpp): sixteen numbers of fp32 or bf16 loaded
// widened to fp32, rounded and stored back in their type, the lanes of a row's last piece, and the
// dispatch on the two types. Every function carries its own target (AVX-512 F/BW/VL/DQ): the
// project builds for the x86-64 baseline, and the loops run only where avx512_loops() says so.

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <initializer_list>

#include "runtime/fast.h"

#define FIVEFOLD_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))

namespace fivefold::runtime::avx512 {

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

// Whether the loops run (an AVX-512 CPU, set_avx512_loops) and take numbers of these types: fp32
// and bf16, the two on_type dispatches on.
inline bool loops_take_types(std::initializer_list<at::ScalarType> types) {
  if (!avx512_loops()) return false;
  for (const auto type : types) {
    if (type != at::kFloat && type != at::kBFloat16) return false;
  }
  return true;
}

// Calls run(T{}) with T the loops' type for `type` (fp32 or bf16).
template <typename Run>
void on_type(at::ScalarType type, const Run& run) {
  if (type == at::kFloat) {
    run(float{});
  } else {
    run(c10::BFloat16{});
  }
}

}  // namespace fivefold::runtime::avx512
