// The int4 matmul's AVX512 kernels (AVX512-BF16 and VNNI): included by int4_cpu.cpp inside its namespace, after
// the layout's constants and structs (kRows, kGroup, Encoding, Scales, QuantRows, prefetch_group); int4_cpu.cpp
// says what they compute, int4_avx2.h computes the same on AVX2.

template <int E>
inline void load_scales(const Scales& sc, int64_t g, __m512& s, __m512& o) {
  if constexpr (E == kFloat) {
    s = _mm512_loadu_ps(static_cast<const float*>(sc.scale) + g * kRows);
    o = _mm512_loadu_ps(static_cast<const float*>(sc.offset) + g * kRows);
  } else {
    const int64_t at = (E == kHalf ? g : g / 8) * kRows;
    s = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(sc.scale) + at)));
    o = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(sc.offset) + at)));
    if constexpr (E == kTwoLevel) {
      const auto mult = [&](const uint8_t* p) {
        return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + g * kRows))));
      };
      s = _mm512_mul_ps(s, mult(sc.scale_mult));
      o = _mm512_mul_ps(o, mult(sc.offset_mult));
    }
  }
}

// A block's outputs: MT rows of 16 fp32 sums plus the bias, rounded to bf16, the block's real rows stored.
template <int MT>
inline void store(const __m512* acc, const at::BFloat16* bias, at::BFloat16* y, int64_t lda_y, int64_t rows) {
  const __mmask16 keep = rows >= kRows ? __mmask16(0xFFFF) : __mmask16((1u << rows) - 1);
  __m512 b = _mm512_setzero_ps();
  if (bias != nullptr) {
    b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(keep, bias)), 16));
  }
  for (int m = 0; m < MT; ++m) {
    const __m256bh out = _mm512_cvtneps_pbh(_mm512_add_ps(acc[m], b));
    _mm256_mask_storeu_epi16(y + m * lda_y, keep, (__m256i)out);
  }
}

// One block of 16 rows against MT input rows: y[m, rows] over every group of every plane. A group's products go to
// two accumulators per row (one chain would be bound by VDPBF16PS's latency at one row), added in the same order
// whatever MT: a row's result does not depend on the rows beside it (deterministic mode relies on it).
template <int MT, int E>
void block(const uint16_t* x, const float* xsum, const uint8_t* codes, const Scales& scales,
           const at::BFloat16* bias, at::BFloat16* y, int64_t K, int64_t groups, int64_t lda_y, int64_t rows) {
  constexpr int kAcc = 2;  // accumulators per input row: the same for every MT, so a row's sums do not depend on M
  const int64_t G = K / kGroup;  // groups per plane
  // bf16(1 + c / 16) = 0x3F80 | c << 3: c in the top 4 of the 7 mantissa bits
  const __m512i field = _mm512_set1_epi16(0x0078), one = _mm512_set1_epi16(0x3F80);
  const __m512 sixteen = _mm512_set1_ps(16.f);
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t xk = (g % G) * kGroup;  // the input columns of this group (planes share them)
    __m512 sum[MT][kAcc];
    for (int m = 0; m < MT; ++m)
      for (int a = 0; a < kAcc; ++a) sum[m][a] = _mm512_setzero_ps();
    prefetch_group(codes + g * (kGroup / 8) * 64);
#pragma GCC unroll 4
    for (int c = 0; c < kGroup / 8; ++c) {
      const __m512i v = _mm512_loadu_si512(codes + (g * (kGroup / 8) + c) * 64);
      __m512bh w[4];
      w[0] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_slli_epi16(v, 3), field, one, 0xEA);  // (a & field) | one
      w[1] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 1), field, one, 0xEA);
      w[2] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 5), field, one, 0xEA);
      w[3] = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 9), field, one, 0xEA);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const uint16_t* xm = x + m * K + xk + c * 8;
#pragma GCC unroll 4
        for (int t = 0; t < 4; ++t) {
          int32_t pair;  // the inputs k + 2t, k + 2t + 1
          std::memcpy(&pair, xm + 2 * t, 4);
          sum[m][t % kAcc] = _mm512_dpbf16_ps(sum[m][t % kAcc], w[t], (__m512bh)_mm512_set1_epi32(pair));
        }
      }
    }
    __m512 s, o;
    load_scales<E>(scales, g, s, o);
    s = _mm512_mul_ps(s, sixteen);  // the codes were read as 1 + c / 16: scale * c = 16 scale (1 + c / 16) - 16 scale
    o = _mm512_sub_ps(o, s);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      __m512 total = sum[m][0];
      for (int a = 1; a < kAcc; ++a) total = _mm512_add_ps(total, sum[m][a]);
      acc[m] = _mm512_fmadd_ps(total, s, acc[m]);
      acc[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(xsum[m * G + g % G]), acc[m]);
    }
  }
  store<MT>(acc, bias, y, lda_y, rows);
}

// The same matmul on int8 inputs, as llama.cpp computes Q4 x Q8_0 dot products (ggml-cpu's vec_dot_q4_0_q8_0):
// each input row is rounded per group of 32 to int8 with its own scale d = max |x| / 127 (ties to even), and
// VPDPBUSD multiplies 16 rows' codes (uint8, 0..15) by 4 of those inputs per instruction: 64 multiply-adds
// (VDPBF16PS: 32) on codes unpacked with one AND (and a shift for the high nibbles), summed exactly in int32.
// y = sum over groups of d (scale * sum(c q) + offset * sum q): the exact result (in fp32) of the weights as stored
// times the rounded rows q d, as llama.cpp's Q8_1 keeps d * sum q for the offsets. A chunk of 8 inputs is stored in
// the codes' order: a row's dword holds k = 0, 4, 1, 5 of the chunk in its low nibbles and 2, 6, 3, 7 in its high
// ones (the layout in int4_cpu.cpp). Rows are rounded and summed alone, in one
// order: row-invariant like int4_mm. What the rounding costs in the logits is measured in docs/weights.md.
template <int MT, int E>
void block_q8(const QuantRows& xq, const uint8_t* codes, const Scales& scales, const at::BFloat16* bias,
              at::BFloat16* y, int64_t K, int64_t groups, int64_t lda_y, int64_t rows) {
  const int64_t G = K / kGroup;
  const __m512i low = _mm512_set1_epi8(0x0F);
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t xk = (g % G) * kGroup;
    __m512i sum[MT][2];
    for (int m = 0; m < MT; ++m) sum[m][0] = sum[m][1] = _mm512_setzero_si512();
    prefetch_group(codes + g * (kGroup / 8) * 64);
#pragma GCC unroll 4
    for (int c = 0; c < kGroup / 8; ++c) {
      const __m512i v = _mm512_loadu_si512(codes + (g * (kGroup / 8) + c) * 64);
      const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const int8_t* qm = xq.q + m * K + xk + c * 8;
        int32_t a, b;
        std::memcpy(&a, qm, 4);
        std::memcpy(&b, qm + 4, 4);
        sum[m][0] = _mm512_dpbusd_epi32(sum[m][0], lo, _mm512_set1_epi32(a));
        sum[m][1] = _mm512_dpbusd_epi32(sum[m][1], hi, _mm512_set1_epi32(b));
      }
    }
    __m512 s, o;
    load_scales<E>(scales, g, s, o);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      const __m512 total = _mm512_cvtepi32_ps(_mm512_add_epi32(sum[m][0], sum[m][1]));
      acc[m] = _mm512_fmadd_ps(total, _mm512_mul_ps(s, _mm512_set1_ps(xq.d[m * G + g % G])), acc[m]);
      acc[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(xq.xsum[m * G + g % G]), acc[m]);
    }
  }
  store<MT>(acc, bias, y, lda_y, rows);
}

// A prefill's int4 x int8 matmul (int4_gemm_q8 in int4_cpu.cpp) on a tile of MT <= kGemmRows input rows: block_q8
// itself. With 32 vector registers its tile of 8 rows (16 int32 sums, 8 fp32 accumulators, the unpacked codes) runs
// without spills at about 80% of one VPDPBUSD per cycle (docs/weights.md), so the GEMM's gain here is in the shared
// part (the rows rounded on every thread, the blocks' order); int4_avx2.h's needs a tile of its own.
constexpr int kGemmRows = 8;

template <int MT, int E>
void gemm_q8(const QuantRows& xq, const uint8_t* codes, const Scales& scales, const at::BFloat16* bias,
             at::BFloat16* y, int64_t K, int64_t groups, int64_t lda_y, int64_t rows) {
  block_q8<MT, E>(xq, codes, scales, bias, y, K, groups, lda_y, rows);
}

// The weights of one block of 16 rows as bf16, w = sum over planes of (scale * code + offset), in fp32 and rounded
// once: out (rows, K) row-major, K = the codes of one plane.
template <int E>
void dequant_block(const uint8_t* codes, const Scales& scales, at::BFloat16* out, int64_t K, int64_t groups,
                   int64_t rows) {
  constexpr int kMaxPlanes = 2;
  const int64_t G = K / kGroup, planes = groups / G;
  const __m512i field = _mm512_set1_epi16(0x0078), one = _mm512_set1_epi16(0x3F80);
  const __m512 sixteen = _mm512_set1_ps(16.f);
  // lane j = 2i + e of a code vector is row i: the rows' scales spread over the pairs, for each half of the lanes
  const __m512i lo_rows = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_rows = _mm512_add_epi32(lo_rows, _mm512_set1_epi32(8));
  const auto to_fp32 = [](__m256i h) {  // 16 bf16 -> fp32: a 16-bit shift
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  };
  for (int64_t g = 0; g < G; ++g) {
    __m512 s_lo[kMaxPlanes], s_hi[kMaxPlanes], o_lo[kMaxPlanes], o_hi[kMaxPlanes];
    for (int64_t p = 0; p < planes; ++p) {
      __m512 s, o;
      load_scales<E>(scales, p * G + g, s, o);
      s = _mm512_mul_ps(s, sixteen);  // the codes read as 1 + c / 16, as in `block`
      o = _mm512_sub_ps(o, s);
      s_lo[p] = _mm512_permutexvar_ps(lo_rows, s), s_hi[p] = _mm512_permutexvar_ps(hi_rows, s);
      o_lo[p] = _mm512_permutexvar_ps(lo_rows, o), o_hi[p] = _mm512_permutexvar_ps(hi_rows, o);
    }
    for (int c = 0; c < kGroup / 8; ++c) {
      __m512i d[4];  // per nibble t, dword i = row i's two weights at columns 8c + 2t, 8c + 2t + 1 of this group
      for (int t = 0; t < 4; ++t) {
        __m512 lo = _mm512_setzero_ps(), hi = _mm512_setzero_ps();  // lanes 2i + e of rows 0-7, and of rows 8-15
        for (int64_t p = 0; p < planes; ++p) {
          const __m512i v = _mm512_loadu_si512(codes + ((p * G + g) * (kGroup / 8) + c) * 64);
          const __m512i shifted = t == 0 ? _mm512_slli_epi16(v, 3) : _mm512_srli_epi16(v, 4 * t - 3);
          const __m512i w = _mm512_ternarylogic_epi32(shifted, field, one, 0xEA);
          lo = _mm512_add_ps(lo, _mm512_fmadd_ps(to_fp32(_mm512_castsi512_si256(w)), s_lo[p], o_lo[p]));
          hi = _mm512_add_ps(hi, _mm512_fmadd_ps(to_fp32(_mm512_extracti64x4_epi64(w, 1)), s_hi[p], o_hi[p]));
        }
        d[t] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
      }
      // transpose: row i's dwords of t = 0..3 (its 8 weights of this chunk), 4 rows per result, one per 128-bit lane
      const __m512i a = _mm512_unpacklo_epi32(d[0], d[1]), b = _mm512_unpackhi_epi32(d[0], d[1]);
      const __m512i e = _mm512_unpacklo_epi32(d[2], d[3]), f = _mm512_unpackhi_epi32(d[2], d[3]);
      const __m512i r[4] = {_mm512_unpacklo_epi64(a, e), _mm512_unpackhi_epi64(a, e), _mm512_unpacklo_epi64(b, f),
                            _mm512_unpackhi_epi64(b, f)};  // lane L of r[q] is row 4L + q
      alignas(64) uint8_t lanes[4][64];
      for (int q = 0; q < 4; ++q) _mm512_store_si512(lanes[q], r[q]);
      const int64_t col = g * kGroup + c * 8;
      for (int64_t i = 0; i < rows; ++i) std::memcpy(out + i * K + col, lanes[i % 4] + (i / 4) * 16, 16);
    }
  }
}
