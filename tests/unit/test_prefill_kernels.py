"""A prefill chunk's kernels give the decode kernels' bits for every row, whatever the chunk's size: the int4 x int8
GEMM (int4_cpu.cpp `int4_gemm_q8`) against the decode matmul (`int4_mm_q8`), and the tiled chunk attention
(attention_cpu.cpp `chunk_attention`) against the one-row-at-a-time `span_attention`; so deterministic mode keeps
its batch-invariance on them (issue 36). Each ISA of ours this machine runs (`kernel_isa`)."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from actors.kv.cache import KVCache
from actors.model import cpu_kernels
from actors.model.deterministic import row_invariant
from actors.model.gguf_blocks import read_blocks
from actors.model.metadata import AttentionMetadata, SeqChunk
from actors.model.qlinear import AMX_ROWS, DENSE_ROWS, stored_linear
from tests.unit.helpers import isa_params
from tests.unit.test_gguf_blocks import random_blocks

CPU = torch.device("cpu")
pytestmark = pytest.mark.parametrize("kernel_isa", isa_params(), indirect=True)


# Q4_0: fp16 scales, one plane; Q4_K: two-level scales; Q5_0 and Q8_0: 5- and 8-bit codes in two planes
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_K, Q.Q5_0, Q.Q8_0], ids=lambda q: q.name)
def test_the_gemm_gives_the_decode_kernels_bits_for_any_number_of_rows(qtype: Q, kernel_isa: str) -> None:
    """N = 37: odd, a last block of 5 rows; with and without a bias; M from one row to more than a chunk."""
    torch.manual_seed(3)
    w = read_blocks(random_blocks(qtype, 37, 512), qtype, (37, 512))
    lib = cpu_kernels.ops()
    for bias in (None, torch.randn(37).bfloat16()):
        lin = stored_linear(w, bias, CPU, torch.bfloat16)
        operands = (lin.weight, lin.scale, lin.offset, lin.scale_mult, lin.offset_mult, lin.bias, 37)
        x = torch.randn(300, 512).bfloat16() * 3
        x[5, :32] = 0  # a group of zeros: scale 0
        alone = torch.cat([lin.own(x[i:i + 1], *operands) for i in range(300)])  # each row by itself: (300, 37)
        for m in (1, 17, 64, 255, 256, 300):
            got = lib.int4_gemm_q8(x[:m], *operands)
            assert torch.equal(got, lib.int4_mm_q8(x[:m], *operands)), m
            assert torch.equal(got, alone[:m]), m


def test_deterministic_mode_takes_the_gemm_for_a_chunk_with_the_kernels_bits(kernel_isa: str) -> None:
    """A layer in deterministic mode: a chunk past DENSE_ROWS rows on the GEMM, each row as it is alone; outside it,
    the dense GEMM only where torch's runs on AMX and past AMX_ROWS."""
    w = read_blocks(random_blocks(Q.Q4_K, 48, 256), Q.Q4_K, (48, 256))
    lin = stored_linear(w, None, CPU, torch.bfloat16)
    assert [lin.path(m) for m in (DENSE_ROWS, DENSE_ROWS + 1, AMX_ROWS)] == ["kernel", "gemm", "gemm"]
    assert lin.path(AMX_ROWS + 1) == ("dense" if cpu_kernels.amx() else "gemm")
    row_invariant(lin)
    assert lin.path(256) == "gemm"
    x = torch.randn(256, 256).bfloat16()
    y = lin(x)
    assert torch.equal(y[100:101], lin(x[100:101])) and torch.equal(y[:DENSE_ROWS + 1], lin(x[:DENSE_ROWS + 1]))


def _cache(hd: int, kvh: int, blocks: int = 40) -> KVCache:
    return KVCache([0], num_blocks=blocks, block_size=16, num_kv_heads=kvh, head_dim=hd, dtype=torch.bfloat16)


@pytest.mark.parametrize("window", [0, 20])
@pytest.mark.parametrize("heads", [(6, 2, 32), (4, 4, 64), (3, 1, 256)], ids=["gqa3", "mha", "hd256"])
def test_chunk_attention_gives_span_attentions_bits_row_by_row(heads: tuple[int, int, int], window: int,
                                                               kernel_isa: str) -> None:
    """Chunks of 4 (the tile), 7 (a tile and a part) and 130 rows after 50 cached tokens, each row's output
    against span_attention's, which computes each row alone; both write the same keys and values."""
    torch.manual_seed(4)
    lib = cpu_kernels.ops()
    nh, kvh, hd = heads
    caches = _cache(hd, kvh), _cache(hd, kvh)
    for chunk in (50, 4, 7, 130):
        q = torch.randn(chunk, nh, hd).bfloat16()
        k, v = torch.randn(chunk, kvh, hd).bfloat16(), torch.randn(chunk, kvh, hd).bfloat16()
        outs = []
        for cache, op in zip(caches, (lib.span_attention, lib.chunk_attention)):
            assert cache.reserve("r", cache.length("r") + chunk)
            meta = AttentionMetadata.build([SeqChunk("r", tuple(range(chunk)))], cache)
            assert meta.span is not None  # one sequence on consecutive blocks
            kpool, vpool = cache.pools(0)
            outs.append(op(q, k, v, kpool, vpool, meta.slots, *meta.span, window))
            cache.set_length("r", meta.span[1])
        assert torch.equal(outs[1], outs[0]), chunk
    assert torch.equal(caches[0].k, caches[1].k) and torch.equal(caches[0].v, caches[1].v)
