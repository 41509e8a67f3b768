"""A GGUF file's quantized weight matrices, found by their transformers names and read as stored (gguf_blocks).

The file is memory-mapped once; a matrix is decoded when asked for. llama.cpp stores the q and k projections of
the "llama" architecture (Llama, Mistral, SmolLM) with rows permuted for its rotary layout; transformers undoes
that on load, and so does `get` (a row permutation keeps every row's blocks whole: exact). Where a dequantized
folder was converted from a GGUF file (actors/model/convert.py), `source_of` finds the file again from the folder's
manifest, checked against the checksum recorded there.
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import torch

from actors.model.gguf_blocks import GroupedInts, read_blocks, readable
from actors.model.layout_cache import LayoutCache

# transformers module name (within a decoder layer) -> GGUF tensor name (within block i)
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


class StoredTensors:
    """The quantized matrices of one GGUF file, by transformers module name (`model.layers.3.self_attn.q_proj`,
    `lm_head`)."""

    def __init__(self, path: Path, num_heads: int, num_kv_heads: int) -> None:
        self.path = Path(path)
        self.heads = {"attn_q": num_heads, "attn_k": num_kv_heads}
        self.layout = LayoutCache(self.path)  # its matrices as our kernel reads them, packed by an earlier start

    @functools.cached_property
    def _reader(self):  # noqa: ANN202 - gguf's GGUFReader
        """The file's index, parsed on first use: a start whose every matrix comes packed from `layout` needs none
        (parsing it, every metadata field included, took seconds on a 2-core CPU)."""
        from gguf import GGUFReader

        return GGUFReader(self.path)

    @functools.cached_property
    def arch(self) -> str:
        return str(self._reader.fields["general.architecture"].contents())

    @functools.cached_property
    def tensors(self) -> dict:
        return {t.name: t for t in self._reader.tensors}

    def gguf_name(self, name: str) -> str | None:
        """The file's tensor for a transformers module, or None if the file has none."""
        if name == "lm_head":  # a tied head is the token embedding
            return next((n for n in ("output.weight", "token_embd.weight") if n in self.tensors), None)
        m = _LAYER.fullmatch(name)
        if m is None or m.group(2) not in _LAYER_NAMES:
            return None
        gguf = f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.weight"
        return gguf if gguf in self.tensors else None

    def get(self, name: str) -> GroupedInts | None:
        """The quantized (N, K) matrix of a transformers module, in transformers' row order; None where the file
        holds it dense (F32, F16, BF16), in a format not read here, or not at all."""
        gguf = self.gguf_name(name)
        if gguf is None:
            return None
        t = self.tensors[gguf]
        if not readable(t.tensor_type):
            return None
        k, n = (int(d) for d in t.shape)  # ggml lists the fastest-moving dimension first
        w = read_blocks(t.data, t.tensor_type, (n, k))
        kind = gguf.split(".")[-2]
        if self.arch == "llama" and kind in self.heads:
            w = w.rows(_unpermute_rows(n, self.heads[kind]))
        return w


def _unpermute_rows(n: int, heads: int) -> torch.Tensor:
    """Row order (N,) that turns llama.cpp's rotary layout of q / k back into transformers' (per head, the two
    interleaved halves become contiguous)."""
    return torch.arange(n).view(heads, n // heads // 2, 2).transpose(1, 2).reshape(-1)


def source_of(folder: Path) -> Path | None:
    """The GGUF file a converted folder came from, if its manifest names one that is still there unchanged."""
    from actors.model.convert import MANIFEST, file_sha256

    try:
        meta = json.loads((Path(folder) / MANIFEST).read_text())["meta"]
    except (OSError, ValueError, KeyError):
        return None
    source = Path(meta.get("source", ""))
    if not source.is_file() or file_sha256(source, Path(folder).parent / "digests") != meta.get("source_sha256"):
        return None
    return source
