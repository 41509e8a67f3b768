// The small per-layer steps of a bf16 decode on the CPU, each one call instead of several torch ops: RMSNorm (and
// the residual add before it), rotary embedding in place (with Qwen3's and Gemma 3's q/k norms before it), the gated
// product of the MLP (SiLU, or GELU's tanh form for Gemma's GeGLU), and attention of one sequence over its consecutive
// cache slots with the new keys and values written first. At one token a step's torch ops take a few microseconds
// each to dispatch and allocate; a 30-layer model ran about 35 of them per layer (docs/benchmarks.md). Arithmetic is
// fp32, rounded to bf16 where the reference rounds (noted per op). Written on cpu_isa.h's 16-lane vectors: the same
// source, and the same bits, on AVX512 and on AVX2.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_isa.h"

namespace {

using bf16 = c10::BFloat16;

inline float f32(bf16 v) { return static_cast<float>(v); }

using sfv::V16;

inline float dot(const float* a, const bf16* b, int64_t n) {  // n % 16 == 0
  V16 acc = sfv::zero();
  for (int64_t i = 0; i < n; i += 16) acc = sfv::fmadd(sfv::load(a + i), sfv::load_bf16(b + i), acc);
  return sfv::reduce_add(acc);
}

inline void axpy(float* y, float a, const bf16* x, int64_t n) {  // y += a * x, n % 16 == 0
  const V16 av = sfv::set1(a);
  for (int64_t i = 0; i < n; i += 16) sfv::store(y + i, sfv::fmadd(av, sfv::load_bf16(x + i), sfv::load(y + i)));
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.stride(1) == 1, name, ": (M, H) bf16 rows");
}

// A norm's gain, by its dtype: bf16 is Llama's (Qwen's) weight, fp32 is Gemma's 1 + w (actors/model/layers.py
// gemma_gain). 16 lanes of x / rms(x) (fp32) -> the normed values, rounded to bf16: Llama's order rounds x / rms
// first and again after the weight (transformers' LlamaRMSNorm); Gemma's multiplies the fp32 gain in and rounds once
// (its Gemma3RMSNorm, computed in fp32).
template <typename W>
inline V16 gained(V16 n, const W* w) {
  if constexpr (std::is_same_v<W, float>) return sfv::round_bf16(sfv::mul(n, sfv::load(w)));
  else return sfv::round_bf16(sfv::mul(sfv::load_bf16(w), sfv::round_bf16(n)));
}

// 1 / rms of h values (h % 16 == 0): the sum of squares in 16 lanes, their fixed tree
inline V16 inv_rms(const bf16* x, int64_t h, double eps) {
  V16 ss = sfv::zero();
  for (int64_t j = 0; j < h; j += 16) {
    const V16 v = sfv::load_bf16(x + j);
    ss = sfv::fmadd(v, v, ss);
  }
  return sfv::set1(1.0f / std::sqrt(sfv::reduce_add(ss) / h + static_cast<float>(eps)));
}

template <typename W>
void rms_rows(const bf16* x, int64_t ldx, const W* w, bf16* y, int64_t ldy, int64_t m, int64_t h, double eps) {
  for (int64_t i = 0; i < m; ++i) {
    const bf16* xi = x + i * ldx;
    const V16 r = inv_rms(xi, h, eps);
    for (int64_t j = 0; j < h; j += 16) sfv::store_bf16(y + i * ldy + j, gained(sfv::mul(sfv::load_bf16(xi + j), r), w + j));
  }
}

// rms_rows in the form of w's dtype (`gained`); w: (h,)
void rms_rows(const bf16* x, int64_t ldx, const at::Tensor& w, bf16* y, int64_t ldy, int64_t m, int64_t h, double eps) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == h && w.is_contiguous(), "norm gain: (", h, ") contiguous");
  if (w.scalar_type() == at::kFloat) return rms_rows(x, ldx, w.data_ptr<float>(), y, ldy, m, h, eps);
  TORCH_CHECK(w.scalar_type() == at::kBFloat16, "norm gain: bf16 (Llama's weight) or fp32 (Gemma's 1 + w)");
  rms_rows(x, ldx, w.data_ptr<bf16>(), y, ldy, m, h, eps);
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  check_rows(x, "x");
  const int64_t m = x.size(0), h = x.size(1);
  at::Tensor y = at::empty({m, h}, x.options());
  rms_rows(x.data_ptr<bf16>(), x.stride(0), w.contiguous(), y.data_ptr<bf16>(), h, m, h, eps);
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
      sfv::store_bf16(sp + i * h + j, sfv::add(sfv::load_bf16(xp + i * x.stride(0) + j), sfv::load_bf16(rp + i * r.stride(0) + j)));
  at::Tensor y = at::empty({m, h}, x.options());
  rms_rows(sp, h, w.contiguous(), y.data_ptr<bf16>(), h, m, h, eps);
  return {s, y};
}

// One head's hd values x (fp32, each a bf16) rotated: x * cos + roll(x, hd/2) * sin with sin's first half negated
// (actors/model/layers.py apply_rope), in fp32, rounded once, stored at v. c, s: the position's (hd,) cos and sin.
inline void rotate(bf16* v, const V16* x, const bf16* c, const bf16* s, int64_t hd) {
  for (int64_t j = 0; j < hd; j += 16) {
    const V16 rolled = x[((j + hd / 2) % hd) / 16];
    sfv::store_bf16(v + j, sfv::fmadd(rolled, sfv::load_bf16(s + j), sfv::mul(x[j / 16], sfv::load_bf16(c + j))));
  }
}

// The rotation's operands for qk (N, heads, hd), the last dimension contiguous: cos and sin as (N, hd) rows
std::tuple<at::Tensor, at::Tensor> rope_rows(const at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(qk.dim() == 3 && qk.scalar_type() == at::kBFloat16 && qk.stride(2) == 1, "qk: (N, heads, hd) bf16");
  const int64_t n = qk.size(0), hd = qk.size(2);
  TORCH_CHECK(hd % 32 == 0 && hd <= 256, "rope_: head dim a multiple of 32, at most 256");
  return {cos.reshape({n, hd}).contiguous(), sin.reshape({n, hd}).contiguous()};
}

// Rotary embedding in place on qk (N, heads, hd) (`rotate`).
void rope_(at::Tensor& qk, const at::Tensor& cos, const at::Tensor& sin) {
  const auto [c, s] = rope_rows(qk, cos, sin);
  const int64_t n = qk.size(0), heads = qk.size(1), hd = qk.size(2);
  const bf16 *cp = c.data_ptr<bf16>(), *sp = s.data_ptr<bf16>();
  bf16* base = qk.data_ptr<bf16>();
  for (int64_t t = 0; t < n; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      bf16* v = base + t * qk.stride(0) + h * qk.stride(1);
      V16 x[16];  // hd <= 256
      for (int64_t j = 0; j < hd; j += 16) x[j / 16] = sfv::load_bf16(v + j);
      rotate(v, x, cp + t * hd, sp + t * hd, hd);
    }
}

// Qwen3's and Gemma 3's q/k norms, then rotary embedding, in place on qk (N, nh + kvh, hd): each head RMS-normed over
// its hd values with q_w (the first nh heads) or k_w (the others), in the form of the gains' dtype (`gained`: bf16
// Qwen's, fp32 Gemma's 1 + w), rounded to bf16, then rotated as rope_ does. Bit for bit rms_norm over each head and
// then rope_, in one pass over the heads.
void norm_rope_(at::Tensor& qk, const at::Tensor& q_w, const at::Tensor& k_w, int64_t nh, double eps,
                const at::Tensor& cos, const at::Tensor& sin) {
  at::Tensor c, s;  // named, not bound: the lambda below reads them
  std::tie(c, s) = rope_rows(qk, cos, sin);
  const int64_t n = qk.size(0), heads = qk.size(1), hd = qk.size(2);
  TORCH_CHECK(q_w.scalar_type() == k_w.scalar_type() && q_w.numel() == hd && k_w.numel() == hd && nh <= heads,
              "q/k norm gains: (hd,) each, one dtype");
  const at::Tensor qw = q_w.contiguous(), kw = k_w.contiguous();
  const auto run = [&](const auto* qg, const auto* kg) {
    const bf16 *cp = c.data_ptr<bf16>(), *sp = s.data_ptr<bf16>();
    bf16* base = qk.data_ptr<bf16>();
    for (int64_t t = 0; t < n; ++t)
      for (int64_t h = 0; h < heads; ++h) {
        bf16* v = base + t * qk.stride(0) + h * qk.stride(1);
        const auto* w = h < nh ? qg : kg;
        const V16 r = inv_rms(v, hd, eps);
        V16 x[16];  // hd <= 256
        for (int64_t j = 0; j < hd; j += 16) x[j / 16] = gained(sfv::mul(sfv::load_bf16(v + j), r), w + j);
        rotate(v, x, cp + t * hd, sp + t * hd, hd);
      }
  };
  if (qw.scalar_type() == at::kFloat) return run(qw.data_ptr<float>(), kw.data_ptr<float>());
  TORCH_CHECK(qw.scalar_type() == at::kBFloat16, "q/k norm gains: bf16 (Qwen's weight) or fp32 (Gemma's 1 + w)");
  run(qw.data_ptr<bf16>(), kw.data_ptr<bf16>());
}

// gu (M, 2I): gate then up -> act(gate) (rounded to bf16, as the activation's output) * up, act(a) = a / (1 + e^z)
// with z from `exponent`: SiLU's -a; GELU's tanh form (Gemma's GeGLU: transformers' gelu_pytorch_tanh),
// 0.5 a (1 + tanh u) with u = sqrt(2 / pi) (a + 0.044715 a^3), is a / (1 + e^(-2u)), 0.5 (1 + tanh u) being the
// logistic function of 2u: z = a (c1 + c2 a^2), c1 = -2 sqrt(2 / pi), c2 = 0.044715 c1.
template <typename Exponent>
at::Tensor gated_mul(const at::Tensor& gu, Exponent exponent) {
  check_rows(gu, "gu");
  const int64_t m = gu.size(0), i2 = gu.size(1), in = i2 / 2;
  TORCH_CHECK(in % 16 == 0, "gu: the gate's width a multiple of 16");
  at::Tensor y = at::empty({m, in}, gu.options());
  const bf16* g = gu.data_ptr<bf16>();
  bf16* yp = y.data_ptr<bf16>();
  const V16 one = sfv::set1(1.f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < in; j += 16) {
      const V16 a = sfv::load_bf16(g + r * gu.stride(0) + j);
      const V16 act = sfv::round_bf16(sfv::div(a, sfv::add(one, sfv::exp(exponent(a)))));
      sfv::store_bf16(yp + r * in + j, sfv::mul(act, sfv::load_bf16(g + r * gu.stride(0) + in + j)));
    }
  return y;
}

at::Tensor silu_mul(const at::Tensor& gu) {
  return gated_mul(gu, [](V16 a) { return sfv::sub(sfv::zero(), a); });
}

at::Tensor gelu_tanh_mul(const at::Tensor& gu) {
  constexpr float c1 = -1.5957691216057308f, c2 = 0.044715f * c1;  // -2 sqrt(2 / pi), 0.044715 of it
  return gated_mul(gu, [](V16 a) { return sfv::mul(a, sfv::fmadd(sfv::set1(c2), sfv::mul(a, a), sfv::set1(c1))); });
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
      V16 total = sfv::zero();
      for (int64_t s = 0; s < count; s += 16) {
        const V16 e = sfv::exp(sfv::sub(sfv::load(p.data() + first + s), sfv::set1(top)));
        sfv::store(p.data() + first + s, e);
        total = sfv::add(total, e);
      }
      const float sum = sfv::reduce_add(total);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t s = first; s <= pos; ++s) axpy(acc.data(), p[s], vp + ((start + s) * kvh + kv) * hd, hd);
      for (int64_t j = 0; j < hd; ++j) op[i * nh * hd + head * hd + j] = bf16(acc[j] / sum);
    }
  });
  return out;
}

}  // namespace

SF_FRAGMENT(m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor r, Tensor w, float eps) -> (Tensor, Tensor)");
  m.def("rope_(Tensor(a!) qk, Tensor cos, Tensor sin) -> ()");
  m.def("norm_rope_(Tensor(a!) qk, Tensor q_w, Tensor k_w, int nh, float eps, Tensor cos, Tensor sin) -> ()");
  m.def("silu_mul(Tensor gu) -> Tensor");
  m.def("gelu_tanh_mul(Tensor gu) -> Tensor");
  m.def("span_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) kpool, Tensor(b!) vpool, Tensor slots, int start, "
        "int length, int window) -> Tensor");
}

SF_IMPL(m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_", &rope_);
  m.impl("norm_rope_", &norm_rope_);
  m.impl("silu_mul", &silu_mul);
  m.impl("gelu_tanh_mul", &gelu_tanh_mul);
  m.impl("span_attention", &span_attention);
}
