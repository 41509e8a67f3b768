// The small per-layer steps of a bf16 decode on the CPU, each one call instead of several torch ops: RMSNorm (and
// the residual add before it), rotary embedding in place, SiLU-gated product, and attention of one sequence over
// its consecutive cache slots with the new keys and values written first. At one token a step's torch ops take a
// few microseconds each to dispatch and allocate; a 30-layer model ran about 35 of them per layer
// (docs/benchmarks.md). Arithmetic is fp32, rounded to bf16 where the reference rounds (noted per op).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using bf16 = c10::BFloat16;

inline float f32(bf16 v) { return static_cast<float>(v); }

// 16 bf16 -> 16 fp32 (exact)
inline __m512 load16(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// 16 fp32 -> 16 bf16, round to nearest even (as torch's casts)
inline void store16(bf16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}

// fp32 rounded to bf16 and back (a bf16 intermediate of the reference)
inline __m512 round16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}

// e^v: 2^n * 2^f with n = round(v log2 e), |f| <= 1/2, 2^f by its Taylor polynomial of degree 7 (relative error
// below 1e-7 for |f| <= 1/2); inputs below -87 give 0 (what softmax and SiLU need of them)
inline __m512 exp16(__m512 v) {
  const __m512 t = _mm512_mul_ps(_mm512_max_ps(v, _mm512_set1_ps(-87.f)), _mm512_set1_ps(1.4426950408889634f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));  // f ln 2
  __m512 p = _mm512_set1_ps(1.f / 5040);
  for (float c : {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f}) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

inline float dot(const float* a, const bf16* b, int64_t n) {  // n % 16 == 0
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), load16(b + i), acc);
  return _mm512_reduce_add_ps(acc);
}

inline void axpy(float* y, float a, const bf16* x, int64_t n) {  // y += a * x, n % 16 == 0
  const __m512 av = _mm512_set1_ps(a);
  for (int64_t i = 0; i < n; i += 16) _mm512_storeu_ps(y + i, _mm512_fmadd_ps(av, load16(x + i), _mm512_loadu_ps(y + i)));
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, name, ": (M, H) bf16 rows");
}

// Llama's order: h = x / rms(x) in fp32, rounded to bf16, then times the weight (rounded again). h % 16 == 0.
void rms_rows(const bf16* x, int64_t ldx, const bf16* w, bf16* y, int64_t ldy, int64_t m, int64_t h, double eps) {
  for (int64_t i = 0; i < m; ++i) {
    const bf16* xi = x + i * ldx;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t j = 0; j < h; j += 16) {
      const __m512 v = load16(xi + j);
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 r = _mm512_set1_ps(1.0f / std::sqrt(_mm512_reduce_add_ps(ss) / h + static_cast<float>(eps)));
    for (int64_t j = 0; j < h; j += 16)
      store16(y + i * ldy + j, _mm512_mul_ps(load16(w + j), round16(_mm512_mul_ps(load16(xi + j), r))));
  }
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  const int64_t m = x.size(0), h = x.size(1);
  at::Tensor y = at::empty({m, h}, x.options());
  rms_rows(x.data_ptr<bf16>(), x.stride(0), w.contiguous().data_ptr<bf16>(), y.data_ptr<bf16>(), h, m, h, eps);
  return y;
}

// s = x + r (rounded to bf16, as torch's add), and rms_norm(s)
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& r, const at::Tensor& w,
                                                double eps) {
  check_rows(x, "x");
  check_rows(r, "r");
  const int64_t m = x.size(0), h = x.size(1);
  at::Tensor s = at::empty({m, h}, x.options());
  bf16* sp = s.data_ptr<bf16>();
  const bf16 *xp = x.data_ptr<bf16>(), *rp = r.data_ptr<bf16>();
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < h; j += 16)
      store16(sp + i * h + j, _mm512_add_ps(load16(xp + i * x.stride(0) + j), load16(rp + i * r.stride(0) + j)));
  at::Tensor y = at::empty({m, h}, x.options());
  rms_rows(sp, h, w.contiguous().data_ptr<bf16>(), y.data_ptr<bf16>(), h, m, h, eps);
  return {s, y};
}

// Rotary embedding in place on qk (N, heads, hd), the last dimension contiguous: x * cos + roll(x, hd/2) * sin with
// sin's first half negated (actors/model/layers.py apply_rope), in fp32, rounded once.
void rope_(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(qk.dim() == 3 && qk.scalar_type() == at::kBFloat16 && qk.stride(2) == 1, "qk: (N, heads, hd) bf16");
  const int64_t n = qk.size(0), heads = qk.size(1), hd = qk.size(2), half = hd / 2;
  TORCH_CHECK(hd % 32 == 0 && hd <= 256, "rope_: head dim a multiple of 32, at most 256");
  const at::Tensor c = cos.reshape({n, hd}).contiguous(), s = sin.reshape({n, hd}).contiguous();
  const bf16 *cp = c.data_ptr<bf16>(), *sp = s.data_ptr<bf16>();
  bf16* base = qk.data_ptr<bf16>();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      bf16* v = base + t * qk.stride(0) + h * qk.stride(1);
      __m512 x[16];  // hd <= 256
      for (int64_t j = 0; j < hd; j += 16) x[j / 16] = load16(v + j);
      for (int64_t j = 0; j < hd; j += 16) {
        const __m512 rolled = x[((j + half) % hd) / 16];
        store16(v + j, _mm512_fmadd_ps(rolled, load16(sp + t * hd + j), _mm512_mul_ps(x[j / 16], load16(cp + t * hd + j))));
      }
    }
}

// gu (M, 2I): gate then up -> silu(gate) (rounded to bf16, as the activation's output) * up
at::Tensor silu_mul(const at::Tensor& gu) {
  check_rows(gu, "gu");
  const int64_t m = gu.size(0), i2 = gu.size(1), in = i2 / 2;
  at::Tensor y = at::empty({m, in}, gu.options());
  const bf16* g = gu.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < in; j += 16) {
      const __m512 a = load16(g + r * gu.stride(0) + j);
      const __m512 act = round16(_mm512_div_ps(a, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), a)))));
      store16(yp + r * in + j, _mm512_mul_ps(act, load16(g + r * gu.stride(0) + in + j)));
    }
  return y;
}

// One sequence whose cache slots [start, start + length) are consecutive: write the T new keys and values at
// `slots`, then attend each of the T queries (positions length - T .. length - 1) to the keys at positions
// <= its own (and > its own - window, if window > 0). Softmax and sums in fp32, the output rounded to bf16.
at::Tensor span_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, at::Tensor& kpool,
                          at::Tensor& vpool, const at::Tensor& slots, int64_t start, int64_t length, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == at::kBFloat16 && q.stride(2) == 1, "q: (T, nh, hd) bf16");
  TORCH_CHECK(kpool.is_contiguous() && vpool.is_contiguous() && kpool.scalar_type() == at::kBFloat16,
              "pools: contiguous (slots, kvh, hd) bf16");
  const int64_t t = q.size(0), nh = q.size(1), hd = q.size(2), kvh = kpool.size(1), g = nh / kvh;
  TORCH_CHECK(hd % 16 == 0 && k.size(1) == kvh && kpool.size(2) == hd, "head dim a multiple of 16");
  TORCH_CHECK(start + length <= kpool.size(0) && t <= length, "span outside the pool");
  bf16 *kp = kpool.data_ptr<bf16>(), *vp = vpool.data_ptr<bf16>();
  const int64_t* sl = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    for (int64_t h = 0; h < kvh; ++h) {
      std::memcpy(kp + (sl[i] * kvh + h) * hd, k.data_ptr<bf16>() + i * k.stride(0) + h * k.stride(1), hd * 2);
      std::memcpy(vp + (sl[i] * kvh + h) * hd, v.data_ptr<bf16>() + i * v.stride(0) + h * v.stride(1), hd * 2);
    }
  at::Tensor out = at::empty({t, nh * hd}, q.options());
  bf16* op = out.data_ptr<bf16>();
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int64_t work = t * nh * length * hd;
  at::parallel_for(0, t * nh, work > (1 << 17) ? 1 : t * nh, [&](int64_t lo, int64_t hi) {
    std::vector<float> qf(hd), acc(hd), p(length + 16);
    for (int64_t row = lo; row < hi; ++row) {
      const int64_t i = row / nh, head = row % nh, kv = head / g;
      const int64_t pos = length - t + i, first = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      const bf16* qi = q.data_ptr<bf16>() + i * q.stride(0) + head * q.stride(1);
      for (int64_t j = 0; j < hd; ++j) qf[j] = f32(qi[j]) * scale;
      float top = -std::numeric_limits<float>::infinity();
      for (int64_t s = first; s <= pos; ++s) {
        p[s] = dot(qf.data(), kp + ((start + s) * kvh + kv) * hd, hd);
        top = std::max(top, p[s]);
      }
      const int64_t count = pos + 1 - first;
      for (int64_t s = count; s % 16; ++s) p[first + s] = -std::numeric_limits<float>::infinity();  // padding
      __m512 total = _mm512_setzero_ps();
      for (int64_t s = 0; s < count; s += 16) {
        const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p.data() + first + s), _mm512_set1_ps(top)));
        _mm512_storeu_ps(p.data() + first + s, e);
        total = _mm512_add_ps(total, e);
      }
      const float sum = _mm512_reduce_add_ps(total);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = first; s <= pos; ++s) axpy(acc.data(), p[s], vp + ((start + s) * kvh + kv) * hd, hd);
      for (int64_t j = 0; j < hd; ++j) op[i * nh * hd + head * hd + j] = bf16(acc[j] / sum);
    }
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(specfleet, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor r, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("span_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kpool, Tensor(b!) vpool, Tensor slots, int start, "
        "int length, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(specfleet, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("span_attention", &span_attention);
}
