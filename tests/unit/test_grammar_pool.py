"""Grammars compile off the engine's loop (actors/serving/grammar_pool.py): one key flooding distinct large schemas neither
stalls another key's stream nor its compiles, a compile too slow is a 400, and the compiled cache holds its bytes.

The flood's schemas are ~330 KB objects of 2,000 properties each: llguidance takes about a second to compile one on
an idle core of this machine, more under load; each test measures that in its own run and bounds against it.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from actors.serving.grammar_pool import GrammarPool
from actors.serving.server import InstanceServer
from actors.speculation.structured import GrammarCompiler
from cluster.config import GrammarConfig
from cluster.request import InvalidRequest, Request, SamplingParams, StructuredOutput
from placement.fleet import InstanceSpec
from tests.ray.test_instance_server import LAYOUTS, engine_config
from tests.unit.helpers import load

PROPERTIES = 2000


def big_schema(salt: int, properties: int = PROPERTIES) -> StructuredOutput:
    """A distinct object schema of `properties` string properties (~165 bytes each)."""
    names = [f"p{salt}_{i}_" + "x" * 40 for i in range(properties)]
    return StructuredOutput(json_schema={
        "type": "object",
        "properties": {n: {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}{salt}$", "description": "d" * 40}
                       for i, n in enumerate(names)},
        "required": names[:50]})


SMALL = StructuredOutput(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


def compiler(tiny_models, cache_bytes: int = 64 * 2**20) -> GrammarCompiler:
    tok = load(tiny_models["llama"]).tokenizer
    c = GrammarCompiler(tok, len(tok), [tok.eos_token_id], cache_bytes=cache_bytes)
    c.tokenizer  # llguidance's view of the vocabulary, built once up front
    return c


def compile_seconds(tiny_models, salt: int) -> float:
    """One big schema's compile time on this machine now (a compiler of its own: no cache)."""
    t0 = time.perf_counter()
    compiler(tiny_models).compile(big_schema(salt))
    return time.perf_counter() - t0


@pytest.mark.heavy  # several seconds of compiles
def test_a_flooding_key_holds_one_thread_and_another_keys_grammar_compiles_meanwhile(tiny_models) -> None:
    async def scenario() -> None:
        pool = GrammarPool(compiler(tiny_models), GrammarConfig(compile_workers=2, compile_timeout_s=600))
        flood = [asyncio.ensure_future(pool.compile("hostile", big_schema(i))) for i in range(4)]
        await asyncio.sleep(0.05)
        assert pool.slots.running("hostile") == 1 and pool.slots.queued == 3  # all threads but one, the rest wait
        t0 = time.perf_counter()
        small = await pool.compile("ordinary", SMALL)  # a free thread at once: not behind the flood
        assert time.perf_counter() - t0 < 1.0 and small.start() is not None
        assert sum(f.done() for f in flood) <= 1  # the flood's compiles are still running or waiting
        await asyncio.gather(*flood)
        assert (pool.slots.busy, pool.slots.queued) == (0, 0)
        pool.shutdown()

    asyncio.run(scenario())


def test_a_compile_past_the_time_bound_is_refused_and_so_is_its_spec_sent_again(tiny_models) -> None:
    took = compile_seconds(tiny_models, salt=900)
    bound = min(0.3, took / 3)

    async def scenario() -> None:
        pool = GrammarPool(compiler(tiny_models), GrammarConfig(compile_workers=2, compile_timeout_s=bound))
        t0 = time.perf_counter()
        with pytest.raises(InvalidRequest, match="took longer than .* to compile"):
            await pool.compile("hostile", big_schema(901))
        waited = time.perf_counter() - t0
        assert waited < took, (waited, took)  # refused at the bound, not after the compile
        assert pool.slots.running("hostile") == 1  # the compile goes on in its thread, holding the key's share
        with pytest.raises(InvalidRequest, match="took longer than"):
            await pool.compile("hostile", big_schema(901))  # the same spec again: refused at once, from memory
        assert pool.slots.running("hostile") == 1  # no second compile was started for it
        assert (await pool.compile("ordinary", SMALL)) is not None  # the other thread serves everyone else
        while pool.slots.busy:  # the timed-out compile ends and gives its thread back
            await asyncio.sleep(0.05)
        pool.shutdown()

    asyncio.run(scenario())


def test_the_compiled_cache_stays_under_its_byte_bound(tiny_models) -> None:
    c = compiler(tiny_models, cache_bytes=2**20)
    kept = [c.compile(big_schema(i, properties=300)) for i in range(30)]  # ~47 KB of grammar each
    assert all(g.nbytes > 40_000 for g in kept)
    assert 0 < c.held_bytes <= 2**20
    assert c.cached(big_schema(29, properties=300)) is kept[-1]  # the newest kept, the oldest let go
    assert c.cached(big_schema(0, properties=300)) is None


@pytest.mark.heavy  # several seconds of compiles
def test_one_keys_distinct_large_schemas_do_not_stall_another_keys_stream(tiny_models, tiny_draft_models) -> None:
    """The ordinary key's stream keeps its tokens coming while the hostile key's schemas compile: no gap between two
    of its items comes near one compile's time (on the engine's loop each compile held every stream for all of it)."""
    took = compile_seconds(tiny_models, salt=500)
    cache_bytes = 700_000  # two of the flood's grammars (~314 KB each), not three
    cfg = engine_config(tiny_models["llama"], tiny_draft_models["llama"]).model_copy(
        update={"grammar": GrammarConfig(compile_workers=2, cache_bytes=cache_bytes, compile_timeout_s=600)})
    server = InstanceServer(InstanceSpec(instance_id="test-grammar-flood", layout=LAYOUTS["local"], executor="local",
                                         num_cpus=1, engine=cfg))
    prompt = tuple(load(tiny_models["llama"]).tokenizer.encode("Tell me about the sea"))

    async def stream(rid: str, params: SamplingParams, tenant: str) -> list[float]:
        """Arrival times of the request's items (its submission first); it must finish without an error."""
        times, last = [time.perf_counter()], None
        async for item in server.generate(Request(rid, prompt, params, tenant=tenant)):
            times.append(time.perf_counter())
            last = item
        assert last.delta.finished and last.delta.error is None, last.delta.error
        return times

    async def scenario() -> list[float]:
        await stream("warm", SamplingParams(max_tokens=4, temperature=0), "ordinary")
        flood = [asyncio.ensure_future(stream(f"h{i}", SamplingParams(max_tokens=2, temperature=0,
                                                                      structured=big_schema(i)), "hostile"))
                 for i in range(4)]
        gaps, n = [], 0
        while not all(f.done() for f in flood):
            times = await stream(f"o{n}", SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), "ordinary")
            gaps += [b - a for a, b in zip(times, times[1:])]
            n += 1
        await asyncio.gather(*flood)
        return gaps

    try:
        gaps = asyncio.run(scenario())
    finally:
        server.shutdown()
    assert max(gaps) < took / 2, (max(gaps), took)
    assert len(gaps) > 16  # several streams' worth of gaps while the flood compiled
    assert 0 < server.instance.engine.grammars.held_bytes <= cache_bytes
