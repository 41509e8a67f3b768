"""GGUF quantized blocks read as they are stored: integer codes with a scale and an offset per group of weights.

Every GGUF block format this module reads is affine per group of `group` consecutive weights of a row:

    w[n, k] = scale[n, k // group] * code[n, k] + offset[n, k // group],   0 <= code < 2**bits

with the scales and offsets exact in fp32 (fp16 block scales times small integers). The formats, from ggml's
block layouts (ggml-common.h; a block covers 32 weights, a K-quant super-block 256):

    format  bits group  scale      offset        stored per 32 weights
    Q4_0    4    32     d          -8 d          16 B codes + fp16 d
    Q4_1    4    32     d          m             16 B codes + fp16 d, m
    Q5_0    5    32     d          -16 d         16 B low nibbles + 4 B high bits + fp16 d
    Q5_1    5    32     d          m             as Q5_0 + fp16 m
    Q8_0    8    32     d          -128 d        32 B signed codes (+128 here) + fp16 d
    Q4_K    4    32     d * sc     -dmin * mn    6-bit sc, mn per 32; fp16 d, dmin per 256
    Q5_K    5    32     d * sc     -dmin * mn    as Q4_K + high bits
    Q6_K    6    16     d * sc     -32 d * sc    int8 sc per 16; fp16 d per 256

Reading is exact: `GroupedInts.dequantize()` equals gguf-py's own dequantization bit for bit (tests/unit). F32, F16
and BF16 tensors are dense and are not read here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from gguf import GGMLQuantizationType as Q

_SUPER = 256  # weights per K-quant super-block


@dataclass(frozen=True)
class GroupedInts:
    """A quantized (N, K) matrix: w = scale * codes + offset, one scale and offset per `group` weights of a row."""

    codes: torch.Tensor  # (N, K) uint8, each < 2**bits
    scale: torch.Tensor  # (N, K // group) fp32
    offset: torch.Tensor  # (N, K // group) fp32
    bits: int
    group: int
    source: str = ""  # the format it was read from (a GGUF type name, or "rtn" when quantized at load)
    # the K-quants' two levels, where read from one: scale = d[:, g // 8] * sc[:, g], offset = dm[:, g // 8] *
    # mn[:, g] with d, dm (N, G / 8) fp16 values (held in fp32) and sc, mn (N, G) small integers (uint8)
    levels: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """The weights (N, K) in fp32, computed the way the format defines them."""
        n, k = self.codes.shape
        q = self.codes.float().view(n, k // self.group, self.group)  # (N, G, group)
        return (q * self.scale[..., None] + self.offset[..., None]).view(n, k)

    def rows(self, index: torch.Tensor) -> "GroupedInts":
        """Rows `index` (N',) of the matrix, in that order (a row permutation keeps every row's groups whole)."""
        levels = None if self.levels is None else tuple(t[index] for t in self.levels)
        return GroupedInts(self.codes[index], self.scale[index], self.offset[index], self.bits, self.group,
                           self.source, levels)


def concat_rows(parts: list[GroupedInts]) -> GroupedInts:
    """Stack matrices of one width and group size along N (a fused projection); codes of fewer bits are codes of
    the most bits too."""
    first = parts[0]
    if any((p.group, p.codes.shape[1]) != (first.group, first.codes.shape[1]) for p in parts):
        raise ValueError("only matrices of one width and group size stack into one")
    levels = None
    if all(p.levels is not None for p in parts):
        levels = tuple(torch.cat([p.levels[i] for p in parts]) for i in range(4))
    return GroupedInts(torch.cat([p.codes for p in parts]), torch.cat([p.scale for p in parts]),
                       torch.cat([p.offset for p in parts]), max(p.bits for p in parts), first.group,
                       "+".join(dict.fromkeys(p.source for p in parts)), levels)


def readable(qtype: Q) -> bool:
    """Whether a GGUF tensor type is read here as grouped integers."""
    return qtype in _READERS


def read_blocks(raw: np.ndarray, qtype: Q, shape: tuple[int, int]) -> GroupedInts:
    """Decode a quantized GGUF matrix: `raw` (N, bytes per row) uint8 as stored, `shape` (N, K) in weights."""
    n, k = shape
    block, size = _LAYOUT[qtype]
    if k % block or raw.shape != (n, k // block * size):
        raise ValueError(f"{qtype.name}: {raw.shape} bytes do not hold a ({n}, {k}) matrix")
    blocks = np.asarray(raw).reshape(n, k // block, size)  # (N, B, size), still the file's bytes
    codes, scale, offset, bits, group, *two = _READERS[qtype](blocks)
    levels = None
    if two:  # a K-quant: per super-block d, dm (N, B, 1) and per group sc, mn (N, B, 8)
        levels = tuple(torch.from_numpy(np.ascontiguousarray(t).reshape(n, -1)) for t in two[0])
    return GroupedInts(torch.from_numpy(codes.reshape(n, k)), torch.from_numpy(scale.reshape(n, -1)),
                       torch.from_numpy(offset.reshape(n, -1)), bits, group, qtype.name, levels)


# ---- the formats (numpy: uint8 arithmetic on whole tensors, one pass each) --------------------------------------
def _f16(b: np.ndarray) -> np.ndarray:
    """Little-endian fp16 from (..., 2) bytes, as fp32 (..., 1)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 16) bytes of 32 weights: the low nibbles are weights 0-15, the high nibbles weights 16-31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # (..., 32)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """(..., 4) bytes of 32 bits, bit j of the little-endian word is weight j's fifth bit: (..., 32) of 0 / 16."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # (..., 32): byte i bit b -> weight 8i + b
    return bits << 4


def _q4_0(b: np.ndarray):
    d = _f16(b[..., 0:2])  # (N, B, 1)
    return _nibbles(b[..., 2:18]), d, -8 * d, 4, 32


def _q4_1(b: np.ndarray):
    return _nibbles(b[..., 4:20]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 4, 32


def _q5_0(b: np.ndarray):
    d = _f16(b[..., 0:2])
    return _nibbles(b[..., 6:22]) | _high_bits(b[..., 2:6]), d, -16 * d, 5, 32


def _q5_1(b: np.ndarray):
    return _nibbles(b[..., 8:24]) | _high_bits(b[..., 4:8]), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 5, 32


def _q8_0(b: np.ndarray):
    d = _f16(b[..., 0:2])
    return b[..., 2:34] ^ np.uint8(0x80), d, -128 * d, 8, 32  # two's complement + 128 = the sign bit flipped


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit scales and mins of a Q4_K / Q5_K super-block from its 12 bytes: (..., 8) each.

    Bytes 0-3 hold scales 0-3 (low 6 bits), 4-7 mins 0-3; scales and mins 4-7 are split: low 4 bits in byte
    8 + j (scale low nibble, min high nibble), top 2 bits in the top bits of bytes j (scale) and 4 + j (min).
    """
    lo, mid, hi = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    scales = np.concatenate([lo & 63, (hi & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=-1)
    return scales, mins


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """(..., 128) bytes of a K-quant super-block: byte chunk j (32 bytes) holds weights 64j..64j+31 in its low
    nibbles and 64j+32..64j+63 in its high nibbles. Returns (..., 256) in weight order."""
    c = qs.reshape(*qs.shape[:-1], 4, 32)  # (..., 4, 32)
    return np.stack([c & 0x0F, c >> 4], axis=-2).reshape(*qs.shape[:-1], 256)  # (..., 4, 2, 32) -> (..., 256)


def _q4_k(b: np.ndarray):
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])  # (N, B, 1)
    sc, mn = _k_scales(b[..., 4:16])  # (N, B, 8) uint8
    return _k_nibbles(b[..., 16:144]), d * sc, -dmin * mn, 4, 32, (d, sc, -dmin, mn)


def _q5_k(b: np.ndarray):
    d, dmin = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    sc, mn = _k_scales(b[..., 4:16])
    qh = b[..., 16:48]  # (N, B, 32): bit i of byte l is the fifth bit of weight 32i + l
    high = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # (N, B, 8, 32)
    codes = _k_nibbles(b[..., 48:176]) | (high.reshape(*qh.shape[:-1], 256) << 4)
    return codes, d * sc, -dmin * mn, 5, 32, (d, sc, -dmin, mn)


def _q6_k(b: np.ndarray):
    """Q6_K: 128 B low nibbles, 64 B high bit pairs, 16 int8 scales (one per 16 weights), fp16 d. Each half
    of 128 weights has 64 low-nibble bytes L and 32 high bytes H: its quarter i (32 weights) takes the low
    (i < 2) or high (i >= 2) nibbles of L[0:32] (i even) or L[32:64] (i odd), and bits 2i, 2i+1 of H."""
    lead = b.shape[:-1]
    ql, qh = b[..., 0:128].reshape(*lead, 2, 64), b[..., 128:192].reshape(*lead, 2, 32)  # per half
    low = np.stack([ql[..., :32] & 0x0F, ql[..., 32:] & 0x0F, ql[..., :32] >> 4, ql[..., 32:] >> 4], axis=-2)
    high = (qh[..., None, :] >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3  # (..., 2, 4, 32)
    codes = (low | (high << 4)).reshape(*lead, 256)  # 0..63: the weight is d * sc * (code - 32)
    scale = _f16(b[..., 208:210]) * np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    return codes, scale, -32 * scale, 6, 16


_READERS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0, Q.Q4_K: _q4_k,
            Q.Q5_K: _q5_k, Q.Q6_K: _q6_k}
# weights per block, bytes per block
_LAYOUT = {Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q5_0: (32, 22), Q.Q5_1: (32, 24), Q.Q8_0: (32, 34),
           Q.Q4_K: (_SUPER, 144), Q.Q5_K: (_SUPER, 176), Q.Q6_K: (_SUPER, 210)}
