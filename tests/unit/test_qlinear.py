"""The fused weight-only kernels behind the quantized linears: exact where the mapping is, preconditions checked
(an odd width never reaches a kernel that crashes on it), and the CUDA branch's shapes (checked on fake tensors:
no GPU runs these tests)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q
from torch._subclasses.fake_tensor import FakeTensorMode

from actors.model import cpu_kernels
from actors.model.gguf_blocks import GroupedInts, read_blocks
from actors.model.deterministic import Tiled, row_invariant
from actors.model.qlinear import (AMX_ROWS, DENSE_ROWS, Int4Linear, Int8Linear, int4_unsupported, int8_linear,
                                  stored_linear, tinygemm_pairs)
from actors.model.loader import load_model
from actors.model.metadata import SeqChunk
from actors.model.quant import rtn_int4
from actors.model.runner import ModelRunner
from cluster.config import CacheConfig
from tests.fixtures.tiny_models import build_tiny_model
from tests.unit.helpers import isa_params, text_prompts
from tests.unit.test_gguf_blocks import random_blocks

CPU = torch.device("cpu")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) @ w (N, K).T + b in float64."""
    y = x.double() @ w.double().t()
    return y if b is None else y + b.double()


@pytest.mark.parametrize("k", [8, 24, 40, 72, 48, 64])
def test_int8_linear_takes_any_width_without_crashing(k: int) -> None:
    """`_weight_int8pack_mm` gives wrong results for K % 16 != 0 and segfaults on batches of 2+ rows (K = 72 is a
    tiny Llama's hidden size): such layers must take the dense fallback."""
    torch.manual_seed(k)
    w, b = torch.randn(24, k), torch.randn(24)
    lin = Int8Linear.rtn(w, b, CPU, torch.float32)
    assert lin.fused == (k % 16 == 0)
    deq = lin.weight.double() * lin.scale.double()[:, None]  # what the codes encode
    for m in (1, 2, 3, 5):
        x = torch.randn(m, k)
        torch.testing.assert_close(lin(x).double(), reference(x, deq, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q5_1, Q.Q5_K, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("n", [64, 72])
def test_int4_kernel_computes_gguf_blocks_exactly_in_fp32(qtype: Q, n: int) -> None:
    """4-bit codes in one plane, 5-8 bit codes in two; N = 72 is padded to the CPU kernel's multiple of 16."""
    w = read_blocks(random_blocks(qtype, n, 512), qtype, (n, 512))
    b = torch.randn(n)
    lin = Int4Linear(w, b, CPU, torch.float32)  # torch's kernel (ours is bf16 only)
    assert lin.planes == (1 if w.bits == 4 else 2)
    assert isinstance(stored_linear(w, b, CPU, torch.float32), torch.nn.Linear)  # fp32: dense, the same values
    x = torch.randn(5, 512)
    want = reference(x, w.dequantize(), b)
    torch.testing.assert_close(lin(x).double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 5, 9, 17])  # one tile of 8 rows, and more than one
@pytest.mark.parametrize("kernel_isa", isa_params("torch"), indirect=True)
def test_bf16_is_the_exact_result_rounded_once(qtype: Q, m: int, kernel_isa: str) -> None:
    """bf16 inputs: on AVX512-BF16 CPUs our kernel (fp32 scales, sums in fp32: the exact result, rounded once to
    bf16; N = 40 ends in a partial block of rows), elsewhere torch's (its scales rounded to bf16: looser)."""
    w = read_blocks(random_blocks(qtype, 40, 512), qtype, (40, 512))
    b = torch.randn(40).bfloat16()
    lin = row_invariant(stored_linear(w, b, CPU, torch.bfloat16, "bf16"))  # every row on the kernel, past DENSE_ROWS
    x = torch.randn(m, 512).bfloat16()
    want = reference(x, w.dequantize(), b)  # x already bf16: the exact result of these inputs
    got = lin(x).double()
    if cpu_kernels.kernel() is not None:  # ours: row-invariant by itself, no tiles around it
        assert lin.own is not None
        # rounded once: each output is one of the two bf16 values around the exact result (its fp32 sum lies within
        # ~K x 2^-24 of it, so near a rounding midpoint it may round to either; one bf16 step is up to 2^-7 of a value,
        # at the bottom of its binade, where an rtol of 2^-8 failed one element in 360: avx2, m = 9, Q8_0)
        step = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30))) - 7)  # (M, N) bf16's step at each value
        off = (got - want).abs() - step
        assert float(off.max()) <= 1e-6 * float(want.abs().max()), (got - want)[off > 0]
        # the fewest bytes that hold the scales exactly: a K-quant's two levels, else fp16 (GGUF's are)
        assert lin.scale.dtype == torch.float16 and (lin.scale_mult is not None) == (qtype == Q.Q4_K)
    else:  # torch's int4 kernel on deterministic mode's fixed tiles; its scales rounded to bf16
        assert isinstance(lin, Tiled) and lin.inner.own is None
        assert float((got - want).abs().max()) <= 1e-2 * float(want.abs().max())


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """What the kernel's int8 inputs stand for: x (M, K) bf16 rounded per group of 32 to q * d with d = max |x| / 127
    (fp32, ties to even, as int4_cpu.cpp rounds them) -> q * d (M, K) in float64."""
    m, k = x.shape
    f = x.float().view(m, k // 32, 32)  # (M, G, 32)
    amax = f.abs().amax(-1, keepdim=True)  # (M, G, 1)
    # fp32 division and product as the kernel's, each rounded once (products of fp32 values are exact in float64)
    inv = torch.where(amax > 0, (127.0 / amax.double()).float(), torch.zeros_like(amax))
    q = torch.round((f.double() * inv.double()).float())  # (M, G, 32) integers in [-127, 127], ties to even
    return (q.double() * (amax / 127.0).double()).view(m, k)


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 5, 9, 17])
@pytest.mark.parametrize("kernel_isa", isa_params(), indirect=True)
def test_int8_inputs_are_the_exact_result_of_the_rounded_rows(qtype: Q, m: int, kernel_isa: str) -> None:
    """int8 inputs (the default): the weights as stored times each row rounded per group of 32 to int8, summed
    exactly: that result, rounded once to bf16. It stays within 2% of the largest output of the bf16 inputs' exact
    result (what the rounding of the inputs costs), and each row is computed alone. A prefill's dense GEMM takes the
    same rounded rows."""
    w = read_blocks(random_blocks(qtype, 40, 512), qtype, (40, 512))
    b = torch.randn(40).bfloat16()
    lin = row_invariant(stored_linear(w, b, CPU, torch.bfloat16))
    assert lin.own is cpu_kernels.kernel("int8") and lin.own is not cpu_kernels.kernel("bf16")
    x = torch.randn(m, 512).bfloat16()
    x[0, :32] = 0  # a group of zeros: scale 0, no division by it
    xq = int8_rows(x)
    assert torch.equal(cpu_kernels.ops().int8_rows(x), xq.bfloat16())  # what a prefill's dense GEMM takes
    want = reference(xq, w.dequantize(), b)  # (M, N)
    got = lin(x).double()
    torch.testing.assert_close(got, want.bfloat16().double(), rtol=2**-7, atol=1e-5 * float(want.abs().max()))
    exact = reference(x, w.dequantize(), b)
    assert float((got - exact).abs().max()) <= 0.02 * float(exact.abs().max())
    assert torch.equal(lin(x[-1:]), lin(x)[-1:])  # row-invariant


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_0, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("kernel_isa", isa_params(), indirect=True)
def test_a_prefill_expands_the_weights_once_only_where_that_pays_and_never_in_deterministic_mode(qtype: Q,
                                                                                              kernel_isa: str) -> None:
    """bf16 inputs above DENSE_ROWS rows, int8 ones above AMX_ROWS where torch's GEMM runs on AMX: the layer expands
    its codes into bf16 weights (each the GGUF's value rounded once: equal to dequantizing and rounding) for a dense
    GEMM. Int8 inputs otherwise take our GEMM, the kernel's bits (tests/unit/test_prefill_kernels.py); in
    deterministic mode never the dense GEMM."""
    w = read_blocks(random_blocks(qtype, 40, 512), qtype, (40, 512))
    lin = stored_linear(w, None, CPU, torch.bfloat16, "bf16")
    assert torch.equal(lin.dequantized(), w.dequantize().float().bfloat16())
    x = torch.randn(DENSE_ROWS + 9, 512).bfloat16()
    want = reference(x, w.dequantize(), None)
    dense = lin(x).double()
    assert torch.equal(dense, torch.nn.functional.linear(x, lin.dequantized()).double())
    assert float((dense - want).abs().max()) <= 1e-2 * float(want.abs().max())  # weights rounded to bf16
    assert row_invariant(lin) is lin and lin.invariant
    rows = lin(x).double()  # on the kernel: each row as it would be alone
    assert torch.equal(rows[-1:], lin(x[-1:]).double()) and not torch.equal(rows, dense)
    q8 = stored_linear(w, None, CPU, torch.bfloat16)  # the default's int8 inputs
    x = torch.randn(AMX_ROWS + 1, 512).bfloat16()
    operands = (q8.weight, q8.scale, q8.offset, q8.scale_mult, q8.offset_mult, None, 40)
    if cpu_kernels.amx():  # on the rows as the kernel rounds them
        assert torch.equal(q8(x), torch.nn.functional.linear(cpu_kernels.ops().int8_rows(x), q8.dequantized()))
    else:
        assert torch.equal(q8(x), q8.own(x, *operands))
    assert row_invariant(q8) is q8 and torch.equal(q8(x), q8.own(x, *operands))


@pytest.mark.parametrize("kernel_isa", isa_params("torch"), indirect=True)
def test_our_kernel_is_built_where_it_can_be(kernel_isa: str) -> None:
    """The ISA's CPU features, a C++ compiler and ninja: built (a failed build would fall back with a warning);
    torch: not."""
    assert (cpu_kernels.kernel() is not None) == (cpu_kernels.unavailable() is None)


@pytest.mark.parametrize("kernel_isa", isa_params("torch"), indirect=True)
def test_q6_k_has_no_exact_int4_form_and_goes_to_int8(kernel_isa: str) -> None:
    w = read_blocks(random_blocks(Q.Q6_K, 32, 256), Q.Q6_K, (32, 256))
    assert "groups of 16" in int4_unsupported(w, CPU, torch.bfloat16)
    lin = stored_linear(w, None, CPU, torch.bfloat16)
    assert isinstance(lin, Int4Linear if cpu_kernels.kernel() is not None else Int8Linear)  # int8 codes
    x = torch.randn(2, 256).bfloat16()
    want = reference(x, w.dequantize(), None)
    assert float((lin(x).double() - want).abs().max()) <= 0.02 * float(want.abs().max())  # close, not exact


def test_rtn_int4_is_within_half_a_step_of_each_weight() -> None:
    torch.manual_seed(0)
    w = torch.randn(48, 96)
    q = rtn_int4(w)
    assert (q.group, q.bits) == (32, 4)
    step = q.scale.repeat_interleave(32, dim=1)  # (N, K)
    assert bool(((q.dequantize() - w).abs() <= step / 2 + 1e-6).all())
    assert rtn_int4(torch.randn(8, 72)).group == 72  # a width with no 32-groups: one group per row


def test_cuda_branch_packs_for_tinygemm_and_refuses_what_it_cannot_run() -> None:
    """No GPU runs these tests: the CUDA branch's host-side layout, then the kernels' own shape rules on fake
    CUDA tensors (`_convert_weight_to_int4pack`, `_weight_int4pack_mm`)."""
    cuda = torch.device("cuda")
    w = read_blocks(random_blocks(Q.Q5_0, 40, 256), Q.Q5_0, (40, 256))
    assert "bf16 only" in int4_unsupported(w, cuda, torch.float32)
    assert int4_unsupported(w, cuda, torch.bfloat16) is None
    codes = torch.cat([w.codes & 0x0F, w.codes >> 4], dim=1)  # the two planes side by side: (40, 512)
    pairs, inner = tinygemm_pairs(codes)
    assert pairs.shape == (40, 256) and inner == 8
    assert int(pairs[3, 5]) == int(codes[3, 10]) << 4 | int(codes[3, 11])  # the even code in the high nibble
    with FakeTensorMode():
        packed = torch.ops.aten._convert_weight_to_int4pack(torch.empty(40, 256, dtype=torch.uint8, device=cuda), inner)
        assert tuple(packed.shape) == (5, 4, 32, 4) and packed.dtype == torch.int32  # (N/8, K/128, 32, inner/2)
        sz = torch.empty(512 // 32, 40, 2, dtype=torch.bfloat16, device=cuda)
        y = torch.ops.aten._weight_int4pack_mm(torch.empty(3, 512, dtype=torch.bfloat16, device=cuda), packed, 32, sz)
        assert tuple(y.shape) == (3, 40)
    odd = GroupedInts(torch.zeros(8, 48, dtype=torch.uint8), torch.ones(8, 1), torch.zeros(8, 1), bits=4, group=48)
    assert "groups of 48" in int4_unsupported(odd, cuda, torch.bfloat16)
    assert isinstance(stored_linear(odd, None, torch.device("meta"), torch.float32), torch.nn.Linear)


@pytest.mark.parametrize("activations", ["bf16", "int8"])
@pytest.mark.parametrize("kernel_isa", isa_params("torch"), indirect=True)
def test_int8_codes_take_our_kernel_in_bf16_with_the_same_maths(activations: str, kernel_isa: str) -> None:
    """Per-row int8 (Q6_K's fallback, `weights: int8`) as two 4-bit planes with the row's scale in each group; with
    int8 inputs, of the rows as the kernel rounds them."""
    torch.manual_seed(1)
    w, b = torch.randn(40, 256), torch.randn(40)
    fast = int8_linear(w, b.bfloat16(), CPU, torch.bfloat16, activations)
    assert isinstance(fast, Int4Linear if cpu_kernels.kernel() is not None else Int8Linear)
    exact = Int8Linear.rtn(w, b, CPU, torch.float32)  # the same codes and scales, in fp32
    x = torch.randn(5, 256).bfloat16()
    if cpu_kernels.kernel() is None:  # torch's int8 kernel: scales rounded to bf16, the product rounded before
        want = exact(x.float()).double()  # the bias is added: within a few bf16 roundings of the largest output
        assert float((fast(x).double() - want).abs().max()) <= 1e-2 * float(want.abs().max())
        return
    if activations == "bf16":
        want = exact(x.float()).double()
    else:
        want = reference(int8_rows(x), exact.weight.double() * exact.scale.double()[:, None], b)
    torch.testing.assert_close(fast(x).double(), want, rtol=2**-7, atol=1e-5 * float(want.abs().max()))


def test_without_our_kernels_bf16_runs_on_torchs_ops(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fallback where our CPU kernels cannot run (no AVX512-BF16, no compiler or no ninja; forced here with
    SPECFLEET_CPU_KERNELS=torch): shapes our kernels would take run on torch's int4 kernel and ops instead, with
    the logits of the usual path (ours where it runs) to bf16 rounding."""
    path = build_tiny_model("qwen2", tmp_path / "q", hidden_size=128, head_dim=32, intermediate_size=256)

    def logits() -> tuple[ModelRunner, torch.Tensor]:
        # the projections' kernels are chosen at load; bf16 inputs: the same maths as torch's kernel
        model = load_model(str(path), "bf16", weights="int4", activations="bf16")
        prompt = text_prompts(model, 1)[0]
        runner = ModelRunner(model, range(model.num_layers), CacheConfig(block_size=4, num_blocks=64))
        return runner, runner.forward([SeqChunk("r", tuple(prompt), len(prompt))]).float()  # (T, V)

    usual = logits()[1]
    monkeypatch.setenv("SPECFLEET_CPU_KERNELS", "torch")
    cpu_kernels.ops.cache_clear()
    try:
        assert cpu_kernels.unavailable() == "SPECFLEET_CPU_KERNELS=torch" and cpu_kernels.kernel() is None
        runner, got = logits()
    finally:
        cpu_kernels.ops.cache_clear()  # later tests find (or build) our kernels again
    layer = runner.layers[0]
    assert layer.fused is None and layer.attn.fused is None and layer.ffn.fused is None
    assert isinstance(layer.ffn.gate_up_proj, Int4Linear) and layer.ffn.gate_up_proj.own is None
    assert float((got - usual).abs().max()) <= 0.1 * float(usual.std())
    assert float((got.argmax(-1) == usual.argmax(-1)).float().mean()) >= 0.9
