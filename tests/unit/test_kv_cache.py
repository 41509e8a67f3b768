"""Paged KV cache: block accounting, export and import of token ranges (migration), and running out of blocks."""

from __future__ import annotations

import pytest
import torch

from actors.engine.core import Engine, RequestError
from actors.model.metadata import SeqChunk
from actors.model.runner import CacheFull, ModelRunner
from actors.kv.cache import KVCache
from cluster.config import SpeculationConfig
from cluster.request import FinishReason, Request, SamplingParams
from tests.unit.helpers import drain, load, reference_greedy, runner, text_prompts

KVH, HD, BS = 2, 8, 4


def cache(num_blocks: int = 6, layers=(0, 1)) -> KVCache:
    return KVCache(list(layers), num_blocks=num_blocks, block_size=BS, num_kv_heads=KVH, head_dim=HD)


def fill(c: KVCache, rid: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write random K, V for tokens [length, length + n) of `rid` in every layer; returns them (L, n, kvh, hd)."""
    start = c.length(rid)
    assert c.reserve(rid, start + n)
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(len(c.layer_ids), n, KVH, HD, generator=g)
    v = torch.randn(len(c.layer_ids), n, KVH, HD, generator=g)
    slots = c.slots(rid, start, start + n)
    for i, layer in enumerate(c.layer_ids):
        c.write(layer, slots, k[i], v[i])
    c.set_length(rid, start + n)
    return k, v


def read(c: KVCache, rid: str) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of every written token of `rid`, through the same gather the attention uses: (L, n, kvh, hd)."""
    table = torch.tensor([c.block_table(rid)])
    n = c.length(rid)
    ks, vs = zip(*(c.gather(layer, table) for layer in c.layer_ids))
    return torch.stack([k[0, :n] for k in ks]), torch.stack([v[0, :n] for v in vs])


# ---- accounting ----------------------------------------------------------------------------------
def test_reserve_is_all_or_nothing() -> None:
    c = cache(num_blocks=6)  # 5 usable blocks of 4 tokens, the 6th is scratch
    assert (c.num_blocks, c.num_free_blocks, c.num_used_blocks) == (5, 5, 0)

    assert c.reserve("a", 9)  # 3 blocks
    assert (c.num_free_blocks, len(c.block_table("a"))) == (2, 3)
    assert not c.reserve("b", 12)  # needs 3, 2 are free
    assert not c.has("b") and c.num_free_blocks == 2
    assert not c.reserve("a", 21)  # growing a by 3 blocks fails too, and changes nothing
    assert len(c.block_table("a")) == 3 and c.num_free_blocks == 2
    assert c.reserve("a", 12) and len(c.block_table("a")) == 3  # still within its blocks
    assert c.reserve("b", 8) and c.num_free_blocks == 0
    assert c.extra_blocks_needed("b", 9) == 1 and not c.reserve("b", 9)


def test_blocks_are_unique_and_the_scratch_block_is_never_handed_out() -> None:
    c = cache(num_blocks=9)
    sizes = [5, 1, 8, 3, 4]  # 2 + 1 + 2 + 1 + 1 = 7 blocks
    for i, n in enumerate(sizes):
        assert c.reserve(f"r{i}", n)
    c.free("r1")
    c.crop("r2", 0)
    assert c.reserve("r5", 16)  # the 4 blocks left
    assert not c.reserve("r6", 1)
    tables = [b for i in range(6) for b in (c.block_table(f"r{i}") if c.has(f"r{i}") else [])]
    assert len(tables) == len(set(tables)) == c.num_blocks == 8
    assert c.scratch_block == 8 and c.scratch_block not in tables


def test_crop_frees_the_blocks_past_the_kept_length() -> None:
    c = cache(num_blocks=6)
    k, v = fill(c, "a", 14, seed=0)  # 4 blocks
    assert c.num_free_blocks == 1
    with pytest.raises(ValueError, match="cannot crop"):
        c.crop("a", 15)

    c.crop("a", 9)

    assert c.length("a") == 9 and len(c.block_table("a")) == 3 and c.num_free_blocks == 2
    got_k, got_v = read(c, "a")
    assert torch.equal(got_k, k[:, :9]) and torch.equal(got_v, v[:, :9])
    c.crop("a", 8)  # exactly 2 blocks
    assert len(c.block_table("a")) == 2 and c.num_free_blocks == 3
    c.crop("a", 0)
    assert c.block_table("a") == [] and c.num_free_blocks == 5


def test_free_releases_every_block_and_unknown_ids_are_a_no_op() -> None:
    c = cache(num_blocks=6)
    fill(c, "a", 7, seed=0)
    fill(c, "b", 5, seed=1)
    c.free("a")
    assert not c.has("a") and c.length("a") == 0 and c.num_used_blocks == 2
    c.free("a")
    c.free("never-seen")
    assert c.num_used_blocks == 2
    c.free("b")
    assert c.num_used_blocks == 0 and c.num_free_blocks == 5


def test_set_length_cannot_pass_the_reserved_blocks() -> None:
    c = cache()
    assert c.reserve("a", 4)
    with pytest.raises(ValueError):
        c.set_length("a", 5)


# ---- export / import -----------------------------------------------------------------------------
def test_export_then_import_into_a_fresh_cache_reproduces_the_kv() -> None:
    src = cache(num_blocks=12)
    fill(src, "other", 6, seed=9)  # so that the request's blocks are not the first ones
    k, v = fill(src, "a", 10, seed=1)
    dst = cache(num_blocks=12)
    fill(dst, "resident", 3, seed=8)

    export = src.export("a")
    assert (export.start, export.end, export.layer_ids) == (0, 10, (0, 1))
    assert export.k.shape == (2, 10, KVH, HD)
    assert dst.import_(export)

    assert dst.length("a") == 10 and dst.block_table("a") != src.block_table("a")
    got_k, got_v = read(dst, "a")
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    src.free("a")  # the export is a copy: the source may reuse its blocks
    fill(src, "c", 10, seed=5)
    assert torch.equal(read(dst, "a")[0], k)


def test_import_in_two_staged_ranges_equals_one_import() -> None:
    src = cache(num_blocks=12)
    k, v = fill(src, "a", 6, seed=2)
    first = src.export("a", 0, 6)
    k2, v2 = fill(src, "a", 7, seed=3)  # the request kept decoding while the first range was copied
    dst = cache(num_blocks=12)

    assert dst.import_(first) and dst.length("a") == 6
    with pytest.raises(ValueError, match="starts at"):
        dst.import_(src.export("a", 7, 13))  # must continue where the copy ends
    assert dst.import_(src.export("a", 6))

    got_k, got_v = read(dst, "a")
    assert torch.equal(got_k, torch.cat([k, k2], 1)) and torch.equal(got_v, torch.cat([v, v2], 1))
    assert torch.equal(got_k, read(src, "a")[0])


def test_import_refuses_without_room_and_with_other_layers() -> None:
    src = cache(num_blocks=12)
    fill(src, "a", 10, seed=0)
    small = cache(num_blocks=3)
    assert not small.import_(src.export("a"))
    assert not small.has("a") and small.num_used_blocks == 0
    with pytest.raises(ValueError, match="layers"):
        cache(layers=(2, 3)).import_(src.export("a"))
    with pytest.raises(ValueError, match="outside"):
        src.export("a", 4, 11)


@torch.no_grad()
def decode(r: ModelRunner, rid: str, first_token: int, steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy decode `steps` tokens one at a time, feeding `first_token` first; tokens and logits."""
    tokens, logits, nxt = [], [], first_token
    for _ in range(steps):
        out = r.forward([SeqChunk(rid, (nxt,))])[0]
        nxt = int(out.argmax())
        tokens.append(nxt)
        logits.append(out)
    return tokens, logits


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2_moe"])
def test_migrated_kv_continues_exactly_like_the_source(tiny_models, family: str) -> None:
    """Prefill and decode in runner A, copy the KV to runner B in two stages, and decode on in both."""
    model = load(tiny_models[family])
    prompt = text_prompts(model, 1)[0]  # 40 tokens: past mistral's sliding window
    reference = reference_greedy(tiny_models[family], prompt, 16)
    a, b = runner(model), runner(model)
    b.forward([SeqChunk("resident", tuple(text_prompts(model, 1, offset=1)[0]))])  # B's blocks are laid out differently

    first = int(a.forward([SeqChunk("m", tuple(prompt))])[0].argmax())
    tokens, _ = decode(a, "m", first, 5)
    assert [first, *tokens] == reference[:6]
    half = a.cache.length("m") // 2
    assert b.cache.import_(a.cache.export("m", 0, half))
    assert b.cache.import_(a.cache.export("m", half))
    assert b.cache.length("m") == a.cache.length("m") == len(prompt) + 5

    from_a, logits_a = decode(a, "m", tokens[-1], 10)
    from_b, logits_b = decode(b, "m", tokens[-1], 10)

    assert from_b == from_a == reference[6:16]
    torch.testing.assert_close(torch.stack(logits_b), torch.stack(logits_a), rtol=0, atol=1e-5)


def test_engine_request_moves_to_another_engine_mid_generation(tiny_models, tiny_draft_models) -> None:
    """Move a running request (target and draft KV, staged) between engines; the output is the uninterrupted one.

    There is no engine-level migration API yet, so this moves the Sequence object through `Engine.running`.
    """
    family, n_new = "qwen2", 24
    params = SamplingParams(temperature=0, max_tokens=n_new)

    def engine() -> Engine:
        target, draft = load(tiny_models[family]), load(tiny_draft_models[family])
        return Engine(runner(target), runner(draft), SpeculationConfig(k=3))

    a, b = engine(), engine()
    prompts = text_prompts(a.target.model, 2, offset=2)
    b.add_request(Request("resident", tuple(prompts[1]), params))
    results = drain(b, steps=2)
    a.add_request(Request("m", tuple(prompts[0]), params))
    drain(a, results, steps=3)
    assert 0 < len(results["m"].token_ids) < n_new

    [seq] = a.running
    for src, dst in ((a.target.cache, b.target.cache), (a.draft.cache, b.draft.cache)):
        length = src.length("m")
        assert dst.import_(src.export("m", 0, length // 2)) and dst.import_(src.export("m", length // 2))
        src.free("m")
    a.running.remove(seq)
    b.running.append(seq)
    assert not a.has_unfinished() and a.target.cache.num_used_blocks == a.draft.cache.num_used_blocks == 0

    drain(b, results, start_step=3)

    assert results["m"].token_ids == reference_greedy(tiny_models[family], prompts[0], n_new)
    assert results["resident"].token_ids == reference_greedy(tiny_models[family], prompts[1], n_new)
    assert b.target.cache.num_used_blocks == b.draft.cache.num_used_blocks == 0


# ---- out of blocks -------------------------------------------------------------------------------
def test_forward_without_room_raises_cache_full_and_changes_nothing(tiny_models) -> None:
    r = runner(load(tiny_models["llama"]), num_blocks=3)  # 2 usable blocks: 8 tokens
    with pytest.raises(CacheFull):
        r.forward([SeqChunk("a", tuple(range(10, 19)))])
    assert r.cache.num_used_blocks == 0 and r.cache.length("a") == 0

    r.forward([SeqChunk("a", tuple(range(10, 18)))])
    with pytest.raises(CacheFull):
        r.forward([SeqChunk("a", (5,))])
    assert r.cache.length("a") == 8 and r.cache.num_used_blocks == 2


@pytest.mark.parametrize("draft", [False, True])
def test_a_request_too_big_for_the_cache_is_refused_before_it_runs(tiny_models, tiny_draft_models,
                                                                   draft: bool) -> None:
    """The context is capped at what the cache holds (issue 39): a request that could never fit, or would outgrow the
    cache, is refused when it is added (a 400 at the API), where it used to start and then end with an error."""
    target = load(tiny_models["llama"])
    d = runner(load(tiny_draft_models["llama"]), num_blocks=6) if draft else None
    engine = Engine(runner(target, num_blocks=6), d, SpeculationConfig(k=3))  # 5 usable blocks: 20 tokens
    assert engine.max_model_len == 20
    small, big, grows = (text_prompts(target, 1, offset=i)[0] for i in (8, 4, 1))  # 3, 26 and 9 tokens
    engine.add_request(Request("small", tuple(small), SamplingParams(temperature=0, max_tokens=6)))
    with pytest.raises(RequestError, match="context is 20"):
        engine.add_request(Request("big", tuple(big), SamplingParams(temperature=0, max_tokens=3)))  # never fits
    with pytest.raises(RequestError, match="context of 20"):
        engine.add_request(Request("grows", tuple(grows), SamplingParams(temperature=0, max_tokens=20)))
    engine.add_request(Request("fills", tuple(grows), SamplingParams(temperature=0, max_tokens=11,
                                                                       ignore_eos=True)))  # the whole cache

    results = drain(engine)

    assert results["small"].finish_reason == FinishReason.LENGTH
    assert results["small"].token_ids == reference_greedy(tiny_models["llama"], small, 6)
    assert results["fills"].finish_reason == FinishReason.LENGTH and len(results["fills"].token_ids) == 11
    assert not engine.has_unfinished()
    assert engine.target.cache.num_used_blocks == 0
    assert d is None or d.cache.num_used_blocks == 0
