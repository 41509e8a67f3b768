"""Our fused CPU kernels (actors/model/fused_cpu.cpp) against the torch ops they replace, op by op and through a
whole bf16 model (Llama's norms, Qwen3's q/k norms, Gemma 3's (1 + w) norms around each half and GeGLU): each within
bf16 rounding of the reference, a model on them as close to its fp32 self as the same model on torch's ops, and a
decode step in one call (layer_cpu.cpp) bit for bit the same layer op by op. Every test runs on each ISA of ours
this CPU has (avx512, avx2: `kernel_isa`); their bit-for-bit agreement is tests/unit/test_cpu_isa.py's."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from actors.kv.cache import KVCache
from actors.model import cpu_kernels
from actors.model.layers import Attention, DecoderLayer, RopeTable, apply_rope, gemma_gain, rms_norm
from actors.model.loader import load_model
from actors.model.metadata import AttentionMetadata, SeqChunk
from actors.model.runner import ModelRunner
from cluster.config import CacheConfig
from tests.fixtures.tiny_models import build_tiny_model
from tests.unit.helpers import isa_params, text_prompts

# each ISA of ours, skipped where this CPU lacks it or the machine has no compiler or ninja (the model then runs on
# torch's ops: tests/unit/test_qlinear.py covers that path)
pytestmark = pytest.mark.parametrize("kernel_isa", isa_params(), indirect=True)
BF16 = dict(rtol=2**-7, atol=1e-2)  # a bf16 rounding or two


@pytest.fixture
def ops(kernel_isa: str):  # noqa: ANN201 - torch's op namespace object
    lib = cpu_kernels.ops()
    assert lib is not None, f"{kernel_isa}: this CPU has it, and a C++ compiler and ninja: it builds here"
    assert lib is getattr(torch.ops, f"specfleet_{kernel_isa}")
    return lib


def test_norms_and_gated_product_match_the_reference_order(ops) -> None:
    torch.manual_seed(0)
    x, r, w = (torch.randn(3, 96).bfloat16() for _ in range(3))
    w = w[0]

    def reference(v: torch.Tensor) -> torch.Tensor:  # Llama's: normalize in fp32, round, scale
        h = v.float()
        return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).bfloat16()

    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), reference(x), **BF16)
    s, normed = ops.add_rms_norm(x, r, w, 1e-5)
    assert torch.equal(s, x + r)
    torch.testing.assert_close(normed, reference(x + r), **BF16)
    gu = torch.randn(4, 2 * 48).bfloat16()
    torch.testing.assert_close(ops.silu_mul(gu), F.silu(gu[:, :48]) * gu[:, 48:], **BF16)
    gu = torch.cat([torch.randn(4, 48) * 6, torch.randn(4, 48)], dim=1).bfloat16()  # gates past tanh's flat ends
    want = F.gelu(gu[:, :48], approximate="tanh") * gu[:, 48:]  # Gemma's GeGLU (gelu_pytorch_tanh)
    torch.testing.assert_close(ops.gelu_tanh_mul(gu), want, **BF16)


def test_a_gemma_gain_is_taken_in_fp32_and_rounded_once(ops) -> None:
    """An fp32 gain is Gemma's 1 + w (gemma_gain): x / rms(x) times it in fp32, rounded once, as transformers'
    Gemma3RMSNorm computes it; the residual add before it as torch's."""
    torch.manual_seed(4)
    x, r = torch.randn(3, 96).bfloat16(), torch.randn(3, 96).bfloat16()
    gain = gemma_gain(torch.randn(96).bfloat16())  # (96,) fp32

    def reference(v: torch.Tensor) -> torch.Tensor:
        h = v.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * gain).bfloat16()

    assert gain.dtype == torch.float32
    torch.testing.assert_close(ops.rms_norm(x, gain, 1e-6), reference(x), rtol=2**-8, atol=1e-6)
    s, normed = ops.add_rms_norm(x, r, gain, 1e-6)
    assert torch.equal(s, x + r) and torch.equal(normed, ops.rms_norm(s, gain, 1e-6))
    torch.testing.assert_close(normed, rms_norm(s, gain, 1e-6, fp32=True), rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("form", ["qwen3", "gemma3"])
def test_qk_norms_then_rope_in_place_are_each_heads_norm_then_rope(ops, form: str) -> None:
    """norm_rope_: each of the nh query heads normed with the q gain and each key head with the k gain (Qwen3's bf16
    weights, or Gemma 3's fp32 1 + w), then rotated: bit for bit rms_norm over each head and then rope_, and within
    bf16 rounding of transformers' order (Qwen3RMSNorm: rounded, then times the weight; Gemma3RMSNorm: in fp32,
    rounded once; the rotation in fp32); the values heads after them untouched."""
    torch.manual_seed(5)
    nh, kvh, hd = 4, 2, 64
    rope = RopeTable(_rotary(hd), torch.bfloat16, torch.device("cpu"))
    cos, sin = rope(_meta([SeqChunk("r", tuple(range(5)))], _cache(hd)))
    weights = torch.randn(2, hd).bfloat16()
    gains = tuple(gemma_gain(w) for w in weights) if form == "gemma3" else tuple(weights)
    qkv = torch.randn(5, nh + 2 * kvh, hd).bfloat16()
    fused = qkv.clone()
    ops.norm_rope_(fused[:, :nh + kvh], *gains, nh, 1e-6, cos, sin)

    by_head = torch.cat([ops.rms_norm(qkv[:, :nh].reshape(-1, hd), gains[0], 1e-6).view(5, nh, hd),
                         ops.rms_norm(qkv[:, nh:nh + kvh].reshape(-1, hd), gains[1], 1e-6).view(5, kvh, hd)], 1)
    ops.rope_(by_head, cos, sin)
    assert torch.equal(fused[:, :nh + kvh], by_head) and torch.equal(fused[:, nh + kvh:], qkv[:, nh + kvh:])

    def reference(v: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:  # (5, heads, hd), transformers' order
        h = v.float() * torch.rsqrt(v.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return (h * gain).bfloat16() if form == "gemma3" else gain * h.bfloat16()

    normed = torch.cat([reference(qkv[:, :nh], gains[0]), reference(qkv[:, nh:nh + kvh], gains[1])], 1)
    want = apply_rope(normed.float(), cos.float(), sin.float()).bfloat16()
    torch.testing.assert_close(fused[:, :nh + kvh], want, **BF16)


def test_rope_in_place_matches_apply_rope(ops) -> None:
    torch.manual_seed(1)
    rope = RopeTable(_rotary(64), torch.bfloat16, torch.device("cpu"))
    meta = _meta([SeqChunk("r", tuple(range(5)))], _cache(64), )
    cos, sin = rope(meta)
    qkv = torch.randn(5, 7, 64).bfloat16()
    want = apply_rope(qkv[:, :5].float(), cos.float(), sin.float())  # in fp32, rounded once below
    ops.rope_(qkv[:, :5], cos, sin)
    torch.testing.assert_close(qkv[:, :5], want.bfloat16(), **BF16)


@pytest.mark.parametrize("window", [None, 6])
def test_span_attention_writes_kv_and_attends_like_the_torch_path(ops, window: int | None) -> None:
    torch.manual_seed(2)
    nh, kvh, hd = 6, 2, 32
    attn = Attention(torch.nn.Identity(), torch.nn.Identity(), nh, kvh, hd, window)
    torch_cache, our_cache = _cache(hd, kvh), _cache(hd, kvh)
    for chunk in (tuple(range(11)), (3, 4, 5), (7,)):  # a prefill, a verification, a decode step
        q = torch.randn(len(chunk), nh, hd).bfloat16()
        k, v = torch.randn(len(chunk), kvh, hd).bfloat16(), torch.randn(len(chunk), kvh, hd).bfloat16()
        outs = []
        for cache, fused in ((torch_cache, False), (our_cache, True)):
            meta = _meta([SeqChunk("r", chunk)], cache)
            assert meta.span is not None
            if fused:
                kpool, vpool = cache.pools(0)
                outs.append(ops.span_attention(q, k, v, kpool, vpool, meta.slots, *meta.span, window or 0))
            else:
                cache.write(0, meta.slots, k, v)
                outs.append(attn.backend.attend_span(q, cache, 0, meta))  # torch's span backend
            cache.set_length("r", meta.span[1])
        torch.testing.assert_close(outs[1], outs[0], **BF16)
    assert torch.equal(our_cache.k, torch_cache.k) and torch.equal(our_cache.v, torch_cache.v)


@pytest.mark.parametrize("family", ["mistral", "qwen3", "gemma3_text"])
def test_a_bf16_model_on_our_kernels_is_as_close_to_fp32_as_on_torchs_ops(tmp_path: Path, kernel_isa: str,
                                                                          family: str) -> None:
    """Mistral (Llama's norms, SiLU, a window of 24), Qwen3 (its q/k norms) and Gemma 3 (fp32 (1 + w) norms before
    and after each half, q/k norms, GeGLU, windows of 6 on alternate layers) with every part on our kernels."""
    path = build_tiny_model(family, tmp_path / "m", hidden_size=128, head_dim=32, intermediate_size=256)
    exact = ModelRunner(load_model(str(path), "fp32"), range(4), CacheConfig(block_size=4, num_blocks=64))
    model = load_model(str(path), "bf16")
    ours = ModelRunner(model, range(4), CacheConfig(block_size=4, num_blocks=64))
    assert all(layer.fused is getattr(torch.ops, f"specfleet_{kernel_isa}") and layer.attn.fused is layer.fused
               and layer.ffn.fused is not None for layer in ours.layers)
    plain = ModelRunner(model, range(4), CacheConfig(block_size=4, num_blocks=64))
    plain.layers = [replace(layer, fused=None, attn=replace(layer.attn, fused=None), ffn=replace(layer.ffn, fused=None))
                    for layer in plain.layers]  # the same layers on torch's ops (their paths chosen again)
    prompt = text_prompts(model, 1)[0]  # 40 tokens: past mistral's window of 24
    logits = {}
    for name, runner in (("exact", exact), ("ours", ours), ("plain", plain)):
        parts = [runner.forward([SeqChunk("r", tuple(piece), len(piece))]) for piece in (prompt[:30], prompt[30:])]
        parts.append(runner.forward([SeqChunk("r", (5,), 1)]))
        logits[name] = torch.cat(parts)
    err = {name: float((logits[name] - logits["exact"]).abs().max()) for name in ("ours", "plain")}
    assert err["ours"] <= 1.5 * err["plain"] + 0.02, err
    agree = (logits["ours"].argmax(-1) == logits["exact"].argmax(-1)).float().mean()
    assert float(agree) >= 0.95


def _cache(hd: int, kvh: int = 2) -> KVCache:
    return KVCache([0], num_blocks=16, block_size=4, num_kv_heads=kvh, head_dim=hd, dtype=torch.bfloat16)


def _meta(chunks: list[SeqChunk], cache: KVCache) -> AttentionMetadata:
    for c in chunks:
        assert cache.reserve(c.request_id, cache.length(c.request_id) + len(c.token_ids))
    return AttentionMetadata.build(chunks, cache)


def _rotary(hd: int) -> torch.nn.Module:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    return LlamaRotaryEmbedding(LlamaConfig(hidden_size=hd * 4, num_attention_heads=4, head_dim=hd))


def test_on_our_kernels_a_tokens_logits_do_not_depend_on_its_batch(tmp_path: Path, kernel_isa: str) -> None:
    """Every kernel of the bf16 stored path computes each row alone (the int4 matmul's sums run per row in the
    same order whatever the tile), so k+1 verification positions give bit for bit the logits of k+1 one-token
    steps: speculation on this path is token-for-token lossless in bf16 too, not only in fp32."""
    path = build_tiny_model("qwen2", tmp_path / "q", hidden_size=128, head_dim=32, intermediate_size=256)
    model = load_model(str(path), "bf16", weights="int4")
    runner = ModelRunner(model, range(4), CacheConfig(block_size=4, num_blocks=64))
    assert runner.layers[0].fused is not None and runner.layers[0].attn.qkv_proj.own is not None
    prompt = text_prompts(model, 1)[0]
    for rid in ("a", "b"):  # each request's blocks consecutive: attention reads them in place (metadata.span)
        assert runner.reserve(rid, len(prompt) + 5)
        runner.forward([SeqChunk(rid, tuple(prompt), 1)])
    together = runner.forward([SeqChunk("a", (7, 8, 9, 10, 11), 5)])  # a verification of 4 drafts
    one_by_one = torch.cat([runner.forward([SeqChunk("b", (t,), 1)]) for t in (7, 8, 9, 10, 11)])
    assert torch.equal(together, one_by_one)


def test_on_our_kernels_a_sequence_on_scattered_blocks_gets_the_logits_of_consecutive_ones(tmp_path: Path,
                                                                                            kernel_isa: str) -> None:
    """The prefix cache shares a request's leading blocks, so its block table is not consecutive: attention then
    runs the same kernel over a copy of its slots, and the logits are bit for bit those of consecutive blocks (a
    prompt found cached gives the output it would have computed, in bf16 too)."""
    path = build_tiny_model("qwen2", tmp_path / "q", hidden_size=128, head_dim=32, intermediate_size=256)
    model = load_model(str(path), "bf16", weights="int4")
    prompt = text_prompts(model, 1)[0]  # 40 tokens: 10 blocks
    logits = []
    for scattered in (False, True):
        runner = ModelRunner(model, range(4), CacheConfig(block_size=4, num_blocks=64))
        if scattered:  # another request takes every other block while this one grows
            for i in range(12):
                assert runner.reserve("r", 4 * (i + 1)) and runner.reserve(f"gap{i}", 4)
        assert runner.reserve("r", len(prompt) + 3)
        table = runner.cache.block_table("r")
        assert (table != list(range(table[0], table[0] + len(table)))) == scattered
        parts = [runner.forward([SeqChunk("r", tuple(prompt[:30]), 1)]), runner.forward([SeqChunk("r", tuple(
            prompt[30:]), 1)]), runner.forward([SeqChunk("r", (5, 6), 2)]), runner.forward([SeqChunk("r", (7,), 1)])]
        logits.append(torch.cat(parts))
    assert torch.equal(logits[0], logits[1])


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "gemma3_text"])
@pytest.mark.parametrize("activations", ["int8", "bf16"])
def test_a_decode_step_in_one_call_per_layer_gives_the_op_by_op_logits(tmp_path: Path, activations: str, family: str,
                                                                       monkeypatch: pytest.MonkeyPatch,
                                                                       kernel_isa: str) -> None:
    """Where every part of a layer's decode step runs on our kernels (weights re-quantized to int4; a qwen2: q/k/v
    biases; a qwen3: q/k norms; a gemma3_text: fp32 (1 + w) norms before and after each half, q/k norms, its query
    scale (query_pre_attn_scalar 24 at head dim 32), GeGLU, windows of 6 across the 4-slot blocks on alternate
    layers), the step is one call per layer (layer_cpu.cpp), bit for bit the layer run op by op: for a decode, a
    verification of 4 drafts and the prefill chunks around them; a prefill above 16 rows stays op by op."""
    path = build_tiny_model(family, tmp_path / "q", hidden_size=128, head_dim=32, intermediate_size=256)
    model = load_model(str(path), "bf16", weights="int4", activations=activations)
    chunks = [(tuple(range(5, 25)), 1), ((7,), 1), ((8, 9, 10, 11, 12), 5), (tuple(range(30, 42)), 2), ((13,), 1)]
    calls = []
    ops = cpu_kernels.ops()
    one_call = ops.decode_layer
    monkeypatch.setattr(ops, "decode_layer", lambda *a: calls.append(a[0].shape[0]) or one_call(*a), raising=False)

    def logits() -> torch.Tensor:
        runner = ModelRunner(model, range(4), CacheConfig(block_size=4, num_blocks=64))
        assert runner.reserve("r", 64)
        return torch.cat([runner.forward([SeqChunk("r", toks, n)]) for toks, n in chunks])

    fused = logits()
    assert calls == [n for n in (1, 5, 12, 1) for _ in range(4)]  # every layer in one call; 20 rows op by op
    monkeypatch.setattr(DecoderLayer, "_decode_args", lambda self: None)
    assert torch.equal(fused, logits())
