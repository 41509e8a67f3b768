"""Faults of a live migration between two real instance servers in this process (actors/serving/server.py driven by
cluster/migration.py): a hung end, a missed drop, a client that leaves mid-move, a coordinator that dies after the
commit, and the stats race. Each drives its timing with barriers (a gated step loop, endpoints that stop at a call);
the instances' leases are short here, so letting go of a migration's leftovers takes a fraction of a second."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable

import pytest

from actors.serving.server import InstanceServer
from cluster.config import CacheConfig, EngineConfig, MigrationConfig, ModelConfig, SchedulerConfig, SpeculationConfig
from cluster.migration import MigrationStatus, migrate
from cluster.migration_messages import Drop, Import, Pipeline, Release
from cluster.request import FinishReason, Request, SamplingParams
from placement.fleet import InstanceSpec
from placement.layout import ShardLayout, StageSlot
from tests.unit.helpers import load, reference_greedy, text_prompts

TOKENS = 40
STEP_S = 0.25  # each migration call's deadline; the instances' leases are twice this
CFG = MigrationConfig(transfer="object_store", max_stages=2, stop_copy_tokens=2, step_timeout_s=STEP_S)


class Gate:
    """Wraps an engine's step: while closed, the step loop runs no step (it still applies migration calls between
    its idle turns), so the request under test cannot run ahead or end while a fault is set up."""

    def __init__(self, server: InstanceServer) -> None:
        self.open = threading.Event()
        self.open.set()
        self.steps = 0
        engine = server.instance.engine
        real = engine.step

        def step():
            if not self.open.wait(0.002):
                return []
            self.steps += 1
            return real()
        engine.step = step


def server(tiny_models, tiny_draft_models, name: str) -> InstanceServer:
    cfg = EngineConfig(model=ModelConfig(target=str(tiny_models["llama"]), draft=str(tiny_draft_models["llama"])),
                       speculation=SpeculationConfig(policy="fixed", k=3), scheduler=SchedulerConfig(max_batch_size=4),
                       cache=CacheConfig(block_size=4, num_blocks=256))
    layout = ShardLayout(stages=(StageSlot(node="n", layers=(0, 4)),), draft_node="n")
    return InstanceServer(InstanceSpec(instance_id=name, engine=cfg, layout=layout, executor="local", num_cpus=1))


@pytest.fixture()
def pair(tiny_models, tiny_draft_models):
    a, b = (server(tiny_models, tiny_draft_models, n) for n in ("src", "dst"))
    yield a, b
    for s in (a, b):
        s.shutdown()


class Stream:
    """A client's stream as the API's frontend reads it: from the source, then the destination if it migrates."""

    def __init__(self, servers: dict[str, InstanceServer], request: Request) -> None:
        self.servers, self.request = servers, request
        self.tokens: list[int] = []
        self.finish: FinishReason | None = None
        self.started = asyncio.Event()  # set once the first tokens arrived
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        gen = self.servers["src"].generate(self.request)
        while True:
            async for item in gen:
                if item.migrated_to is not None:
                    gen = self.servers[item.migrated_to[0]].resume_stream(self.request.request_id)
                    break
                self.tokens += item.delta.token_ids
                if len(self.tokens) >= 4:
                    self.started.set()
                if item.delta.finished:
                    self.finish = item.delta.finish_reason
                    return
            else:
                return


class Stops:
    """An Endpoint in front of a real instance server that stops at the first message `at` picks (once): `reached` is
    set, and the call goes on only when `go` is set (never, for a hang). `before` runs in the call just before it goes
    on."""

    def __init__(self, inner: InstanceServer, at: Callable[[object], bool], before: Callable | None = None) -> None:
        self.inner, self.at, self.before = inner, at, before
        self.reached, self.go = asyncio.Event(), asyncio.Event()

    async def migration(self, msg):
        if self.at(msg):
            self.at = lambda _: False  # once
            self.reached.set()
            await self.go.wait()
            if self.before is not None:
                await self.before()
        return await self.inner.migration(msg)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def target_import(msg) -> bool:
    return isinstance(msg, Import) and msg.pipeline is Pipeline.TARGET


def release(msg) -> bool:
    return isinstance(msg, Release)


def request(model_path, offset: int = 3) -> Request:
    prompt = text_prompts(load(model_path), 1, offset=offset)[0]
    return Request("r0", tuple(prompt), SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True))


async def until(condition: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 20.0) -> None:
    """Wait for a condition that a lease makes true (the leases are the mechanism under test, and time is theirs)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await condition():
        assert asyncio.get_running_loop().time() < deadline, f"{what}: not within {timeout_s} s"
        await asyncio.sleep(0.05)


async def nothing_left(a: InstanceServer, b: InstanceServer) -> bool:
    return (await a.kv_blocks_used(), await b.kv_blocks_used()) == ((0, 0), (0, 0)) and not b._handed_in


def test_a_hung_destination_aborts_the_migration_at_its_deadline(pair, tiny_models) -> None:
    """A destination that stops answering mid-copy (its import never returns): the migration used to wait on it
    forever, holding the request's planning and failover; now the call's deadline aborts it, the request carries
    on at its source with the target's own output, and the destination holds nothing once its lease runs out."""
    src, dst = pair
    req = request(tiny_models["llama"])

    async def run():
        gate = Gate(src)
        stream = Stream({"src": src, "dst": dst}, req)
        await stream.started.wait()
        gate.open.clear()
        hung = Stops(dst, target_import)  # `go` is never set
        result = await asyncio.wait_for(migrate("r0", src, hung, CFG), 30)
        gate.open.set()
        await asyncio.wait_for(stream.task, 60)
        await until(lambda: nothing_left(src, dst), "the destination let go of its reservation")
        return result, stream

    result, stream = asyncio.run(run())
    assert result.status is MigrationStatus.ABORTED_DST and "did not answer within" in result.reason, result
    assert stream.finish is FinishReason.LENGTH
    assert stream.tokens == reference_greedy(tiny_models["llama"], req.prompt_token_ids, TOKENS)


def test_a_destination_that_misses_the_drop_frees_its_reservation_by_its_lease(pair, tiny_models) -> None:
    """The copy fails at the destination and the coordinator's drop never reaches it: the destination used to keep
    the reserved blocks for good (`_drop` logged and went on); its reservation's lease now frees them."""
    src, dst = pair
    req = request(tiny_models["llama"], offset=5)

    class LosesDrop(Stops):
        async def migration(self, msg):
            match msg:
                case Import(Pipeline.TARGET, _):
                    raise ConnectionError("the link to the destination broke")
                case Drop():
                    raise ConnectionError("the drop was lost on the way")
            return await super().migration(msg)

    async def run():
        gate = Gate(src)
        stream = Stream({"src": src, "dst": dst}, req)
        await stream.started.wait()
        gate.open.clear()
        result = await migrate("r0", src, LosesDrop(dst, lambda _: False), CFG)
        held = await dst.kv_blocks_used()
        gate.open.set()
        await asyncio.wait_for(stream.task, 60)
        await until(lambda: nothing_left(src, dst), "the destination freed the reservation")
        return result, held, stream

    result, held, stream = asyncio.run(run())
    assert result.status is MigrationStatus.ABORTED_DST, result
    assert held[0] > 0  # the reservation was there after the failed drop...
    assert stream.tokens == reference_greedy(tiny_models["llama"], req.prompt_token_ids, TOKENS)  # ...and is gone


def test_a_client_that_leaves_mid_migration_leaves_no_copy_running(pair, tiny_models) -> None:
    """The client goes away after the commit at the destination and before the source's release: the copy used to
    keep generating at the destination with nobody to read it, its buffered output never removed. Now the
    source's release says the request is gone, and the coordinator cancels the copy."""
    src, dst = pair
    req = request(tiny_models["llama"], offset=7)

    async def run():
        gate = Gate(src)
        stream = Stream({"src": src, "dst": dst}, req)
        await stream.started.wait()
        gate.open.clear()

        async def client_leaves():
            stream.task.cancel()  # the API's stream is gone: its generator's cleanup aborts the request at the source
            await asyncio.gather(stream.task, return_exceptions=True)
            await src.abort("r0")
        leaving = Stops(src, release, before=client_leaves)
        leaving.go.set()
        result = await migrate("r0", leaving, dst, CFG)
        gate.open.set()
        return result, await src.kv_blocks_used(), await dst.kv_blocks_used(), dict(dst._handed_in)

    result, src_kv, dst_kv, handed_in = asyncio.run(run())
    assert result.status is MigrationStatus.ABORTED_SRC and "client left" in result.reason, result
    assert src_kv == (0, 0) and dst_kv == (0, 0) and handed_in == {}


def test_a_coordinator_that_dies_after_the_commit_leaves_the_request_running_once(pair, tiny_models) -> None:
    """The router dies between the commit and the source's release (its task is cancelled at that call): the
    request used to stay stopped at the source for good, its stream silent, and the copy ran on for nobody. The
    source's lease resumes it where it was, the destination's aborts the copy: one output, the target's own."""
    src, dst = pair
    req = request(tiny_models["llama"], offset=9)

    async def run():
        gate = Gate(src)
        stream = Stream({"src": src, "dst": dst}, req)
        await stream.started.wait()
        gate.open.clear()
        dies = Stops(src, release)  # `go` is never set: the coordinator is cancelled there
        coordinator = asyncio.get_running_loop().create_task(migrate("r0", dies, dst, CFG))
        await dies.reached.wait()
        coordinator.cancel()
        gate.open.set()
        await asyncio.wait_for(stream.task, 60)
        await until(lambda: nothing_left(src, dst), "both ends let go of the migration")
        return stream

    stream = asyncio.run(run())
    assert stream.finish is FinishReason.LENGTH
    assert stream.tokens == reference_greedy(tiny_models["llama"], req.prompt_token_ids, TOKENS)


def test_stats_wait_for_the_step_under_way(pair, tiny_models) -> None:
    """`stats`, `health`, `info` and `kv_blocks_used` read the engine: they used to do it on the actor's event loop
    while the serving loop's thread stepped (a data race); now they run between two steps, as `load` does."""
    src, _ = pair
    engine = src.instance.engine
    real, in_step, release = engine.step, threading.Event(), threading.Event()

    def step():
        in_step.set()
        release.wait()
        return real()
    engine.step = step

    async def run():
        stream = Stream({"src": src}, request(tiny_models["llama"], offset=2))
        await asyncio.get_running_loop().run_in_executor(None, in_step.wait)
        reads = [asyncio.ensure_future(c) for c in (src.stats(), src.health(), src.info(), src.kv_blocks_used())]
        done, _ = await asyncio.wait(reads, timeout=0.5)  # none may finish while the step is under way
        release.set()
        await asyncio.wait_for(asyncio.gather(*reads), 30)
        stream.task.cancel()
        await src.abort("r0")
        return done

    assert asyncio.run(run()) == set()
