"""GGUF blocks read as stored: every format decodes to gguf-py's own dequantization bit for bit, and stacks and
permutes rows without changing a weight."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from actors.model.gguf_blocks import concat_rows, read_blocks

FORMATS = {  # type -> (weights per block, bytes per block, offsets of the block's fp16 scale fields)
    Q.Q4_0: (32, 18, (0,)), Q.Q4_1: (32, 20, (0, 2)), Q.Q5_0: (32, 22, (0,)), Q.Q5_1: (32, 24, (0, 2)),
    Q.Q8_0: (32, 34, (0,)), Q.Q4_K: (256, 144, (0, 2)), Q.Q5_K: (256, 176, (0, 2)), Q.Q6_K: (256, 210, (208,)),
}


def random_blocks(qtype: Q, n: int, k: int, seed: int = 0) -> np.ndarray:
    """(n, bytes per row) of random blocks: every code, scale byte and high bit at random, the fp16 scales
    finite (random bytes there could be inf or NaN)."""
    block, size, scales = FORMATS[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    for off in scales:
        d = rng.normal(0.0, 0.01, (n, k // block)).astype(np.float16)
        raw[..., off:off + 2] = d.view(np.uint8).reshape(n, k // block, 2)
    return raw.reshape(n, -1)


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
def test_every_format_reads_to_gguf_pys_dequantization_bit_for_bit(qtype: Q) -> None:
    raw = random_blocks(qtype, 6, 512)
    w = read_blocks(raw, qtype, (6, 512))
    assert w.codes.dtype == torch.uint8 and int(w.codes.max()) < 2**w.bits
    assert w.scale.shape == w.offset.shape == (6, 512 // w.group)
    np.testing.assert_array_equal(w.dequantize().numpy(), dequantize(raw, qtype))


def test_a_row_of_the_wrong_length_is_refused() -> None:
    raw = random_blocks(Q.Q4_0, 2, 64)
    with pytest.raises(ValueError, match="do not hold"):
        read_blocks(raw, Q.Q4_0, (2, 96))


def test_rows_stack_and_permute_without_changing_a_weight() -> None:
    a = read_blocks(random_blocks(Q.Q4_1, 4, 64, seed=1), Q.Q4_1, (4, 64))
    b = read_blocks(random_blocks(Q.Q8_0, 2, 64, seed=2), Q.Q8_0, (2, 64))
    both = concat_rows([a, b])
    assert both.bits == 8  # a 4-bit code is an 8-bit code too
    torch.testing.assert_close(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]), rtol=0, atol=0)
    order = torch.tensor([3, 0, 2, 1])
    torch.testing.assert_close(a.rows(order).dequantize(), a.dequantize()[order], rtol=0, atol=0)
    with pytest.raises(ValueError, match="group size"):
        concat_rows([a, read_blocks(random_blocks(Q.Q6_K, 1, 256), Q.Q6_K, (1, 256))])
