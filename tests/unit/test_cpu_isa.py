"""Which ISA our CPU kernels run on (`SPECFLEET_CPU_ISA`, actors/model/cpu_kernels.py) and the AVX2 build's contract:
the AVX512 build's bits, op by op and through a whole model, where this CPU runs both."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from actors.model import cpu_kernels
from actors.model.gguf_blocks import read_blocks
from actors.model.loader import load_model
from actors.model.metadata import SeqChunk
from actors.model.qlinear import stored_linear
from actors.model.runner import ModelRunner
from cluster.config import CacheConfig
from tests.fixtures.tiny_models import build_tiny_model
from tests.unit.helpers import isa_params, text_prompts
from tests.unit.test_gguf_blocks import random_blocks

CPU = torch.device("cpu")
BOTH = [cpu_kernels.unavailable(isa) for isa in cpu_kernels.ISAS]
both = pytest.mark.skipif(any(BOTH), reason=f"this machine does not run both ISAs: {BOTH}")


@pytest.fixture
def choose(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - a function
    """Sets the environment as a user would and lets cpu_kernels choose again (and again after the test)."""
    def set_env(**env: str) -> tuple[str, str]:
        for key in ("SPECFLEET_CPU_ISA", "SPECFLEET_CPU_KERNELS"):
            monkeypatch.delenv(key, raising=False)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        cpu_kernels.reset()
        return cpu_kernels.choice()

    yield set_env
    cpu_kernels.reset()


@pytest.mark.parametrize("kernel_isa", isa_params("torch"), indirect=True)
def test_the_variable_picks_the_build_that_runs(kernel_isa: str, tmp_path: Path) -> None:
    """SPECFLEET_CPU_ISA=avx512|avx2|torch: that build's ops (or none), its identity, and a model's layers on them."""
    assert cpu_kernels.describe()["isa"] == kernel_isa == cpu_kernels.isa()
    path = build_tiny_model("qwen2", tmp_path / "q", hidden_size=128, head_dim=32, intermediate_size=256)
    runner = ModelRunner(load_model(str(path), "bf16", weights="int4"), range(4), CacheConfig(block_size=4,
                                                                                              num_blocks=64))
    proj = runner.layers[0].attn.qkv_proj
    if kernel_isa == "torch":
        assert cpu_kernels.ops() is None and cpu_kernels.identity() == "torch"
        assert runner.layers[0].fused is None and proj.own is None
        return
    lib = getattr(torch.ops, f"specfleet_{kernel_isa}")
    assert cpu_kernels.ops() is lib and runner.layers[0].fused is lib and proj.own == lib.int4_mm_q8
    assert cpu_kernels.identity() == cpu_kernels.build_id(kernel_isa) and cpu_kernels.identity().startswith(kernel_isa)


def test_the_identity_differs_by_isa_and_names_it() -> None:
    """The calibration cache and the prefix identity key on `identity()`: one ISA's timings or logits never stand
    for another's."""
    ids = {isa: cpu_kernels.build_id(isa) for isa in cpu_kernels.ISAS}
    assert len(set(ids.values())) == len(ids) and all(i.startswith(isa + "_") for isa, i in ids.items())


def test_auto_takes_the_fastest_isa_this_cpu_has(choose, monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """auto (the default): avx512 where AVX512-BF16 and VNNI are, else avx2 (AVX2, FMA, F16C), else torch's ops; the
    choice and its reason in one log line. Other CPUs are stood for by their /proc/cpuinfo flags."""
    for flags, want in (({"avx2", "fma", "f16c", "avx512_bf16", "avx512_vnni"}, "avx512"),
                        ({"avx2", "fma", "f16c"}, "avx2"), ({"avx2", "f16c"}, "torch"), (set(), "torch")):
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda f=frozenset(flags): f)
        with caplog.at_level(logging.INFO, logger=cpu_kernels.__name__):
            caplog.clear()
            isa, why = choose()
        assert isa == want and why.startswith("auto: ")
        assert [r.getMessage() for r in caplog.records] == [f"CPU kernels: {isa} ({why})"]
    assert "not avx2: this CPU has no AVX2/FMA/F16C" in why


def test_an_isa_the_cpu_lacks_falls_back_to_torch_and_says_why(choose, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"avx2", "fma", "f16c"}))
    assert choose(SPECFLEET_CPU_ISA="avx512") == (
        "torch", "SPECFLEET_CPU_ISA=avx512, but this CPU has no AVX512_BF16/AVX512_VNNI")
    assert cpu_kernels.ops() is None and cpu_kernels.kernel() is None and cpu_kernels.identity() == "torch"
    assert choose(SPECFLEET_CPU_ISA="AVX2") == ("avx2", "SPECFLEET_CPU_ISA=avx2")  # any case


def test_torch_by_either_variable_and_a_typo_is_an_error(choose) -> None:
    assert choose(SPECFLEET_CPU_KERNELS="torch", SPECFLEET_CPU_ISA="avx2") == ("torch", "SPECFLEET_CPU_KERNELS=torch")
    assert cpu_kernels.unavailable() == "SPECFLEET_CPU_KERNELS=torch"
    assert all(cpu_kernels.unavailable(isa) == "SPECFLEET_CPU_KERNELS=torch" for isa in cpu_kernels.ISAS)
    assert choose(SPECFLEET_CPU_ISA="torch") == ("torch", "SPECFLEET_CPU_ISA=torch")
    with pytest.raises(ValueError, match="SPECFLEET_CPU_ISA='avx3'"):
        choose(SPECFLEET_CPU_ISA="avx3")


def _packed(n: int, k: int, half: bool, seed: int) -> tuple:
    """Random codes and per-group scales in our layout; n real rows (padded to 16), fp16-exact scales if `half`."""
    g = torch.Generator().manual_seed(seed)
    rows = -(-n // 16) * 16
    codes = torch.randint(0, 16, (rows, k), dtype=torch.uint8, generator=g)
    scale, offset = torch.rand(rows, k // 32, generator=g) * 0.1, -torch.rand(rows, k // 32, generator=g) * 0.8
    if half:
        scale, offset = scale.half().float(), offset.half().float()
    return cpu_kernels.pack(codes, scale, offset)


@both
@pytest.mark.parametrize("half", [False, True], ids=["fp32 scales", "fp16 scales"])
def test_avx2_gives_the_avx512_bits_op_by_op(half: bool) -> None:
    """int8 inputs: the integer dot products are exact on both, the fp32 steps the same; bf16 inputs: an FMA per
    exact product in VDPBF16PS's order; the fused steps: one source on 16-lane vectors (cpu_isa.h). Every M up to
    two tiles and past them, a partial block of rows, a bias."""
    a, b = cpu_kernels.ops("avx512"), cpu_kernels.ops("avx2")
    torch.manual_seed(3)
    for n, k in ((40, 256), (16, 64)):
        w = _packed(n, k, half, seed=n + k)
        bias = torch.randn(n).bfloat16()
        x = torch.randn(17, k).bfloat16() * 3
        x[1, :32] = 0  # a group of zeros: scale 0
        for m in range(1, 18):
            for op in ("int4_mm_q8", "int4_mm"):
                ya, yb = getattr(a, op)(x[:m], *w, bias, n), getattr(b, op)(x[:m], *w, bias, n)
                assert torch.equal(ya, yb), (op, n, k, m, float((ya.float() - yb.float()).abs().max()))
        assert torch.equal(a.int4_dequant(*w, n, k), b.int4_dequant(*w, n, k))
        assert torch.equal(a.int8_rows(x), b.int8_rows(x))
    x, r, wn = torch.randn(7, 96).bfloat16(), torch.randn(7, 96).bfloat16(), torch.randn(96).bfloat16()
    assert torch.equal(a.rms_norm(x, wn, 1e-5), b.rms_norm(x, wn, 1e-5))
    assert all(torch.equal(p, q) for p, q in zip(a.add_rms_norm(x, r, wn, 1e-5), b.add_rms_norm(x, r, wn, 1e-5)))
    gemma = 1.0 + torch.randn(96)  # Gemma's fp32 gain
    assert torch.equal(a.rms_norm(x, gemma, 1e-6), b.rms_norm(x, gemma, 1e-6))
    gu = torch.randn(5, 192).bfloat16() * 8  # past exp's clamps too
    assert torch.equal(a.silu_mul(gu), b.silu_mul(gu))
    assert torch.equal(a.gelu_tanh_mul(gu), b.gelu_tanh_mul(gu))
    qk, cos, sin = torch.randn(3, 4, 64).bfloat16(), torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    qa, qb = qk.clone(), qk.clone()
    a.rope_(qa, cos, sin), b.rope_(qb, cos, sin)
    assert torch.equal(qa, qb)
    for gains in (torch.randn(2, 64).bfloat16(), 1.0 + torch.randn(2, 64)):  # Qwen3's q/k norms, Gemma 3's
        qa, qb = qk.clone(), qk.clone()
        a.norm_rope_(qa, *gains, 3, 1e-6, cos, sin), b.norm_rope_(qb, *gains, 3, 1e-6, cos, sin)
        assert torch.equal(qa, qb)
    q, kk, v = torch.randn(5, 6, 32).bfloat16(), torch.randn(5, 2, 32).bfloat16(), torch.randn(5, 2, 32).bfloat16()
    pools = [torch.randn(64, 2, 32).bfloat16() for _ in range(2)]
    for window in (0, 6):
        pa, pb = [p.clone() for p in pools], [p.clone() for p in pools]
        slots = torch.arange(35, 40)
        assert torch.equal(a.span_attention(q, kk, v, *pa, slots, 0, 40, window),
                           b.span_attention(q, kk, v, *pb, slots, 0, 40, window))
        assert all(torch.equal(x, y) for x, y in zip(pa, pb))


@both
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q5_0, Q.Q8_0], ids=lambda q: q.name)
def test_avx2_gives_the_avx512_bits_on_gguf_blocks(qtype: Q, choose) -> None:
    """Every scale encoding (fp16, a K-quant's two levels) and two planes (5-8 bit codes), as the loader packs them."""
    w = read_blocks(random_blocks(qtype, 40, 512), qtype, (40, 512))
    x = torch.randn(9, 512).bfloat16()
    out = {}
    for isa in cpu_kernels.ISAS:
        choose(SPECFLEET_CPU_ISA=isa)
        lins = [stored_linear(w, None, CPU, torch.bfloat16, act) for act in ("int8", "bf16")]
        assert all(lin.own is not None for lin in lins)
        out[isa] = [lin(x[:m]) for lin in lins for m in (1, 5, 9)] + [lins[0].dequantized()]
    assert all(torch.equal(p, q) for p, q in zip(*out.values()))


@both
@pytest.mark.parametrize("family", ["qwen2", "gemma3_text"])
@pytest.mark.parametrize("activations", ["int8", "bf16"])
def test_a_model_on_avx2_gives_the_avx512_logits(tmp_path: Path, activations: str, family: str, choose) -> None:
    """Prefill chunks (dense GEMM past 16 rows, the kernel below), a verification of 4 drafts and decode steps
    (one call per layer; Gemma 3's with its fp32 norms, q/k norms, query scale, GeGLU and windows): the same logits,
    bit for bit, on either build."""
    path = build_tiny_model(family, tmp_path / "q", hidden_size=128, head_dim=32, intermediate_size=256)
    chunks = [(tuple(range(5, 25)), 1), ((7,), 1), ((8, 9, 10, 11, 12), 5), (tuple(range(30, 42)), 2), ((13,), 1)]
    logits = {}
    for isa in cpu_kernels.ISAS:
        choose(SPECFLEET_CPU_ISA=isa)
        model = load_model(str(path), "bf16", weights="int4", activations=activations)
        runner = ModelRunner(model, range(4), CacheConfig(block_size=4, num_blocks=64))
        assert runner.layers[0].fused is cpu_kernels.ops(isa)
        assert runner.reserve("r", 64)
        prompt = text_prompts(model, 1)[0][:16]
        logits[isa] = torch.cat([runner.forward([SeqChunk("r", tuple(prompt), 1)])]
                                + [runner.forward([SeqChunk("r", toks, n)]) for toks, n in chunks])
    assert torch.equal(logits["avx512"], logits["avx2"])
