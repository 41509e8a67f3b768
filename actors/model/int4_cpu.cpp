// Int4 weight-only matmul for small batches on AVX512-BF16 CPUs: y = x @ W.T (+ bias), W as 4-bit codes with an
// fp32 scale and offset per group of 32 weights of a row (w = scale * code + offset), exact in fp32 arithmetic.
//
// Why: torch's `_weight_int4pack_mm_for_cpu` dequantizes every weight with fp32 FMAs and re-does that work for
// each block of 4 input rows, so it is compute-bound at one token and costs about 3x as much for the 5 rows of a
// k = 4 verification. Here codes become bf16 integers with one table lookup (exact: 0..15), and VDPBF16PS takes
// 32 multiply-adds per instruction for every input row, so the weights are unpacked once per 8 rows and the scale
// is applied once per group; products of bf16 values are exact in fp32 and sums are fp32.
//
// Layout (made by actors/model/int4_cpu.py): rows in blocks of 16; per block, the K codes (all planes side by
// side) in chunks of 4: 32 bytes where byte j = 2i + e holds row i's code at k + e in its low nibble and at
// k + 2 + e in its high nibble. Scales and offsets: (blocks, groups, 16) fp32. Planes: codes of 5-8 bits are
// split into 4-bit planes laid side by side along K; plane p reads the same input x (k mod K).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstring>

namespace {

constexpr int kRows = 16;   // rows per block (one fp32 vector of outputs)
constexpr int kGroup = 32;  // weights per scale group
constexpr int kTile = 8;    // input rows per pass over a block's codes

inline __m512i bf16_table() {
  alignas(64) uint16_t t[32];
  for (int c = 0; c < 32; ++c) {
    float f = static_cast<float>(c & 15);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    t[c] = static_cast<uint16_t>(bits >> 16);  // exact: small integers have no bits below bf16's
  }
  return _mm512_load_si512(t);
}

// One block of 16 rows against MT input rows: y[m, rows] over every group of every plane.
template <int MT>
void block(const uint16_t* x, const float* xsum, const uint8_t* codes, const float* scale, const float* offset,
           const at::BFloat16* bias, at::BFloat16* y, int64_t K, int64_t groups, int64_t lda_y, int64_t rows,
           __m512i table) {
  const int64_t G = K / kGroup;  // groups per plane
  const __m512i low = _mm512_set1_epi16(0x0F);
  __m512 acc[MT];
  for (int m = 0; m < MT; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t xk = (g % G) * kGroup;  // the input columns of this group (planes share them)
    __m512 lo_sum[MT], hi_sum[MT];
    for (int m = 0; m < MT; ++m) lo_sum[m] = hi_sum[m] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < kGroup / 4; ++c) {
      const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(
          reinterpret_cast<const __m256i*>(codes + (g * (kGroup / 4) + c) * 32)));
      const __m512bh lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(v, low), table);
      const __m512bh hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
#pragma GCC unroll 8
      for (int m = 0; m < MT; ++m) {
        const uint16_t* xm = x + m * K + xk + c * 4;
        int32_t x01, x23;
        std::memcpy(&x01, xm, 4);
        std::memcpy(&x23, xm + 2, 4);
        lo_sum[m] = _mm512_dpbf16_ps(lo_sum[m], lo, (__m512bh)_mm512_set1_epi32(x01));
        hi_sum[m] = _mm512_dpbf16_ps(hi_sum[m], hi, (__m512bh)_mm512_set1_epi32(x23));
      }
    }
    const __m512 s = _mm512_loadu_ps(scale + g * kRows);
    const __m512 o = _mm512_loadu_ps(offset + g * kRows);
#pragma GCC unroll 8
    for (int m = 0; m < MT; ++m) {
      acc[m] = _mm512_fmadd_ps(_mm512_add_ps(lo_sum[m], hi_sum[m]), s, acc[m]);
      acc[m] = _mm512_fmadd_ps(o, _mm512_set1_ps(xsum[m * G + g % G]), acc[m]);
    }
  }
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

using BlockFn = void (*)(const uint16_t*, const float*, const uint8_t*, const float*, const float*,
                         const at::BFloat16*, at::BFloat16*, int64_t, int64_t, int64_t, int64_t, __m512i);
constexpr BlockFn kBlocks[kTile + 1] = {nullptr, block<1>, block<2>, block<3>, block<4>,
                                        block<5>, block<6>, block<7>, block<8>};

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                   const std::optional<at::Tensor>& bias, int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous (M, K) bf16");
  const int64_t M = x.size(0), K = x.size(1), blocks = codes.size(0), groups = scale.size(1);
  TORCH_CHECK(K % kGroup == 0 && groups % (K / kGroup) == 0, "K must be a whole number of groups of 32");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.size(1) * 4 == groups * kGroup,
              "codes: (blocks, groups * 8, 32) uint8");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && offset.scalar_type() == at::kFloat && scale.is_contiguous() &&
                  offset.is_contiguous() && scale.size(0) == blocks && scale.size(2) == kRows,
              "scale, offset: (blocks, groups, 16) fp32");
  TORCH_CHECK(n > (blocks - 1) * kRows && n <= blocks * kRows, "n must fall in the last block");
  const at::BFloat16* b = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == n, "bias: (n,) bf16");
    b = bias->data_ptr<at::BFloat16>();
  }
  at::Tensor y = at::empty({M, n}, x.options());
  const int64_t G = K / kGroup;
  at::Tensor xsum = at::empty({M, G}, x.options().dtype(at::kFloat));  // each group's input sum, for the offsets
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  float* xs = xsum.data_ptr<float>();
  for (int64_t i = 0; i < M * G; ++i) {
    float s = 0.f;
    for (int j = 0; j < kGroup; ++j) {
      uint32_t bits = uint32_t(xp[i * kGroup + j]) << 16;
      float f;
      std::memcpy(&f, &bits, 4);
      s += f;
    }
    xs[i] = s;
  }
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  const float *sp = scale.data_ptr<float>(), *op = offset.data_ptr<float>();
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  const __m512i table = bf16_table();
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t nb = lo; nb < hi; ++nb) {
      const int64_t rows = std::min<int64_t>(kRows, n - nb * kRows);
      for (int64_t m0 = 0; m0 < M; m0 += kTile) {
        const int mt = static_cast<int>(std::min<int64_t>(kTile, M - m0));
        kBlocks[mt](xp + m0 * K, xs + m0 * G, cp + nb * groups * 8 * 32, sp + nb * groups * kRows,
                    op + nb * groups * kRows, b == nullptr ? nullptr : b + nb * kRows, yp + m0 * n + nb * kRows,
                    K, groups, n, rows, table);
      }
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(specfleet, m) {
  m.def("int4_mm(Tensor x, Tensor codes, Tensor scale, Tensor offset, Tensor? bias, int n) -> Tensor");
}

TORCH_LIBRARY_IMPL(specfleet, CPU, m) { m.impl("int4_mm", &int4_mm); }
