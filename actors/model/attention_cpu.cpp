// Attention of a prefill chunk over its sequence's consecutive cache slots (chunk_attention): fused_cpu.cpp's
// span_attention, bit for bit for every query row, on tiles of query rows instead of one row at a time.
//
// Why: span_attention computes each (query row, head) alone, so it reads the sequence's keys and values once per
// row and head: for a 2,000-token prompt on the default 135M model (9 heads, 64 dims) that is about 4.6 GB of bf16
// reads per layer, and at that length attention took more of a prefill than the matmuls (docs/weights.md). Here
// the queries of kTileRows consecutive rows and of every head sharing one KV head (GQA's group) form one tile: each
// key and value row is loaded (and widened to fp32) once per tile and used by every query of it while in registers.
//
// Same bits as span_attention, by construction: every query's arithmetic is span_attention's, operation for
// operation in the same order (its score per key as one 16-lane FMA chain over the head dimension then the same
// horizontal sum, the max, the exponentials from its first key in steps of 16 and their sum, the weighted values
// added key by key in order, the division and the bf16 rounding); the tile only changes which query's operations
// run next to which. So deterministic mode may take it (a row's output does not depend on the rows beside it) and
// tests/unit/test_cpu_kernels.py holds it equal to span_attention on each ISA.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_isa.h"

namespace {

using bf16 = c10::BFloat16;
using sfv::V16;

constexpr int kTileRows = 4;  // query rows per tile (times the heads of one KV head's group)
constexpr int kMaxDim = 256;  // head dims up to this many (16-lane steps kept in registers per key)

at::Tensor chunk_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kpool,
                           at::Tensor& vpool, const at::Tensor& slots, int64_t start, int64_t length,
                           int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1, "q: (T, nh, hd) bf16");
  TORCH_CHECK(kpool.is_contiguous() && vpool.is_contiguous() && kpool.scalar_type() == at::kBFloat16,
              "pools: contiguous (slots, kvh, hd) bf16");
  const int64_t t = q.size(0), nh = q.size(1), hd = q.size(2), kvh = kpool.size(1), g = nh / kvh;
  TORCH_CHECK(hd % 16 == 0 && hd <= kMaxDim && k.size(1) == kvh && kpool.size(2) == hd,
              "head dim a multiple of 16, at most 256");
  TORCH_CHECK(start + length <= kpool.size(0) && t <= length, "span outside the pool");
  bf16 *kp = kpool.data_ptr<bf16>(), *vp = vpool.data_ptr<bf16>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)  // the new keys and values first, as span_attention writes them
    for (int64_t h = 0; h < kvh; ++h) {
      std::memcpy(kp + (sl[i] * kvh + h) * hd, k.data_ptr<bf16>() + i * k.stride(0) + h * k.stride(1), hd * 2);
      std::memcpy(vp + (sl[i] * kvh + h) * hd, v.data_ptr<bf16>() + i * v.stride(0) + h * v.stride(1), hd * 2);
    }
  at::Tensor out = at::empty({t, nh * hd}, q.options());
  bf16* op = out.data_ptr<bf16>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t tiles = (t + kTileRows - 1) / kTileRows, steps = hd / 16;
  at::parallel_for(0, tiles * kvh, 1, [&](int64_t lo, int64_t hi) {
    const int64_t width = kTileRows * g;  // queries of a tile: row r, head kv * g + e at index r * g + e
    std::vector<float> qf(width * hd), acc(width * hd), p(width * (length + 16));
    std::vector<int64_t> first(width), pos(width);
    std::vector<float> top(width), sum(width);
    for (int64_t item = lo; item < hi; ++item) {
      const int64_t i0 = (item / kvh) * kTileRows, kv = item % kvh;
      const int64_t rows = std::min<int64_t>(kTileRows, t - i0), n = rows * g;
      int64_t s_lo = length, s_hi = -1;
      for (int64_t a = 0; a < n; ++a) {
        const int64_t i = i0 + a / g, head = kv * g + a % g;
        pos[a] = length - t + i;
        first[a] = window > 0 ? std::max<int64_t>(0, pos[a] - window + 1) : 0;
        s_lo = std::min(s_lo, first[a]), s_hi = std::max(s_hi, pos[a]);
        const bf16* qi = q.data_ptr<bf16>() + i * q.stride(0) + head * q.stride(1);
        for (int64_t j = 0; j < hd; ++j) qf[a * hd + j] = static_cast<float>(qi[j]) * scale;
        top[a] = -std::numeric_limits<float>::infinity();
      }
      float* pa = p.data();
      const int64_t ldp = length + 16;
      for (int64_t s = s_lo; s <= s_hi; ++s) {  // scores: each key row widened once for the tile
        const bf16* ks = kp + ((start + s) * kvh + kv) * hd;
        V16 key[kMaxDim / 16];
        for (int64_t c = 0; c < steps; ++c) key[c] = sfv::load_bf16(ks + 16 * c);
        for (int64_t a = 0; a < n; ++a) {
          if (s < first[a] || s > pos[a]) continue;
          V16 d = sfv::zero();
          for (int64_t c = 0; c < steps; ++c) d = sfv::fmadd(sfv::load(qf.data() + a * hd + 16 * c), key[c], d);
          const float score = sfv::reduce_add(d);
          pa[a * ldp + s] = score;
          top[a] = std::max(top[a], score);
        }
      }
      for (int64_t a = 0; a < n; ++a) {  // softmax's exponentials, each query's as span_attention's
        float* pr = pa + a * ldp;
        const int64_t count = pos[a] + 1 - first[a];
        for (int64_t s = count; s % 16; ++s) pr[first[a] + s] = -std::numeric_limits<float>::infinity();
        V16 total = sfv::zero();
        for (int64_t s = 0; s < count; s += 16) {
          const V16 e = sfv::exp(sfv::sub(sfv::load(pr + first[a] + s), sfv::set1(top[a])));
          sfv::store(pr + first[a] + s, e);
          total = sfv::add(total, e);
        }
        sum[a] = sfv::reduce_add(total);
        std::fill(acc.begin() + a * hd, acc.begin() + (a + 1) * hd, 0.f);
      }
      for (int64_t s = s_lo; s <= s_hi; ++s) {  // weighted values: each value row widened once for the tile
        const bf16* vs = vp + ((start + s) * kvh + kv) * hd;
        V16 val[kMaxDim / 16];
        for (int64_t c = 0; c < steps; ++c) val[c] = sfv::load_bf16(vs + 16 * c);
        for (int64_t a = 0; a < n; ++a) {
          if (s < first[a] || s > pos[a]) continue;
          const V16 w = sfv::set1(pa[a * ldp + s]);
          float* y = acc.data() + a * hd;
          for (int64_t c = 0; c < steps; ++c) sfv::store(y + 16 * c, sfv::fmadd(w, val[c], sfv::load(y + 16 * c)));
        }
      }
      for (int64_t a = 0; a < n; ++a) {
        const int64_t i = i0 + a / g, head = kv * g + a % g;
        for (int64_t j = 0; j < hd; ++j) op[i * nh * hd + head * hd + j] = bf16(acc[a * hd + j] / sum[a]);
      }
    }
  });
  return out;
}

}  // namespace

SF_FRAGMENT(m) {
  m.def("chunk_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kpool, Tensor(b!) vpool, Tensor slots, int start, "
        "int length, int window) -> Tensor");
}

SF_IMPL(m) { m.impl("chunk_attention", &chunk_attention); }
