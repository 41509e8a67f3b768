"""Stored weights packed once per machine (actors/model/layout_cache.py): a second start maps the packed file and
computes the same logits bit for bit, without packing or parsing the GGUF file; a changed file, a damaged cache or a
CPU without our kernels packs as before."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from actors.model import cpu_kernels
from actors.model.layout_cache import LayoutCache
from actors.model.loader import load_model
from actors.model.metadata import SeqChunk
from actors.model.runner import ModelRunner
from cluster.config import CacheConfig
from tests.fixtures.tiny_models import write_tiny_gguf

MIXED = {"attn_v.weight": Q.Q8_0, "ffn_down.weight": Q.Q5_1, "weight": Q.Q4_0}  # as test_stored_weights
CACHE = CacheConfig(block_size=4, num_blocks=64)
PROMPT = (3, 17, 42, 5, 9, 11, 2, 8)


@pytest.fixture
def gguf(tiny_models, tmp_path: Path) -> Path:
    return write_tiny_gguf(tiny_models["llama"], tmp_path / "tiny-llama-q.gguf", MIXED)


def start(path: Path) -> tuple[ModelRunner, torch.Tensor]:
    """A fresh load of the model and its runner, and the logits of PROMPT (T, V)."""
    model = load_model(str(path), "bf16", weights="stored")
    runner = ModelRunner(model, range(model.num_layers), CACHE)
    return runner, runner.forward([SeqChunk("r", PROMPT, len(PROMPT))])


def no_packing(*args, **kwargs):
    raise AssertionError("packed again: the layout cache was not used")


def test_a_second_start_maps_the_packed_weights_and_computes_the_same_logits(gguf: Path, monkeypatch) -> None:
    if cpu_kernels.kernel() is None:  # torch's ops compute the weights: nothing of ours to keep
        start(gguf)
        assert not list(gguf.parent.glob("*.layout-*")), "a layout was kept where our kernels do not run"
        return
    first, before = start(gguf)
    [kept] = gguf.parent.glob("*.layout-*.safetensors")
    assert kept == LayoutCache(gguf).path
    monkeypatch.setattr(cpu_kernels, "pack", no_packing)

    second, after = start(gguf)

    assert torch.equal(after, before)  # bit for bit
    assert "_reader" not in second.model.stored.__dict__  # every matrix came packed: the GGUF index never parsed
    for a, b in zip(first.layers, second.layers):
        for name in ("qkv_proj", "o_proj"):
            pa, pb = getattr(a.attn, name), getattr(b.attn, name)
            for ma, mb in zip(getattr(pa, "parts", [pa]), getattr(pb, "parts", [pb])):
                assert all(torch.equal(x, y) for x, y in zip(ma.operands(), mb.operands()))


def test_a_changed_or_damaged_file_is_packed_again(gguf: Path) -> None:
    if cpu_kernels.kernel() is None:
        pytest.skip("torch's ops compute the weights here: no layout is kept (the test above checks that)")
    _, before = start(gguf)
    old = LayoutCache(gguf).path
    old.write_bytes(old.read_bytes()[:100])  # damaged: said and packed again, same logits
    _, again = start(gguf)
    assert torch.equal(again, before) and old.stat().st_size > 100
    stat = gguf.stat()
    os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # the file replaced: another cache
    assert LayoutCache(gguf).path != old
    _, replaced = start(gguf)
    assert torch.equal(replaced, before) and LayoutCache(gguf).path.is_file()
    shutil.rmtree(gguf.parent)
