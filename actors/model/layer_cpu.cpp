// One decoder layer's decode step in one call: the same ops as actors/model/layers.py runs them on our kernels (RMSNorm,
// the fused q/k/v projection, rotary embedding in place with Qwen3's and Gemma 3's q/k norms before it, Gemma's
// query scale, attention over the sequence's consecutive cache slots with the new K, V written, o_proj, Gemma's norm
// after the attention, the residual add with the norm before the feed-forward, gate-up, the gated product (SiLU, or
// GELU's tanh form), down, Gemma's norm after the feed-forward, the residual), called in the same order on the same
// tensors, so the layer's output is bit for bit the one the Python layer gives (`DecoderLayer._on_kernels`).
//
// Why: at one token a layer's ten to fifteen calls from Python cost more than their work on a small model
// (SmolLM2-135M: 30 layers, about a quarter of a step outside any op in `specfleet bench cpu --profile`); here each
// is a C++ call through the dispatcher. For a decode or verification step only (rows <= the layer's dense-GEMM
// threshold, one sequence on consecutive blocks, every projection on our int4 kernel): the Python layer does
// everything else.
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/mul.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "cpu_isa.h"  // SF_OP: the ops of this build's ISA

namespace {

using Opt = std::optional<at::Tensor>;

template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

// A projection on our int4 kernel: (codes, scale, offset, scale_mult, offset_mult, bias), an empty tensor for an
// absent one; n output features.
at::Tensor linear(const at::Tensor& x, at::TensorList w, int64_t n, bool int8) {
  TORCH_CHECK(w.size() == 6, "a projection: (codes, scale, offset, scale_mult, offset_mult, bias)");
  static const auto q8 = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const Opt&, const Opt&, const Opt&, int64_t)>(SF_OP("int4_mm_q8"));
  static const auto bf = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                       const Opt&, const Opt&, const Opt&, int64_t)>(SF_OP("int4_mm"));
  const auto opt = [](const at::Tensor& t) { return t.numel() > 0 ? Opt(t) : Opt(); };
  return (int8 ? q8 : bf).call(x, w[0], w[1], w[2], opt(w[3]), opt(w[4]), opt(w[5]), n);
}

// x (T, H) -> (T, H): layer of actors/model/layers.py DecoderLayer on a span of T new tokens. norms: the gains of the
// norm before the attention and of the one before the feed-forward, then Gemma's after the attention and after the
// feed-forward (4 in all) or none (2); a gain's dtype picks its form (fused_cpu.cpp `gained`). ns: the four
// projections' output features (qkv, o, gate_up, down); heads: (nh, kvh, hd); qk_norm: the q and k norms' gains, or
// none; q_scale: Gemma's score scale over hd ** -0.5, applied to q after RoPE (1: none); gelu: GELU's tanh form in
// the gated product (GeGLU), else SiLU.
at::Tensor decode_layer(const at::Tensor& x, at::TensorList norms, double eps, at::TensorList qkv_w,
                        at::TensorList o_w, at::TensorList gate_up_w, at::TensorList down_w, at::IntArrayRef ns,
                        bool int8, at::IntArrayRef heads, at::TensorList qk_norm, double q_scale, bool gelu,
                        const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kpool, at::Tensor& vpool,
                        const at::Tensor& slots, int64_t start, int64_t length, int64_t window) {
  TORCH_CHECK(ns.size() == 4 && heads.size() == 3, "ns: 4 output widths, heads: (nh, kvh, hd)");
  TORCH_CHECK(norms.size() == 2 || norms.size() == 4, "norms: before the attention and the feed-forward (and after)");
  TORCH_CHECK(qk_norm.empty() || qk_norm.size() == 2, "qk_norm: the q and the k gains, or none");
  static const auto rms = op<at::Tensor(const at::Tensor&, const at::Tensor&, double)>(SF_OP("rms_norm"));
  using Pair = std::tuple<at::Tensor, at::Tensor>;
  static const auto add_rms = op<Pair(const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>(
      SF_OP("add_rms_norm"));
  static const auto rope = op<void(at::Tensor&, const at::Tensor&, const at::Tensor&)>(SF_OP("rope_"));
  static const auto norm_rope = op<void(at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, double,
                                        const at::Tensor&, const at::Tensor&)>(SF_OP("norm_rope_"));
  static const auto silu_mul = op<at::Tensor(const at::Tensor&)>(SF_OP("silu_mul"));
  static const auto gelu_mul = op<at::Tensor(const at::Tensor&)>(SF_OP("gelu_tanh_mul"));
  static const auto attend = op<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, at::Tensor&,
                                           at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t)>(
      SF_OP("span_attention"));
  const int64_t t = x.size(0), nh = heads[0], kvh = heads[1], hd = heads[2];
  const bool sandwich = norms.size() == 4;
  at::Tensor qkv = linear(rms.call(x, norms[0], eps), qkv_w, ns[0], int8).view({t, nh + 2 * kvh, hd});
  at::Tensor qk = qkv.narrow(1, 0, nh + kvh);
  if (qk_norm.empty()) {
    rope.call(qk, cos, sin);  // in place
  } else {
    norm_rope.call(qk, qk_norm[0], qk_norm[1], nh, eps, cos, sin);  // in place
  }
  at::Tensor q = qkv.narrow(1, 0, nh);
  if (q_scale != 1.0) q = at::mul(q, q_scale);  // torch's op, as the Python layer's `q * q_scale`
  at::Tensor a = linear(attend.call(q, qkv.narrow(1, nh, kvh), qkv.narrow(1, nh + kvh, kvh), kpool, vpool, slots,
                                    start, length, window), o_w, ns[1], int8);
  if (sandwich) a = rms.call(a, norms[2], eps);
  auto [h, normed] = add_rms.call(x, a, norms[1], eps);
  at::Tensor gu = linear(normed, gate_up_w, ns[2], int8);
  at::Tensor y = linear(gelu ? gelu_mul.call(gu) : silu_mul.call(gu), down_w, ns[3], int8);
  if (sandwich) y = rms.call(y, norms[3], eps);
  return h.add_(y);
}

}  // namespace

SF_FRAGMENT(m) {
  m.def("decode_layer(Tensor x, Tensor[] norms, float eps, Tensor[] qkv, Tensor[] o, Tensor[] gate_up, Tensor[] down, "
        "int[] ns, bool int8, int[] heads, Tensor[] qk_norm, float q_scale, bool gelu, Tensor cos, Tensor sin, "
        "Tensor(a!) kpool, Tensor(b!) vpool, Tensor slots, int start, int length, int window) -> Tensor");
}

SF_IMPL(m) { m.impl("decode_layer", &decode_layer); }
