// The ISA layer of our CPU kernels: a vector of 16 fp32 lanes (V16) and the few operations the fused steps use,
// one __m512 on AVX512, two __m256 (lanes 0-7, 8-15) on AVX2, with the same result in every lane on both: the
// same IEEE operations lane by lane, the same tree for a horizontal sum, the same bf16 rounding (VCVTNEPS2BF16's:
// nearest even, denormal inputs as zero, NaN kept quiet), the same exp. So a kernel written on V16 gives the same
// bits on either ISA (tests/unit/test_cpu_kernels.py checks it op by op). Built by actors/model/cpu_kernels.py, one
// extension per ISA, each with its own flags (-ffp-contract=off on both: no FMA the source does not ask for) and
// its own op namespace (SPECFLEET_NS: torch.ops.specfleet_avx512, torch.ops.specfleet_avx2).
//
// ARM (NEON) goes here too, when a runner with ARM exists: V16 as four float32x4_t, vfmaq_f32 for the FMAs, the
// horizontal sum in the same tree, the bf16 rounding in integer operations as on AVX2, and the int4 x int8 matmul
// on SDOT (vdotq_s32, ARMv8.2 dotprod) in actors/model/int4_neon.h; it is not built today (cpu_kernels.ISAS).
#pragma once

#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#ifndef SPECFLEET_NS
#error "built by actors/model/cpu_kernels.py, which names the ops' namespace: -DSPECFLEET_NS=specfleet_<isa>"
#endif
#define SF_STR2(x) #x
#define SF_STR(x) SF_STR2(x)
#define SF_OP(name) SF_STR(SPECFLEET_NS) "::" name  // an op's qualified name, e.g. "specfleet_avx2::rms_norm"
#define SF_LIBRARY2(ns, m) TORCH_LIBRARY(ns, m)
#define SF_LIBRARY(m) SF_LIBRARY2(SPECFLEET_NS, m)
#define SF_FRAGMENT2(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define SF_FRAGMENT(m) SF_FRAGMENT2(SPECFLEET_NS, m)
#define SF_IMPL2(ns, m) TORCH_LIBRARY_IMPL(ns, CPU, m)
#define SF_IMPL(m) SF_IMPL2(SPECFLEET_NS, m)

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define SPECFLEET_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define SPECFLEET_AVX2 1
#else
#error "our CPU kernels are built for AVX512 (BF16, VNNI) or AVX2 (FMA, F16C); NEON is designed for, not built"
#endif

namespace {  // internal to each build: both ISAs' builds load in one process
namespace sfv {

using bf16 = c10::BFloat16;

// One fp32 -> bf16 as VCVTNEPS2BF16 rounds it (the AVX2 path's scalar and vector conversions follow this).
inline uint16_t to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7F800000u) == 0) u &= 0x80000000u;                          // denormal in: signed zero
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x40);  // NaN: kept, made quiet
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);                // nearest, ties to even
}

#if SPECFLEET_AVX512
struct V16 {
  __m512 v;
};
inline V16 zero() { return {_mm512_setzero_ps()}; }
inline V16 set1(float a) { return {_mm512_set1_ps(a)}; }
inline V16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, V16 a) { _mm512_storeu_ps(p, a.v); }
inline V16 add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline V16 sub(V16 a, V16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline V16 mul(V16 a, V16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline V16 div(V16 a, V16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline V16 max(V16 a, V16 b) { return {_mm512_max_ps(a.v, b.v)}; }  // b where a is NaN (MAXPS)
inline V16 min(V16 a, V16 b) { return {_mm512_min_ps(a.v, b.v)}; }
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }  // a b + c, rounded once
inline V16 round_int(V16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
// a * 2^n for integral n in [-252, 254] (exp's range)
inline V16 scale2(V16 a, V16 n) { return {_mm512_scalef_ps(a.v, n.v)}; }
// 16 bf16 -> fp32 (exact)
inline V16 load_bf16(const bf16* p) {
  return {_mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16))};
}
inline __m256i bf16_bits(V16 a) { return (__m256i)_mm512_cvtneps_pbh(a.v); }
inline void store_bf16(bf16* p, V16 a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(a)); }
inline V16 round_bf16(V16 a) {  // fp32 rounded to bf16 and back
  return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16_bits(a)), 16))};
}
// lanes 0-7 and 8-15 as two halves (the horizontal sum's first step)
inline __m256 low_half(V16 a) { return _mm512_castps512_ps256(a.v); }
inline __m256 high_half(V16 a) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(a.v), 1)); }
#else  // AVX2
struct V16 {
  __m256 lo, hi;  // lanes 0-7, 8-15
};
inline V16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 set1(float a) { return {_mm256_set1_ps(a), _mm256_set1_ps(a)}; }
inline V16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, V16 a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
inline V16 add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline V16 sub(V16 a, V16 b) { return {_mm256_sub_ps(a.lo, b.lo), _mm256_sub_ps(a.hi, b.hi)}; }
inline V16 mul(V16 a, V16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline V16 div(V16 a, V16 b) { return {_mm256_div_ps(a.lo, b.lo), _mm256_div_ps(a.hi, b.hi)}; }
inline V16 max(V16 a, V16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline V16 min(V16 a, V16 b) { return {_mm256_min_ps(a.lo, b.lo), _mm256_min_ps(a.hi, b.hi)}; }
inline V16 fmadd(V16 a, V16 b, V16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline V16 round_int(V16 a) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  return {_mm256_round_ps(a.lo, kNearest), _mm256_round_ps(a.hi, kNearest)};
}
// a * 2^n as VSCALEFPS gives it for integral n in [-252, 254] and |a| in [0.5, 2]: two exact powers of two
// (2^(n/2) and 2^(n - n/2), normal numbers), so only the second product rounds, as VSCALEFPS rounds once
inline __m256 scale2_half(__m256 a, __m256 n) {
  const __m256i k = _mm256_cvtps_epi32(n), k1 = _mm256_srai_epi32(k, 1), k2 = _mm256_sub_epi32(k, k1);
  const __m256i bias = _mm256_set1_epi32(127);
  const __m256 p1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k1, bias), 23));
  const __m256 p2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(k2, bias), 23));
  return _mm256_mul_ps(_mm256_mul_ps(a, p1), p2);
}
inline V16 scale2(V16 a, V16 n) { return {scale2_half(a.lo, n.lo), scale2_half(a.hi, n.hi)}; }
inline __m256 load8_bf16(const bf16* p) {
  return _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
inline V16 load_bf16(const bf16* p) { return {load8_bf16(p), load8_bf16(p + 8)}; }
// 8 fp32 -> the bf16 bits of to_bf16_bits, each in the low half of its 32-bit lane
inline __m256i bf16_bits8(__m256 a) {
  const __m256i u = _mm256_castps_si256(a);
  const __m256i sign = _mm256_and_si256(u, _mm256_set1_epi32(int(0x80000000u)));
  const __m256i exp = _mm256_and_si256(u, _mm256_set1_epi32(0x7F800000));
  const __m256i daz = _mm256_blendv_epi8(u, sign, _mm256_cmpeq_epi32(exp, _mm256_setzero_si256()));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(daz, 16), _mm256_set1_epi32(1));
  const __m256i rne = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(daz, _mm256_set1_epi32(0x7FFF)), odd), 16);
  const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF)),
                                         _mm256_set1_epi32(0x7F800000));
  return _mm256_blendv_epi8(rne, quiet, nan);
}
inline __m256i bf16_bits(V16 a) {  // 16 bf16 in lane order
  const __m256i packed = _mm256_packus_epi32(bf16_bits8(a.lo), bf16_bits8(a.hi));  // per 128: lo 4, hi 4
  return _mm256_permute4x64_epi64(packed, 0xD8);
}
inline void store_bf16(bf16* p, V16 a) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_bits(a)); }
inline V16 round_bf16(V16 a) {
  const auto back = [](__m256 h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(h), 16));
  };
  return {back(a.lo), back(a.hi)};
}
inline __m256 low_half(V16 a) { return a.lo; }
inline __m256 high_half(V16 a) { return a.hi; }
#endif

// The sum of the 16 lanes in one fixed tree (halves, quarters, pairs), the same on every ISA.
inline float reduce_add(V16 a) {
  const __m256 h = _mm256_add_ps(high_half(a), low_half(a));
  const __m128 q = _mm_add_ps(_mm256_extractf128_ps(h, 1), _mm256_castps256_ps128(h));
  const __m128 p = _mm_add_ps(q, _mm_movehl_ps(q, q));  // lanes 0 + 2, 1 + 3
  return _mm_cvtss_f32(p) + _mm_cvtss_f32(_mm_shuffle_ps(p, p, 1));
}

// e^v: 2^n * 2^f with n = round(v log2 e), |f| <= 1/2, 2^f by its Taylor polynomial of degree 7 (relative error
// below 1e-7 for |f| <= 1/2); inputs below -87 (and NaN) give e^-87, above 88.8 infinity: what softmax and SiLU
// need of them
inline V16 exp(V16 v) {
  const V16 t = mul(min(max(v, set1(-87.f)), set1(89.f)), set1(1.4426950408889634f));
  const V16 n = round_int(t);
  const V16 f = mul(sub(t, n), set1(0.6931471805599453f));  // f ln 2
  V16 p = set1(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = fmadd(p, f, set1(c));
  return scale2(p, n);
}

}  // namespace sfv
}  // namespace
