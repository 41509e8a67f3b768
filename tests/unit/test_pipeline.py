"""The pipeline's pure parts without Ray: ledger replay, PipelineRunner over in-process stages, KV resharding, p2p."""

from __future__ import annotations

import random

import pytest
import torch
import torch.multiprocessing as mp

from actors.engine.core import Engine
from actors.kv.cache import BlockPool, KVExport
from actors.kv.ledger import KVLedger, Reserve, replay
from actors.executors.local import LocalStages
from actors.model.loader import load_metadata
from actors.model.metadata import SeqChunk
from actors.model.runner import ModelRunner
from actors.engine.offline import generate
from actors.transport.p2p import P2P, TransferError, free_address
from actors.executors.pipeline import PipelineRunner, reshard
from cluster.config import CacheConfig, SchedulerConfig, SpeculationConfig
from cluster.request import SamplingParams
from placement.layout import ShardLayout, StageSlot
from tests.unit.helpers import load, reference_greedy, runner, text_prompts

CACHE = CacheConfig(block_size=4, num_blocks=256)


def pipeline(path, groups: list[list[int]], backend: str = "auto") -> PipelineRunner:
    model, last = load(path, backend), len(groups) - 1
    stages = [ModelRunner(model, g, CACHE, first=i == 0, last=i == last) for i, g in enumerate(groups)]
    return PipelineRunner(load_metadata(str(path), backend=backend), CACHE, LocalStages(stages))  # type: ignore[arg-type]


def test_a_pool_replaying_the_ledgers_ops_has_the_same_block_tables() -> None:
    """Random reserves, forwards, crops and frees; a forward ships the ops, then both sides write its tokens."""
    ledger, shard = KVLedger(40, 4), BlockPool(40, 4)
    rng = random.Random(0)
    live: dict[str, int] = {}
    for _ in range(500):
        rid = f"r{rng.randrange(8)}"
        action = rng.random()
        if action < 0.5:  # a forward of a few tokens
            total = live.get(rid, 0) + rng.randrange(1, 9)
            if ledger.reserve(rid, total):
                replay(ledger.drain(), shard)
                ledger.set_length(rid, total)
                shard.set_length(rid, total)
                live[rid] = total
                assert shard._free == ledger._free
                assert {r: shard.block_table(r) for r in live} == {r: ledger.block_table(r) for r in live}
        elif action < 0.8 and rid in live:
            live[rid] = rng.randrange(live[rid] + 1)
            ledger.crop(rid, live[rid])
        else:
            ledger.free(rid)
            live.pop(rid, None)
    replay(ledger.drain(), shard)
    assert shard.num_used_blocks == ledger.num_used_blocks


def test_a_reserve_that_changes_nothing_is_not_recorded() -> None:
    ledger = KVLedger(10, 4)
    assert ledger.reserve("a", 3) and ledger.reserve("a", 4)  # the second fits in the first's block
    assert not ledger.reserve("b", 100)
    ledger.free("unknown")
    assert ledger.drain() == [Reserve("a", 3)]


@pytest.mark.parametrize("groups", [[[0, 1], [2, 3]], [[0], [1, 2], [3]]], ids=["2 stages", "3 stages"])
def test_engine_over_a_pipeline_equals_the_targets_greedy_output(tiny_models, tiny_draft_models, groups) -> None:
    target = pipeline(tiny_models["llama"], groups)
    draft = pipeline(tiny_draft_models["llama"], [[0, 1, 2, 3]])
    engine = Engine(target, draft, SpeculationConfig(policy="fixed", k=3), SchedulerConfig(max_batch_size=4))
    prompts = text_prompts(load(tiny_models["llama"]), 4, offset=10)

    completions = generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=16))

    for prompt, c in zip(prompts, completions):
        assert c.token_ids == reference_greedy(tiny_models["llama"], prompt, 16)
    assert sum(c.stats.proposed for c in completions) > sum(c.stats.accepted for c in completions) > 0  # crops ran
    target.flush()
    draft.flush()
    for runner_ in target.executor.runners + draft.executor.runners:
        assert runner_.cache.num_used_blocks == 0
    assert target.cache.num_used_blocks == draft.cache.num_used_blocks == 0


def test_kv_exported_from_one_split_continues_identically_in_another(tiny_models) -> None:
    path = tiny_models["llama"]
    prompt = text_prompts(load(path), 1, offset=0)[0]
    src, dst = pipeline(path, [[0, 1], [2, 3]]), pipeline(path, [[0], [1, 2], [3]])
    whole = runner(load(path))
    logits = src.forward([SeqChunk("r", tuple(prompt))])
    whole.forward([SeqChunk("r", tuple(prompt))])
    token = int(logits[-1].argmax())

    assert dst.import_kv(src.export_kv("r"))

    assert dst.cache.length("r") == src.cache.length("r") == len(prompt)
    expected = whole.forward([SeqChunk("r", (token,))])
    assert torch.allclose(dst.forward([SeqChunk("r", (token,))]), expected, atol=1e-5)
    assert torch.allclose(src.forward([SeqChunk("r", (token,))]), expected, atol=1e-5)


def test_reshard_regroups_layers_and_refuses_gaps() -> None:
    k = torch.arange(4 * 3 * 2 * 1, dtype=torch.float32).view(4, 3, 2, 1)  # (L, T, kvh, hd)
    exports = [KVExport("r", (0, 1), 5, 8, k[:2], -k[:2]), KVExport("r", (2, 3), 5, 8, k[2:], -k[2:])]
    parts = reshard(exports, [(0,), (1, 2, 3)])
    assert [p.layer_ids for p in parts] == [(0,), (1, 2, 3)]
    assert torch.equal(torch.cat([p.k for p in parts]), k) and torch.equal(parts[1].v, -k[1:])
    with pytest.raises(ValueError, match="lack layers"):
        reshard(exports[:1], [(0, 1, 2)])


def test_layout_from_explicit_stages_checks_contiguity_and_pins_bundles() -> None:
    layout = ShardLayout(stages=(StageSlot(node="a", layers=(0, 1), gpus=1.0), StageSlot(node="b", layers=(1, 4))),
                         draft_node="c", draft_gpus=0.5)
    assert layout.bundles(1.0) == [
        {"CPU": 1.0, "GPU": 1.0, "specfleet_node_a": 0.001}, {"CPU": 1.0, "specfleet_node_b": 0.001},
        {"CPU": 1.0, "GPU": 0.5, "specfleet_node_c": 0.001}]
    assert layout.draft_bundle == 2
    pod = layout.model_copy(update={"pins": {"b": "node:10.0.0.7"}})
    assert [list(b)[-1] for b in pod.bundles(1.0)] == ["specfleet_node_a", "node:10.0.0.7", "specfleet_node_c"]
    with pytest.raises(ValueError, match="expected"):
        ShardLayout(stages=(StageSlot(node="a", layers=(0, 2)), StageSlot(node="b", layers=(3, 4))))


# ---- p2p over gloo, in two processes --------------------------------------------------------------
def _p2p_peer(rank: int, address: str, timeout_s: float, mode: str, queue) -> None:
    torch.set_num_threads(1)
    link = P2P(address, rank, 2, timeout_s)
    try:
        if rank == 0:
            if mode == "send":
                link.send(torch.arange(8 * 1536, dtype=torch.float32).view(8, 1536), dst=1)
            queue.get(timeout=60)  # stay up until the receiver is done
        else:
            try:
                x, t = link.recv((8, 1536), torch.float32, src=0)
                queue.put(("ok", torch.equal(x, torch.arange(8 * 1536, dtype=torch.float32).view(8, 1536)),
                           t.nbytes))
            except TransferError as e:
                queue.put(("error", str(e), 0))
    finally:
        link.close()


def _run_pair(mode: str, timeout_s: float):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    address = free_address("127.0.0.1")
    procs = [ctx.Process(target=_p2p_peer, args=(rank, address, timeout_s, mode, queue)) for rank in (0, 1)]
    for p in procs:
        p.start()
    result = queue.get(timeout=120)
    queue.put("done")
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():  # a group torn down after a failed transfer may not exit cleanly: not what is tested
            p.kill()
            p.join()
    return result


@pytest.mark.heavy
def test_p2p_moves_an_8_by_1536_fp32_tensor_over_gloo() -> None:
    assert _run_pair("send", timeout_s=60) == ("ok", True, 8 * 1536 * 4)


@pytest.mark.heavy
def test_p2p_receive_without_a_sender_fails_within_the_timeout() -> None:
    kind, message, _ = _run_pair("silent", timeout_s=2)
    assert kind == "error" and "from rank 0" in message
