"""A migration's KV going stage to stage over links (actors/kv/links.py), between two engines of this process whose
stages split the layers differently, over real gloo groups; and the links' plan (cluster/migration.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from actors.engine.core import Engine
from actors.engine.migration import EngineMigration
from actors.kv.links import KVPorts, LinkedKV
from actors.executors.pipeline import PipelineRunner
from cluster.config import MigrationConfig, SchedulerConfig, SpeculationConfig
from cluster.migration import Link, MigrationStatus, migrate, plan_links
from cluster.migration_messages import (CloseChannel, Export, Import, KVLayout, LinkAddresses, OpenLinks, Pipeline,
                                        Side, StagesKV, Stop, Stopped)
from tests.unit.helpers import drain, text_prompts
from tests.unit.test_migration import EngineEndpoint, finish_and_check, started
from tests.unit.test_pipeline import pipeline

TORCH = MigrationConfig(max_stages=3, stop_copy_tokens=2, chunk_tokens=8, transfer="torch", channel_timeout_s=20)


def test_a_side_names_its_rank_and_stage_and_ports_take_no_string_for_it() -> None:
    link = Link("c/target/0->1", 0, 1, (0, 1))
    assert (Side.SRC.rank, Side.DST.rank) == (0, 1)
    assert (Side.SRC.stage(link), Side.DST.stage(link)) == (0, 1)
    with pytest.raises(TypeError, match="a link's side must be a Side"):
        KVPorts().open([link], "src", 1.0, "gloo")


def test_links_pair_every_stage_with_each_stage_that_shares_its_layers() -> None:
    assert plan_links([(0, 1, 2, 3)], [(0, 1, 2, 3)]) == [(0, 0, (0, 1, 2, 3))]
    assert plan_links([(0, 1, 2, 3)], [(0, 1), (2, 3)]) == [(0, 0, (0, 1)), (0, 1, (2, 3))]
    assert plan_links([(0,), (1, 2, 3)], [(0, 1), (2, 3)]) == [(0, 0, (0,)), (1, 0, (1,)), (1, 1, (2, 3))]
    with pytest.raises(ValueError, match="split different layers"):
        plan_links([(0, 1)], [(0, 1, 2)])


class LinkedEndpoint(EngineEndpoint):
    """EngineEndpoint with the link methods of actors/serving/server.py: its engine's stages (LocalStages) are
    the links' ends, and the KV goes over them whenever the migration has opened them (`via`)."""

    def __init__(self, engine: Engine, results, steps: int = 0) -> None:
        super().__init__(engine, results, steps=steps)
        self.routes: dict[str, dict[str, list]] = {}
        self.payloads: list[object] = []  # every KV payload the coordinator handed this end

    def _runner(self, pipeline: Pipeline) -> PipelineRunner:
        return self.engine.target if pipeline is Pipeline.TARGET else self.engine.draft

    def _links(self, via, pipeline):
        return None if via is None else self.routes[via].get(pipeline)

    async def migration(self, msg):
        match msg:
            case KVLayout(pipeline):
                executor = self._runner(pipeline).executor
                return StagesKV(list(executor.layer_ids), executor.kv_device())
            case LinkAddresses(pipeline, stages):
                return self._runner(pipeline).executor.link_addresses(list(stages), "127.0.0.1")
            case OpenLinks(channel, pipeline, links, side, timeout_s, backend):
                return await self.links_open(channel, pipeline, list(links), side, timeout_s, backend)
            case CloseChannel(channel):
                for pipeline in self.routes.pop(channel, {}):
                    self._runner(pipeline).executor.close_links(channel + "/")
                return None
            case Export(rid, Pipeline.TARGET, start, end, via):
                drain(self.engine, self.results, steps=self.steps)
                return self.moves.export(Pipeline.TARGET, rid, start, end, self._links(via, Pipeline.TARGET))
            case Export(rid, Pipeline.DRAFT, start, end, via):
                return self.moves.export(Pipeline.DRAFT, rid, start, end, self._links(via, Pipeline.DRAFT))
            case Import(pipeline, kv):
                self.payloads.append(kv)
                if isinstance(kv, LinkedKV):
                    await asyncio.to_thread(self._runner(pipeline).executor.receive_links, kv)
                return self.moves.import_kv(pipeline, kv)
            case Stop(rid, start, via):
                seq, resume, kv, end = self.moves.stop_out(rid, start, self._links(via, Pipeline.TARGET))
                self.detached[rid] = seq
                return Stopped(dataclasses.replace(seq.request, resume=resume), kv, end, 0.0)
        return await super().migration(msg)

    async def links_open(self, channel, pipeline, links, side, timeout_s, backend):
        """Join the links of `pipeline` (a test replaces it with one that fails)."""
        self.routes.setdefault(channel, {})[pipeline] = links
        await asyncio.to_thread(self._runner(pipeline).executor.open_links, links, side, timeout_s, backend)


def staged_engine(tiny_models, tiny_draft_models, stages: list[list[int]]) -> Engine:
    """The tiny llama as stages `stages` of this process, its perturbed copy as a one-stage draft (k = 3)."""
    return Engine(pipeline(tiny_models["llama"], stages), pipeline(tiny_draft_models["llama"], [[0, 1, 2, 3]]),
                  SpeculationConfig(policy="fixed", k=3), SchedulerConfig(max_batch_size=4))


@pytest.mark.parametrize(("src_split", "dst_split", "target_links"), [
    ([[0, 1, 2, 3]], [[0, 1], [2, 3]], 2),
    ([[0], [1, 2, 3]], [[0, 1], [2, 3]], 3),
], ids=["one stage to two", "two stages to two, split elsewhere"])
def test_a_request_migrates_stage_to_stage_between_different_splits(tiny_models, tiny_draft_models, src_split,
                                                                     dst_split, target_links) -> None:
    src = staged_engine(tiny_models, tiny_draft_models, src_split)
    dst = staged_engine(tiny_models, tiny_draft_models, dst_split)
    prompts = text_prompts(src.target.model, 2, offset=3)
    results = started(src, prompts, steps=4)
    a, b = LinkedEndpoint(src, results, steps=1), LinkedEndpoint(dst, results)

    outcome = asyncio.run(migrate("r0", a, b, TORCH, ids=("a", "b")))

    assert outcome.status is MigrationStatus.FINISHED, outcome
    assert outcome.transfer == "torch" and outcome.links == target_links + 1  # and the draft's one
    assert outcome.draft_tokens > len(prompts[0]) and outcome.stages >= 1
    # every payload the coordinator carried was headers: no tensor went through it
    assert b.payloads and all(isinstance(p, LinkedKV) for p in b.payloads)
    assert {p.src for kv in b.payloads[:-1] for p in kv.parts} <= set(range(len(src_split)))
    for end in (src.target.executor, src.draft.executor, dst.target.executor, dst.draft.executor):
        assert end.ports.open_links == []
    finish_and_check(src, dst, results, prompts, tiny_models["llama"])


def test_kv_received_over_links_equals_the_sources(tiny_models, tiny_draft_models) -> None:
    """Byte for byte: a range sent from two stages to two others split elsewhere lands as the source holds it."""
    src = staged_engine(tiny_models, tiny_draft_models, [[0], [1, 2, 3]])
    dst = staged_engine(tiny_models, tiny_draft_models, [[0, 1, 2], [3]])
    prompts = text_prompts(src.target.model, 1, offset=8)
    results = started(src, prompts, steps=3)
    a, b = LinkedEndpoint(src, results), LinkedEndpoint(dst, results)

    async def copy() -> None:
        via, links = "a->b/r0", plan_links(src.target.executor.layer_ids, dst.target.executor.layer_ids)
        addresses = await a.migration(LinkAddresses(Pipeline.TARGET, tuple(i for i, _, _ in links)))
        opened = tuple(Link(f"{via}/target/{i}->{j}", i, j, layers, addr)
                       for (i, j, layers), addr in zip(links, addresses))
        await asyncio.gather(a.migration(OpenLinks(via, Pipeline.TARGET, opened, Side.SRC, 20, "gloo")),
                             b.migration(OpenLinks(via, Pipeline.TARGET, opened, Side.DST, 20, "gloo")))
        assert EngineMigration(dst).reserve_incoming("r0", EngineMigration(src).kv_length("r0"))
        kv, _ = await a.migration(Export("r0", Pipeline.TARGET, 0, EngineMigration(src).kv_length("r0"), via))
        assert await b.migration(Import(Pipeline.TARGET, kv))
        await asyncio.gather(a.migration(CloseChannel(via)), b.migration(CloseChannel(via)))

    asyncio.run(copy())

    want, got = src.target.export_kv("r0", 0), dst.target.export_kv("r0", 0)
    k = {layer: e.k[i] for e in want for i, layer in enumerate(e.layer_ids)}
    assert [e.layer_ids for e in got] == [(0, 1, 2), (3,)]
    assert all(torch.equal(e.k[i], k[layer]) for e in got for i, layer in enumerate(e.layer_ids))
    EngineMigration(dst).drop_incoming("r0")
    assert dst.target.cache.num_used_blocks == 0


def test_links_that_cannot_open_leave_the_kv_to_the_object_store(tiny_models, tiny_draft_models) -> None:
    src = staged_engine(tiny_models, tiny_draft_models, [[0, 1, 2, 3]])
    dst = staged_engine(tiny_models, tiny_draft_models, [[0, 1], [2, 3]])
    prompts = text_prompts(src.target.model, 1, offset=2)
    results = started(src, prompts, steps=3)
    a, b = LinkedEndpoint(src, results, steps=1), LinkedEndpoint(dst, results)

    async def refuse(*_args) -> None:
        raise ConnectionError("the destination's stages are unreachable")
    b.links_open = refuse

    cfg = TORCH.model_copy(update={"channel_timeout_s": 2.0, "chunk_tokens": 256})
    outcome = asyncio.run(migrate("r0", a, b, cfg, ids=("a", "b")))

    assert outcome.status is MigrationStatus.FINISHED and outcome.transfer == "object_store" and outcome.links == 0
    assert not any(isinstance(p, LinkedKV) for p in b.payloads)
    assert src.target.executor.ports.open_links == []  # what the source had opened was closed again
    finish_and_check(src, dst, results, prompts, tiny_models["llama"])
