// The int4 matmul's AVX2 kernels (AVX2, FMA, F16C): included by int4_cpu.cpp inside its namespace, after the
// layout's constants and structs, in place of int4_avx512.h, with the same functions computing the same sums in the
// same order, so that each output is the AVX512 kernel's bits:
// - int8 inputs (block_q8): VPDPBUSD's exact int32 sums as VPMADDUBSW (codes 0..15 unsigned times the inputs
//   -127..127 signed, in pairs to int16) and VPMADDWD (pairs of int16 to int32). llama.cpp's Q4 x Q8 AVX2 path
//   takes signed codes (c - 8) and moves their sign onto the inputs (VPSIGNB) before VPMADDUBSW; our codes are
//   unsigned, VPMADDUBSW's unsigned operand as they are, so no sign trick is needed. No int16 sum saturates:
//   |c q| <= 15 * 127, a pair <= 3810, a group's 4 chunks x 2 nibbles <= 30480 < 32767.
// - bf16 inputs (block): VDPBF16PS adds the product of the odd bf16 pair, then of the even one, to its fp32
//   accumulator, each rounded once; both products are exact in fp32 (8-bit significands), so an FMA of each in that
//   order is the same sum. Where they differ: VDPBF16PS takes denormal inputs as zero (so do we) and flushes a
//   denormal partial sum to zero (we keep it): different bits only where a partial sum is below 2^-126.
// - the output's bf16 rounding: cpu_isa.h's, VCVTNEPS2BF16's.

using sfv::V16;

template <int E>
inline void load_scales(const Scales& sc, int64_t g, V16& s, V16& o) {
  if constexpr (E == kFloat) {
    s = sfv::load(static_cast<const float*>(sc.scale) + g * kRows);
    o = sfv::load(static_cast<const float*>(sc.offset) + g * kRows);
  } else {
    const int64_t at = (E == kHalf ? g : g / 8) * kRows;
    const auto half = [&](const void* p) {  // 16 fp16 -> fp32 (exact)
      const __m128i* h = reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + at);
      return V16{_mm256_cvtph_ps(_mm_loadu_si128(h)), _mm256_cvtph_ps(_mm_loadu_si128(h + 1))};
    };
    s = half(sc.scale);
    o = half(sc.offset);
    if constexpr (E == kTwoLevel) {
      const auto mult = [&](const uint8_t* p) {
        const auto eight = [](const uint8_t* q) {
          return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
        };
        return V16{eight(p + g * kRows), eight(p + g * kRows + 8)};
      };
      s = sfv::mul(s, mult(sc.scale_mult));
      o = sfv::mul(o, mult(sc.offset_mult));
    }
  }
}

// A block's outputs: MT rows of 16 fp32 sums plus the bias, rounded to bf16, the block's real rows stored.
template <int MT>
inline void store(const V16* acc, const at::BFloat16* bias, at::BFloat16* y, int64_t lda_y, int64_t rows) {
  alignas(32) float b[kRows] = {};
  if (bias != nullptr) {
    for (int64_t i = 0; i < rows; ++i) b[i] = static_cast<float>(bias[i]);
  }
  const V16 bv = sfv::load(b);
  for (int m = 0; m < MT; ++m) {
    const __m256i out = sfv::bf16_bits(sfv::add(acc[m], bv));
    if (rows >= kRows) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + m * lda_y), out);
    } else {
      alignas(32) uint16_t bits[kRows];
      _mm256_store_si256(reinterpret_cast<__m256i*>(bits), out);
      std::memcpy(y + m * lda_y, bits, rows * 2);
    }
  }
}

// The codes of nibble T of each 16-bit word E (0: low, 1: high) of 8 rows' dwords as fp32 1 + c / 16:
// 0x3F800000 | c << 19 (c in the top 4 of the 23 significand bits), the number VDPBF16PS reads as bf16 0x3F80 | c << 3.
template <int E, int T>
inline __m256 unpack(__m256i v) {
  constexpr int kFrom = 16 * E + 4 * T;  // the nibble's lowest bit
  const __m256i field = _mm256_set1_epi32(0x00780000), one = _mm256_set1_epi32(0x3F800000);
  const __m256i moved = kFrom <= 19 ? _mm256_slli_epi32(v, 19 - kFrom) : _mm256_srli_epi32(v, kFrom - 19);
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(moved, field), one));
}

template <int E, int T>
inline V16 unpack16(__m256i v0, __m256i v1) {
  return {unpack<E, T>(v0), unpack<E, T>(v1)};
}

// One bf16 input as fp32, a denormal as zero (VDPBF16PS's).
inline float input(uint16_t bits) {
  uint32_t u = uint32_t(bits) << 16;
  if ((u & 0x7F800000u) == 0) u &= 0x80000000u;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The chunk's nibble T against MT rows: the odd input of the pair (word 1), then the even one, as VDPBF16PS.
template <int MT, int T>
inline void pair_step(const uint16_t* x, int64_t K, int64_t col, __m256i v0, __m256i v1, V16 (*sum)[2]) {
  const V16 w0 = unpack16<0, T>(v0, v1), w1 = unpack16<1, T>(v0, v1);
#pragma GCC unroll 8
  for (int m = 0; m < MT; ++m) {
    const uint16_t* xm = x + m * K + col + 2 * T;
    V16& s = sum[m][T % 2];
    s = sfv::fmadd(w1, sfv::set1(input(xm[1])), s);
    s = sfv::fmadd(w0, sfv::set1(input(xm[0])), s);
  }
}

// One block of 16 rows against MT input rows: int4_avx512.h's `block`, in the same order (two accumulators per row,
// nibbles 0, 2 in the first and 1, 3 in the second), row-invariant as it is.
template <int MT, int E>
void block(const uint16_t* x, const float* xsum, const uint8_t* codes, const Scales& scales,
           const at::BFloat16* bias, at::BFloat16* y, int64_t K, int64_t groups, int64_t lda_y, int64_t rows) {
  const int64_t G = K / kGroup;
  const V16 sixteen = sfv::set1(16.f);
  V16 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = sfv::zero();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t xk = (g % G) * kGroup;
    V16 sum[MT][2];
    for (int m = 0; m < MT; ++m) sum[m][0] = sum[m][1] = sfv::zero();
    prefetch_group(codes + g * (kGroup / 8) * 64);
    for (int c = 0; c < kGroup / 8; ++c) {
      const uint8_t* p = codes + (g * (kGroup / 8) + c) * 64;
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));  // rows 0-7
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));  // rows 8-15
      const int64_t col = xk + c * 8;
      pair_step<MT, 0>(x, K, col, v0, v1, sum);
      pair_step<MT, 1>(x, K, col, v0, v1, sum);
      pair_step<MT, 2>(x, K, col, v0, v1, sum);
      pair_step<MT, 3>(x, K, col, v0, v1, sum);
    }
    V16 s, o;
    load_scales<E>(scales, g, s, o);
    s = sfv::mul(s, sixteen);  // the codes were read as 1 + c / 16
    o = sfv::sub(o, s);
    for (int m = 0; m < MT; ++m) {
      const V16 total = sfv::add(sum[m][0], sum[m][1]);
      acc[m] = sfv::fmadd(total, s, acc[m]);
      acc[m] = sfv::fmadd(o, sfv::set1(xsum[m * G + g % G]), acc[m]);
    }
  }
  store<MT>(acc, bias, y, lda_y, rows);
}

// int4_avx512.h's block_q8 on AVX2: a group's integer sums exact (int16 per pair of nibbles, int32 at the group's
// end), then the same fp32 steps in the same order.
template <int MT, int E>
void block_q8(const QuantRows& xq, const uint8_t* codes, const Scales& scales, const at::BFloat16* bias,
              at::BFloat16* y, int64_t K, int64_t groups, int64_t lda_y, int64_t rows) {
  const int64_t G = K / kGroup;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  V16 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = sfv::zero();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t xk = (g % G) * kGroup;
    __m256i sum[MT][2];  // int16 pairs of rows 0-7, of rows 8-15
    for (int m = 0; m < MT; ++m) sum[m][0] = sum[m][1] = _mm256_setzero_si256();
    prefetch_group(codes + g * (kGroup / 8) * 64);
#pragma GCC unroll 4
    for (int c = 0; c < kGroup / 8; ++c) {
      const uint8_t* p = codes + (g * (kGroup / 8) + c) * 64;
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
      const __m256i lo0 = _mm256_and_si256(v0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
      const __m256i lo1 = _mm256_and_si256(v1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const int8_t* qm = xq.q + m * K + xk + c * 8;
        int32_t a, b;
        std::memcpy(&a, qm, 4);
        std::memcpy(&b, qm + 4, 4);
        const __m256i qa = _mm256_set1_epi32(a), qb = _mm256_set1_epi32(b);
        sum[m][0] = _mm256_add_epi16(sum[m][0], _mm256_add_epi16(_mm256_maddubs_epi16(lo0, qa),
                                                                 _mm256_maddubs_epi16(hi0, qb)));
        sum[m][1] = _mm256_add_epi16(sum[m][1], _mm256_add_epi16(_mm256_maddubs_epi16(lo1, qa),
                                                                 _mm256_maddubs_epi16(hi1, qb)));
      }
    }
    V16 s, o;
    load_scales<E>(scales, g, s, o);
    for (int m = 0; m < MT; ++m) {
      const V16 total{_mm256_cvtepi32_ps(_mm256_madd_epi16(sum[m][0], ones)),
                      _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[m][1], ones))};
      acc[m] = sfv::fmadd(total, sfv::mul(s, sfv::set1(xq.d[m * G + g % G])), acc[m]);
      acc[m] = sfv::fmadd(o, sfv::set1(xq.xsum[m * G + g % G]), acc[m]);
    }
  }
  store<MT>(acc, bias, y, lda_y, rows);
}

// A prefill's int4 x int8 matmul (int4_gemm_q8 in int4_cpu.cpp): block_q8's sums for a tile of MT <= kGemmRows
// input rows against one block of 16 weight rows, in the same order, so each output is block_q8's bits whatever M
// (and so the AVX512 build's). AVX2 has 16 vector registers: block_q8's tile of 8 rows holds 16 of int16 sums and 16
// of fp32 accumulators, and spills inside its inner loop; here the tile's int16 sums (8), the unpacked codes (4) and
// the two broadcast inputs stay in registers, and the fp32 accumulators, touched once per group of 32 inputs, live
// in L1 (a memory round trip changes no bit).
constexpr int kGemmRows = 4;

template <int MT, int E>
void gemm_q8(const QuantRows& xq, const uint8_t* codes, const Scales& scales, const at::BFloat16* bias,
             at::BFloat16* y, int64_t K, int64_t groups, int64_t lda_y, int64_t rows) {
  static_assert(MT >= 1 && MT <= kGemmRows);
  const int64_t G = K / kGroup;
  const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  alignas(32) float acc[MT][kRows] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t xk = (g % G) * kGroup;
    __m256i sum[MT][2];  // int16 pairs of rows 0-7, of rows 8-15 (exact: block_q8's bound)
    for (int m = 0; m < MT; ++m) sum[m][0] = sum[m][1] = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int c = 0; c < kGroup / 8; ++c) {
      const uint8_t* p = codes + (g * (kGroup / 8) + c) * 64;
      const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32));
      const __m256i lo0 = _mm256_and_si256(v0, low), hi0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
      const __m256i lo1 = _mm256_and_si256(v1, low), hi1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
#pragma GCC unroll 4
      for (int m = 0; m < MT; ++m) {
        const int8_t* qm = xq.q + m * K + xk + c * 8;
        int32_t a, b;
        std::memcpy(&a, qm, 4);
        std::memcpy(&b, qm + 4, 4);
        const __m256i qa = _mm256_set1_epi32(a), qb = _mm256_set1_epi32(b);
        sum[m][0] = _mm256_add_epi16(sum[m][0], _mm256_maddubs_epi16(lo0, qa));
        sum[m][1] = _mm256_add_epi16(sum[m][1], _mm256_maddubs_epi16(lo1, qa));
        sum[m][0] = _mm256_add_epi16(sum[m][0], _mm256_maddubs_epi16(hi0, qb));
        sum[m][1] = _mm256_add_epi16(sum[m][1], _mm256_maddubs_epi16(hi1, qb));
      }
    }
    V16 s, o;
    load_scales<E>(scales, g, s, o);
    for (int m = 0; m < MT; ++m) {  // block_q8's fp32 steps, in its order
      const V16 total{_mm256_cvtepi32_ps(_mm256_madd_epi16(sum[m][0], ones)),
                      _mm256_cvtepi32_ps(_mm256_madd_epi16(sum[m][1], ones))};
      V16 a = sfv::load(acc[m]);
      a = sfv::fmadd(total, sfv::mul(s, sfv::set1(xq.d[m * G + g % G])), a);
      a = sfv::fmadd(o, sfv::set1(xq.xsum[m * G + g % G]), a);
      sfv::store(acc[m], a);
    }
  }
  V16 out[MT];
  for (int m = 0; m < MT; ++m) out[m] = sfv::load(acc[m]);
  store<MT>(out, bias, y, lda_y, rows);
}

// The column 2T + E of a chunk of every plane, for the 16 rows: the sum over planes of (scale * code + offset).
template <int E, int T>
inline V16 dequant_column(const uint8_t* codes, int64_t stride, int64_t planes, const V16* s, const V16* o) {
  V16 w = sfv::zero();
  for (int64_t p = 0; p < planes; ++p) {
    const uint8_t* at = codes + p * stride;
    const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
    const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at + 32));
    w = sfv::add(w, sfv::fmadd(unpack16<E, T>(v0, v1), s[p], o[p]));
  }
  return w;
}

// int4_avx512.h's dequant_block: the same fp32 steps per weight, rounded once; out (rows, K) row-major.
template <int E>
void dequant_block(const uint8_t* codes, const Scales& scales, at::BFloat16* out, int64_t K, int64_t groups,
                   int64_t rows) {
  constexpr int kMaxPlanes = 2;
  const int64_t G = K / kGroup, planes = groups / G, stride = G * (kGroup / 8) * 64;  // a plane's codes
  for (int64_t g = 0; g < G; ++g) {
    V16 s[kMaxPlanes], o[kMaxPlanes];
    for (int64_t p = 0; p < planes; ++p) {
      load_scales<E>(scales, p * G + g, s[p], o[p]);
      s[p] = sfv::mul(s[p], sfv::set1(16.f));  // the codes read as 1 + c / 16, as in `block`
      o[p] = sfv::sub(o[p], s[p]);
    }
    for (int c = 0; c < kGroup / 8; ++c) {
      const uint8_t* at = codes + (g * (kGroup / 8) + c) * 64;
      alignas(32) uint16_t cols[8][kRows];  // column j of the chunk, for each row
      const V16 w[8] = {dequant_column<0, 0>(at, stride, planes, s, o), dequant_column<1, 0>(at, stride, planes, s, o),
                        dequant_column<0, 1>(at, stride, planes, s, o), dequant_column<1, 1>(at, stride, planes, s, o),
                        dequant_column<0, 2>(at, stride, planes, s, o), dequant_column<1, 2>(at, stride, planes, s, o),
                        dequant_column<0, 3>(at, stride, planes, s, o), dequant_column<1, 3>(at, stride, planes, s, o)};
      for (int j = 0; j < 8; ++j) _mm256_store_si256(reinterpret_cast<__m256i*>(cols[j]), sfv::bf16_bits(w[j]));
      const int64_t col = g * kGroup + c * 8;
      for (int64_t i = 0; i < rows; ++i) {
        uint16_t* dst = reinterpret_cast<uint16_t*>(out + i * K + col);
        for (int j = 0; j < 8; ++j) dst[j] = cols[j][i];
      }
    }
  }
}
