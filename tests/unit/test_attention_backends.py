"""Each layer's attention backend (actors/model/attention_backends.py) is chosen when the layer is built, from what
does not change while it runs; a changed layer is a new one, which chooses again; the backends compute the same
attention."""

from __future__ import annotations

from dataclasses import FrozenInstanceError, replace
from pathlib import Path

import pytest
import torch

from actors.kv.cache import KVCache
from actors.model.attention_backends import FusedCpuAttention, Heads, PaddedSdpa, SpanAttention
from actors.model.deterministic import DeterministicAttention
from actors.model.loader import load_model
from actors.model.metadata import AttentionMetadata, SeqChunk
from actors.model.runner import ModelRunner
from actors.moe.shuffle import slice_attention
from cluster.config import CacheConfig
from tests.fixtures.tiny_models import build_tiny_model
from tests.unit.helpers import isa_params


@pytest.mark.parametrize("kernel_isa", isa_params("torch"), indirect=True)
def test_each_layer_is_built_with_the_backend_its_kernels_and_mode_call_for(tmp_path: Path, kernel_isa: str) -> None:
    path = build_tiny_model("qwen2", tmp_path / "q", hidden_size=128, head_dim=32, intermediate_size=256)
    model = load_model(str(path), "bf16")
    cache = CacheConfig(block_size=4, num_blocks=64)
    plain = ModelRunner(model, range(4), cache)
    kernels = SpanAttention if kernel_isa == "torch" else FusedCpuAttention
    assert [type(layer.attn.backend) for layer in plain.layers] == [kernels] * 4
    assert all((layer.fused is None) == (kernel_isa == "torch") for layer in plain.layers)
    det = ModelRunner(model, range(4), cache, deterministic=True)
    assert [type(layer.attn.backend) for layer in det.layers] == [DeterministicAttention] * 4
    assert type(slice_attention(plain.layers[0].attn, 0, 2).backend) is PaddedSdpa  # a head slice: kv_map


def test_a_built_attention_is_changed_only_by_building_a_new_one(tmp_path: Path) -> None:
    """Frozen: a kernel or mode set on a built layer would leave its backend stale, so it is refused; `replace`
    builds a new one, which chooses again."""
    path = build_tiny_model("qwen2", tmp_path / "q", hidden_size=128, head_dim=32, intermediate_size=256)
    attn = ModelRunner(load_model(str(path), "fp32"), range(1), CacheConfig(block_size=4, num_blocks=16)).layers[0].attn
    assert type(attn.backend) is SpanAttention  # fp32: our kernels take bf16 only
    with pytest.raises(FrozenInstanceError):
        attn.deterministic = True  # type: ignore[misc]
    assert type(replace(attn, deterministic=True).backend) is DeterministicAttention
    assert type(attn.backend) is SpanAttention


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("scattered", [False, True])
def test_every_backend_gives_the_padded_sdpa_attention(window: int | None, scattered: bool) -> None:
    """In fp32, for one sequence (its blocks consecutive or not) over a prefill, a verification and a decode, and for
    a batch of two: the in-place span, the batch-invariant rows and SDPA over the padded batch agree."""
    torch.manual_seed(0)
    heads = Heads(num_heads=6, num_kv_heads=2, head_dim=16, sliding_window=window)
    backends = [PaddedSdpa(heads), SpanAttention(heads), DeterministicAttention(heads, None)]
    caches = [KVCache([0], num_blocks=32, block_size=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)
              for _ in backends]
    if scattered:  # another request takes every other block while "a" grows
        for cache in caches:
            for i in range(6):
                assert cache.reserve("a", 4 * (i + 1)) and cache.reserve(f"gap{i}", 4)
    for step in ([("a", 11)], [("a", 4)], [("a", 1)], [("a", 1), ("b", 3)]):
        n = sum(t for _, t in step)
        q, k, v = torch.randn(n, 6, 16), torch.randn(n, 2, 16), torch.randn(n, 2, 16)  # (N, nh|kvh, hd)
        outs = []
        for backend, cache in zip(backends, caches):
            chunks = [SeqChunk(rid, tuple(range(t))) for rid, t in step]
            meta = _meta(chunks, cache)
            assert (meta.span is not None) == (len(step) == 1 and not scattered)
            outs.append(backend.write_and_attend(q, k, v, meta, cache, 0))  # (N, nh*hd)
            for c in chunks:
                cache.set_length(c.request_id, cache.length(c.request_id) + len(c.token_ids))
        for out in outs[1:]:
            torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-5)


def _meta(chunks: list[SeqChunk], cache: KVCache) -> AttentionMetadata:
    for c in chunks:
        assert cache.reserve(c.request_id, cache.length(c.request_id) + len(c.token_ids))
    return AttentionMetadata.build(chunks, cache)
