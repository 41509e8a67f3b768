// Int4 weight-only matmul for small batches on the CPU: y = x @ W.T (+ bias), W as 4-bit codes with
// an fp32 scale and offset per group of 32 weights of a row (w = scale * code + offset), in fp32 arithmetic. Two
// forms of the input: bf16 as given (int4_mm, below), or each row rounded to int8 per group of 32 (int4_mm_q8,
// further down: llama.cpp's Q4 x Q8 dot products, twice the multiply-adds per instruction).
//
// Why: torch's `_weight_int4pack_mm_for_cpu` dequantizes every weight with fp32 FMAs and re-does that work for
// each block of 4 input rows, so it costs about 3x as much for the 5 rows of a k = 4 verification as for one.
// Here a code c becomes the bf16 number 1 + c / 16 with a shift and one bitwise operation (0x3F80 | c << 3: c in
// the top 4 of the 7 mantissa bits, exact), and VDPBF16PS takes 32 multiply-adds per instruction for every input
// row, so the weights are unpacked once per 8 input rows and the scale is applied once per group:
// y = 16 scale * sum x (1 + c / 16) + (offset - 16 scale) * sum x. Products of bf16 values are exact in fp32, sums
// are fp32 (the added 1 costs a bit or two of fp32's 24 in a group's sum, far below the bf16 output's rounding).
//
// Layout (made by actors/model/cpu_kernels.py): rows in blocks of 16; per block, the K codes (all planes side by
// side) in chunks of 8: 32 16-bit words, word j = 2i + e holding row i's codes at k + 2t + e in its nibble t
// (t = 0..3), so that nibble t of every word is one VDPBF16PS operand (16 rows x the input pair k + 2t, k + 2t + 1).
// Scales and offsets per block, in one of three encodings (Encoding below). Planes: codes of 5-8 bits are split
// into 4-bit planes laid side by side along K; plane p reads the same input x (k mod K). The blocks are shared
// among torch's threads (at::parallel_for: the extension is built with OpenMP; each output row is computed by one
// thread, in one order, whatever the thread count or the number of input rows).
//
// ISAs: this file holds what every ISA shares (the operands' checks, the tiling over threads, the rounding of the
// inputs to int8, the ops' registration); the block kernels are int4_avx512.h (VDPBF16PS, VPDPBUSD) or
// int4_avx2.h (FMA, VPMADDUBSW), chosen by the build's flags (cpu_isa.h). Both sum in the same order with the same
// roundings, so the AVX2 build gives the AVX512 build's bits (docs/weights.md says where not: denormals).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstring>
#include <utility>

#include "cpu_isa.h"  // the ISA of this build, its vectors and the ops' namespace

namespace {

constexpr int kRows = 16;   // rows per block (one fp32 vector of outputs)
constexpr int kGroup = 32;  // weights per scale group
constexpr int kTile = 8;    // input rows per pass over a block's codes
// bytes of codes a group's loop asks the cache for ahead of its reads: this VM's hardware prefetch alone streamed the
// 1.5B's gate_up from memory at 6.1 GB/s, at 13-17 GB/s with this (docs/weights.md); 1-4 KB measured alike
constexpr int kAhead = 2048;

// Asks for the 256 bytes of codes kAhead past a group's first byte (a hint: past the end of the array it is dropped).
inline void prefetch_group(const uint8_t* group) {
  for (int line = 0; line < 4; ++line) {
    _mm_prefetch(reinterpret_cast<const char*>(group + kAhead + 64 * line), _MM_HINT_T0);
  }
}

// Where a block's group scales and offsets are: fp32 per group (kFloat), fp16 per group (kHalf), or fp16 per 8
// groups times a small integer per group (kTwoLevel: the K-quants' super-block scales, scale = d * sc, offset =
// dm * mn). All three are exact for what they hold; the smaller ones read fewer bytes per weight.
enum Encoding { kFloat = 0, kHalf = 1, kTwoLevel = 2 };

struct Scales {
  const void* scale;   // (groups or groups / 8, 16) per block, fp32 or fp16
  const void* offset;
  const uint8_t* scale_mult;  // kTwoLevel: (groups, 16) per block
  const uint8_t* offset_mult;
};

// QuantRows: rows rounded to int8 for int4_mm_q8 (quantize_rows below; what its kernels compute: int4_avx512.h)
struct QuantRows {
  const int8_t* q;     // (M, K) the inputs rounded, in the codes' order per chunk of 8
  const float* d;      // (M, G) each group's scale
  const float* xsum;   // (M, G) each group's rounded sum, d * sum q
};

#if SPECFLEET_AVX512
#include "int4_avx512.h"  // load_scales, store, block, block_q8, dequant_block
#else
#include "int4_avx2.h"  // the same on AVX2
#endif

using BlockFn = void (*)(const uint16_t*, const float*, const uint8_t*, const Scales&, const at::BFloat16*,
                         at::BFloat16*, int64_t, int64_t, int64_t, int64_t);

template <int E>
constexpr BlockFn kBlocks[kTile + 1] = {nullptr, block<1, E>, block<2, E>, block<3, E>, block<4, E>,
                                        block<5, E>, block<6, E>, block<7, E>, block<8, E>};

// A packed weight's tensors, checked: codes, scales and offsets in one of the encodings, n real rows.
struct Packed {
  int64_t blocks, groups;  // blocks of 16 rows; groups of 32 codes per row (every plane's)
  int enc;
  const uint8_t* codes;
  const char *scale, *offset;
  int64_t per_block;  // bytes of one block's scales
  const uint8_t *scale_mult, *offset_mult;

  Packed(const at::Tensor& codes_, const at::Tensor& scale_, const at::Tensor& offset_,
         const std::optional<at::Tensor>& scale_mult_, const std::optional<at::Tensor>& offset_mult_, int64_t n) {
    TORCH_CHECK(codes_.scalar_type() == at::kByte && codes_.is_contiguous() && codes_.dim() == 3 &&
                    codes_.size(1) % 4 == 0 && codes_.size(2) == 64,
                "codes: (blocks, groups * 4, 64) uint8");
    blocks = codes_.size(0);
    groups = codes_.size(1) / 4;
    const bool two_level = scale_mult_.has_value();
    enc = two_level ? kTwoLevel : scale_.scalar_type() == at::kHalf ? kHalf : kFloat;
    TORCH_CHECK(scale_.scalar_type() == offset_.scalar_type() && scale_.is_contiguous() && offset_.is_contiguous() &&
                    (enc == kFloat ? scale_.scalar_type() == at::kFloat : scale_.scalar_type() == at::kHalf) &&
                    scale_.size(0) == blocks && scale_.size(1) == (two_level ? groups / 8 : groups) &&
                    scale_.size(2) == kRows && offset_.sizes() == scale_.sizes(),
                "scale, offset: (blocks, groups, 16) fp32 or fp16, or (blocks, groups / 8, 16) fp16 with multipliers");
    if (two_level) {
      TORCH_CHECK(offset_mult_.has_value() && groups % 8 == 0 && scale_mult_->scalar_type() == at::kByte &&
                      offset_mult_->scalar_type() == at::kByte && scale_mult_->is_contiguous() &&
                      offset_mult_->is_contiguous() && scale_mult_->numel() == blocks * groups * kRows &&
                      offset_mult_->numel() == blocks * groups * kRows,
                  "scale_mult, offset_mult: (blocks, groups, 16) uint8");
    }
    TORCH_CHECK(n > (blocks - 1) * kRows && n <= blocks * kRows, "n must fall in the last block");
    codes = codes_.data_ptr<uint8_t>();
    scale = static_cast<const char*>(scale_.data_ptr());
    offset = static_cast<const char*>(offset_.data_ptr());
    per_block = scale_.size(1) * kRows * scale_.element_size();
    scale_mult = two_level ? scale_mult_->data_ptr<uint8_t>() : nullptr;
    offset_mult = two_level ? offset_mult_->data_ptr<uint8_t>() : nullptr;
  }

  Scales of(int64_t nb) const {
    return Scales{scale + nb * per_block, offset + nb * per_block,
                  scale_mult != nullptr ? scale_mult + nb * groups * kRows : nullptr,
                  offset_mult != nullptr ? offset_mult + nb * groups * kRows : nullptr};
  }
  const uint8_t* codes_of(int64_t nb) const { return codes + nb * groups * 4 * 64; }
};

// One matmul's checked operands: the packed weight, the input's shape, the bias (or null) and the output (M, n);
// `for_each_tile` runs a block function over every block of 16 weight rows and tile of up to kTile input rows,
// the blocks shared among torch's threads.
struct Call {
  Packed w;
  int64_t M, K, G;
  const at::BFloat16* bias = nullptr;
  at::Tensor y;

  Call(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
       const std::optional<at::Tensor>& scale_mult, const std::optional<at::Tensor>& offset_mult,
       const std::optional<at::Tensor>& bias_, int64_t n)
      : w(codes, scale, offset, scale_mult, offset_mult, n), M(x.size(0)), K(x.size(1)), G(x.size(1) / kGroup) {
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), "x: contiguous (M, K) bf16");
    TORCH_CHECK(K % kGroup == 0 && w.groups % G == 0, "K must be a whole number of groups of 32");
    if (bias_.has_value()) {
      TORCH_CHECK(bias_->scalar_type() == at::kBFloat16 && bias_->is_contiguous() && bias_->numel() == n,
                  "bias: (n,) bf16");
      bias = bias_->data_ptr<at::BFloat16>();
    }
    y = at::empty({M, n}, x.options());
  }

  // fn(nb, m0, mt, rows, scales): block nb (rows of it real) against input rows m0 .. m0 + mt
  template <typename Fn>
  void for_each_tile(int64_t n, const Fn& fn) const {
    at::parallel_for(0, w.blocks, 1, [&](int64_t lo, int64_t hi) {
      for (int64_t nb = lo; nb < hi; ++nb) {
        const int64_t rows = std::min<int64_t>(kRows, n - nb * kRows);
        const Scales sc = w.of(nb);
        for (int64_t m0 = 0; m0 < M; m0 += kTile) {
          fn(nb, m0, static_cast<int>(std::min<int64_t>(kTile, M - m0)), rows, sc);
        }
      }
    });
  }
  const at::BFloat16* bias_of(int64_t nb) const { return bias == nullptr ? nullptr : bias + nb * kRows; }
  at::BFloat16* out(int64_t m0, int64_t nb, int64_t n) const {
    return y.data_ptr<at::BFloat16>() + m0 * n + nb * kRows;
  }
};

at::Tensor int4_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                   const std::optional<at::Tensor>& scale_mult, const std::optional<at::Tensor>& offset_mult,
                   const std::optional<at::Tensor>& bias, int64_t n) {
  const Call call(x, codes, scale, offset, scale_mult, offset_mult, bias, n);
  const int64_t M = call.M, K = call.K, G = call.G;
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
  const int enc = call.w.enc;
  const BlockFn* fns = enc == kFloat ? kBlocks<kFloat> : enc == kHalf ? kBlocks<kHalf> : kBlocks<kTwoLevel>;
  call.for_each_tile(n, [&](int64_t nb, int64_t m0, int mt, int64_t rows, const Scales& sc) {
    fns[mt](xp + m0 * K, xs + m0 * G, call.w.codes_of(nb), sc, call.bias_of(nb), call.out(m0, nb, n), K, call.w.groups,
            n, rows);
  });
  return call.y;
}


using BlockQ8Fn = void (*)(const QuantRows&, const uint8_t*, const Scales&, const at::BFloat16*, at::BFloat16*,
                           int64_t, int64_t, int64_t, int64_t);

template <int E>
constexpr BlockQ8Fn kBlocksQ8[kTile + 1] = {nullptr, block_q8<1, E>, block_q8<2, E>, block_q8<3, E>,
                                            block_q8<4, E>, block_q8<5, E>, block_q8<6, E>, block_q8<7, E>,
                                            block_q8<8, E>};

// Rounds one group of 32 bf16 inputs to int8: q[j] = round(x[j] * 127 / max |x|) (ties to even), d = max |x| / 127.
inline float round_group(const uint16_t* x, int8_t* q) {
  float f[kGroup], amax = 0.f;
  for (int j = 0; j < kGroup; ++j) {
    const uint32_t bits = uint32_t(x[j]) << 16;
    std::memcpy(&f[j], &bits, 4);
    amax = std::max(amax, std::fabs(f[j]));
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int j = 0; j < kGroup; ++j) q[j] = static_cast<int8_t>(std::nearbyint(f[j] * inv));
  return amax / 127.f;
}

// Rounds each row's groups of 32 to int8 (QuantRows): q (M, K) in the codes' order, d and xsum (M, G). Each group
// alone, so shared among threads (a prefill's rows) with the same bits as in one.
void quantize_rows(const uint16_t* x, int64_t MG, int8_t* q, float* d, float* xsum) {
  static const int kOrder[8] = {0, 4, 1, 5, 2, 6, 3, 7};  // position j of a chunk holds input kOrder[j]
  at::parallel_for(0, MG, 256, [&](int64_t lo, int64_t hi) {
  for (int64_t i = lo; i < hi; ++i) {
    int8_t r[kGroup];
    d[i] = round_group(x + i * kGroup, r);
    int32_t s = 0;
    for (int j = 0; j < kGroup; ++j) {
      q[i * kGroup + j] = r[(j / 8) * 8 + kOrder[j % 8]];
      s += r[j];
    }
    xsum[i] = d[i] * static_cast<float>(s);
  }
  });
}

// The rows as int4_mm_q8 sees them, q d rounded to bf16 (M, K): what a prefill's dense GEMM takes in their place.
at::Tensor int8_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous() && x.size(1) % kGroup == 0,
              "x: contiguous (M, K) bf16, K a multiple of 32");
  at::Tensor out = at::empty_like(x);
  const uint16_t* xp = reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>());
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  at::parallel_for(0, x.numel() / kGroup, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      int8_t r[kGroup];
      const float d = round_group(xp + i * kGroup, r);
      for (int j = 0; j < kGroup; ++j) op[i * kGroup + j] = at::BFloat16(d * static_cast<float>(r[j]));
    }
  });
  return out;
}

at::Tensor int4_mm_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                      const std::optional<at::Tensor>& scale_mult, const std::optional<at::Tensor>& offset_mult,
                      const std::optional<at::Tensor>& bias, int64_t n) {
  const Call call(x, codes, scale, offset, scale_mult, offset_mult, bias, n);
  const int64_t M = call.M, K = call.K, G = call.G;
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor ds = at::empty({2, M, G}, x.options().dtype(at::kFloat));  // d, then d * sum q
  float* dp = ds.data_ptr<float>();
  quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M * G, q.data_ptr<int8_t>(), dp,
                dp + M * G);
  const int8_t* qp = q.data_ptr<int8_t>();
  const int enc = call.w.enc;
  const BlockQ8Fn* fns = enc == kFloat ? kBlocksQ8<kFloat> : enc == kHalf ? kBlocksQ8<kHalf> : kBlocksQ8<kTwoLevel>;
  call.for_each_tile(n, [&](int64_t nb, int64_t m0, int mt, int64_t rows, const Scales& sc) {
    const QuantRows part{qp + m0 * K, dp + m0 * G, dp + M * G + m0 * G};
    fns[mt](part, call.w.codes_of(nb), sc, call.bias_of(nb), call.out(m0, nb, n), K, call.w.groups, n, rows);
  });
  return call.y;
}

// A prefill's matmul on int8 inputs (int4_gemm_q8): int4_mm_q8's result, bit for bit, for any M (the same int32
// sums of each group, exact in any order, and the same fp32 steps per output in the same order of groups: each
// row's output does not depend on the rows beside it, so deterministic mode keeps it). What differs is the tiling:
// each thread takes whole blocks of 16 weight rows and runs every tile of input rows over a block while its codes
// are in L1, on the ISA's register tile (gemm_q8, kGemmRows rows: int4_avx2.h's fits AVX2's 16 registers).
using GemmQ8Fn = BlockQ8Fn;

template <int E, int... I>
constexpr std::array<GemmQ8Fn, sizeof...(I) + 1> gemm_table(std::integer_sequence<int, I...>) {
  return {nullptr, gemm_q8<I + 1, E>...};
}
template <int E>
constexpr auto kGemmQ8 = gemm_table<E>(std::make_integer_sequence<int, kGemmRows>{});

at::Tensor int4_gemm_q8(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scale,
                        const at::Tensor& offset, const std::optional<at::Tensor>& scale_mult,
                        const std::optional<at::Tensor>& offset_mult, const std::optional<at::Tensor>& bias,
                        int64_t n) {
  const Call call(x, codes, scale, offset, scale_mult, offset_mult, bias, n);
  const int64_t M = call.M, K = call.K, G = call.G;
  at::Tensor q = at::empty({M, K}, x.options().dtype(at::kChar));
  at::Tensor ds = at::empty({2, M, G}, x.options().dtype(at::kFloat));  // d, then d * sum q
  float* dp = ds.data_ptr<float>();
  quantize_rows(reinterpret_cast<const uint16_t*>(x.data_ptr<at::BFloat16>()), M * G, q.data_ptr<int8_t>(), dp,
                dp + M * G);
  const int8_t* qp = q.data_ptr<int8_t>();
  const int enc = call.w.enc;
  const auto& fns = enc == kFloat ? kGemmQ8<kFloat> : enc == kHalf ? kGemmQ8<kHalf> : kGemmQ8<kTwoLevel>;
  at::parallel_for(0, call.w.blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t nb = lo; nb < hi; ++nb) {
      const int64_t rows = std::min<int64_t>(kRows, n - nb * kRows);
      const Scales sc = call.w.of(nb);
      for (int64_t m0 = 0; m0 < M; m0 += kGemmRows) {
        const QuantRows part{qp + m0 * K, dp + m0 * G, dp + M * G + m0 * G};
        fns[std::min<int64_t>(kGemmRows, M - m0)](part, call.w.codes_of(nb), sc, call.bias_of(nb),
                                                   call.out(m0, nb, n), K, call.w.groups, n, rows);
      }
    }
  });
  return call.y;
}

using DequantFn = void (*)(const uint8_t*, const Scales&, at::BFloat16*, int64_t, int64_t, int64_t);

at::Tensor int4_dequant(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                        const std::optional<at::Tensor>& scale_mult, const std::optional<at::Tensor>& offset_mult,
                        int64_t n, int64_t k) {
  const Packed w(codes, scale, offset, scale_mult, offset_mult, n);
  TORCH_CHECK(k % kGroup == 0 && w.groups % (k / kGroup) == 0, "k must be a whole number of groups of 32");
  at::Tensor out = at::empty({n, k}, at::TensorOptions().dtype(at::kBFloat16));
  at::BFloat16* op = out.data_ptr<at::BFloat16>();
  const DequantFn fn = w.enc == kFloat ? dequant_block<kFloat> : w.enc == kHalf ? dequant_block<kHalf>
                                                                                 : dequant_block<kTwoLevel>;
  at::parallel_for(0, w.blocks, 1, [&](int64_t lo, int64_t hi) {
    for (int64_t nb = lo; nb < hi; ++nb) {
      fn(w.codes_of(nb), w.of(nb), op + nb * kRows * k, k, w.groups, std::min<int64_t>(kRows, n - nb * kRows));
    }
  });
  return out;
}

}  // namespace

SF_LIBRARY(m) {
  m.def("int4_mm(Tensor x, Tensor codes, Tensor scale, Tensor offset, Tensor? scale_mult, Tensor? offset_mult, "
        "Tensor? bias, int n) -> Tensor");
  m.def("int4_mm_q8(Tensor x, Tensor codes, Tensor scale, Tensor offset, Tensor? scale_mult, Tensor? offset_mult, "
        "Tensor? bias, int n) -> Tensor");
  m.def("int4_gemm_q8(Tensor x, Tensor codes, Tensor scale, Tensor offset, Tensor? scale_mult, Tensor? offset_mult, "
        "Tensor? bias, int n) -> Tensor");
  m.def("int8_rows(Tensor x) -> Tensor");
  m.def("int4_dequant(Tensor codes, Tensor scale, Tensor offset, Tensor? scale_mult, Tensor? offset_mult, int n, "
        "int k) -> Tensor");
}

SF_IMPL(m) {
  m.impl("int4_mm", &int4_mm);
  m.impl("int4_mm_q8", &int4_mm_q8);
  m.impl("int4_gemm_q8", &int4_gemm_q8);
  m.impl("int8_rows", &int8_rows);
  m.impl("int4_dequant", &int4_dequant);
}
