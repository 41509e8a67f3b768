"""Live migration between two engines in this process: staged copies, commit, and every abort path (cluster/migration.py)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch

from actors.engine.core import Engine
from actors.engine.migration import EngineMigration
from actors.executors.local import LocalStages
from actors.model.runner import ModelRunner
from actors.engine.offline import generate
from actors.executors.pipeline import PipelineRunner
from cluster.config import MigrationConfig
from cluster.migration import MigrationStatus, migrate
from cluster.migration_messages import (Commit, Drop, Export, Import, Length, Names, Pipeline, Release, Reserve, Stop,
                                        Stopped)
from cluster.config import SchedulerConfig, SpeculationConfig
from cluster.request import Request, Resume, SamplingParams
from tests.unit.helpers import Result, drain, load, reference_greedy, runner, text_prompts
from tests.unit.test_pipeline import CACHE, pipeline

TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=TOKENS, ignore_eos=True)


def engine(tiny_models, tiny_draft_models, *, split: bool = False, num_blocks: int = 256) -> Engine:
    """The tiny llama with its perturbed copy as draft (k = 3); `split`: the target as two stages."""
    path = tiny_models["llama"]
    target = pipeline(path, [[0, 1], [2, 3]]) if split else runner(load(path), num_blocks=num_blocks)
    return Engine(target, runner(load(tiny_draft_models["llama"])), SpeculationConfig(policy="fixed", k=3),
                  SchedulerConfig(max_batch_size=4))


class EngineEndpoint:
    """An Endpoint over an engine in this process; the source takes `steps` engine steps per export (it keeps
    decoding while its KV is copied), collecting its deltas into `results`."""

    def __init__(self, engine: Engine, results: dict[str, Result], steps: int = 0, fail_on: str = "") -> None:
        self.engine, self.results, self.steps, self.fail_on = engine, results, steps, fail_on
        self.moves = EngineMigration(engine)
        self.detached = {}
        self.exports: list[tuple[int, int]] = []  # the (start, end) asked of each export
        self.draft_imports: list[int] = []  # the length of each draft KV it was sent
        self.draft_steps = 0  # steps the source takes before each draft export
        self.between_steps = lambda: None  # what else happens at the source after its steps, before an export
        self.before_stop = lambda: None  # and before the stop

    def _maybe_fail(self, name: str) -> None:
        if name == self.fail_on:
            raise ConnectionError(f"{name}: the instance died")

    async def migration(self, msg):
        match msg:
            case Length(rid):
                self._maybe_fail("length")
                return self.moves.kv_length(rid) if self.moves.holds(rid) else None
            case Names(rid):
                return self.moves.block_names(rid)
            case Reserve(rid, tokens, _, names):
                return self.moves.reserve_incoming(rid, tokens, names)
            case Export(rid, Pipeline.TARGET, start, end):
                self._maybe_fail("export")
                self.exports.append((start, end))
                drain(self.engine, self.results, steps=self.steps)
                self.between_steps()
                return self.moves.export(Pipeline.TARGET, rid, start, end)
            case Import(Pipeline.TARGET, exports):
                self._maybe_fail("import")
                return self.moves.import_kv(Pipeline.TARGET, exports)
            case Export(rid, Pipeline.DRAFT, start, end):
                self._maybe_fail("export_draft")
                drain(self.engine, self.results, steps=self.draft_steps)
                return self.moves.export(Pipeline.DRAFT, rid, start, end)
            case Import(Pipeline.DRAFT, exports):
                self._maybe_fail("import_draft")
                self.draft_imports.append(exports[0].end)
                return self.moves.import_kv(Pipeline.DRAFT, exports)
            case Stop(rid, start):
                self.before_stop()
                stopped = self.moves.stop_out(rid, start)
                if stopped is None:
                    return None
                seq, resume, exports, end = stopped
                self.detached[rid] = seq
                return Stopped(dataclasses.replace(seq.request, resume=resume), exports, end, 0.0)
            case Commit(request):
                self._maybe_fail("commit")
                self.engine.add_request(request)
                return True
            case Release(rid, committed):
                self._maybe_fail("release")
                seq = self.detached.pop(rid)
                if committed:
                    self.moves.release_detached(seq)
                else:
                    self.moves.reattach(seq)
                return True
            case Drop(rid):  # what was reserved and imported, or a copy committed here
                self.moves.drop_incoming(rid)
                if self.moves.holds(rid):
                    self.engine.abort(rid)
                return None
        raise TypeError(f"not a migration message: {msg!r}")


def draft_kv_at(engine: Engine, rid: str = "r0"):
    """The request's draft KV at `engine` as a migration copies it (None: none beyond token 0)."""
    got = EngineMigration(engine).export(Pipeline.DRAFT, rid, 0)
    return None if got is None else got[0]


def started(src: Engine, prompts, params: SamplingParams = GREEDY, steps: int = 3) -> dict[str, Result]:
    """Requests r0, r1, ... of `prompts` queued at `src`, which then takes `steps` steps; their deltas so far."""
    results: dict[str, Result] = {}
    for i, p in enumerate(prompts):
        src.add_request(Request(f"r{i}", tuple(p), params))
    drain(src, results, steps=steps)
    return results


def run_migration(src: Engine, dst: Engine, params: SamplingParams, prompts, *, steps_before: int = 3,
                  cfg: MigrationConfig = MigrationConfig(max_stages=3, stop_copy_tokens=2), fail_on: str = "",
                  src_steps: int = 1):
    """Start every prompt at `src`, migrate request r0 to `dst` after `steps_before` steps, run both to the end."""
    results = started(src, prompts, params, steps_before)
    a = EngineEndpoint(src, results, steps=src_steps)
    b = EngineEndpoint(dst, results, fail_on=fail_on)
    outcome = asyncio.run(migrate("r0", a, b, cfg))
    drain(src, results)
    drain(dst, results)
    return outcome, results


def finish_and_check(src: Engine, dst: Engine, results: dict[str, Result], prompts, target, tokens: int = TOKENS
                     ) -> None:
    """Run both engines to the end: every request r0, r1, ... gives the target's own greedy output over `tokens`
    tokens, and neither engine holds any KV after."""
    drain(src, results)
    drain(dst, results)
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == reference_greedy(target, p, tokens), f"r{i}"
    assert_no_kv_left(src, dst)


def assert_no_kv_left(*engines: Engine) -> None:
    for e in engines:
        assert e.target.cache.num_used_blocks == 0 and e.draft.cache.num_used_blocks == 0


@pytest.mark.parametrize("split", [False, True], ids=["same split", "two-stage destination"])
@pytest.mark.parametrize("cfg", [MigrationConfig(max_stages=3, stop_copy_tokens=2), MigrationConfig(max_stages=0),
                                 MigrationConfig(max_stages=2, stop_copy_tokens=2, chunk_tokens=16),
                                 MigrationConfig(max_stages=3, stop_copy_tokens=2, draft_kv="rebuild")],
                         ids=["staged", "stop-and-copy", "staged in chunks of 16", "draft KV rebuilt"])
def test_a_migrated_greedy_request_equals_the_targets_own(tiny_models, tiny_draft_models, split, cfg) -> None:
    src, dst = engine(tiny_models, tiny_draft_models), engine(tiny_models, tiny_draft_models, split=split)
    prompts = text_prompts(src.target.model, 3, offset=2)

    outcome, results = run_migration(src, dst, GREEDY, prompts, cfg=cfg)

    assert outcome.status is MigrationStatus.FINISHED, outcome
    assert outcome.stages == cfg.max_stages or cfg.max_stages and outcome.stages >= 1
    assert outcome.tokens_copied >= len(prompts[0])
    for i, p in enumerate(prompts):
        r = results[f"r{i}"]
        assert r.token_ids == reference_greedy(tiny_models["llama"], p, TOKENS)[:TOKENS], f"r{i}"
        assert r.text == src.tokenizer.decode(r.token_ids, skip_special_tokens=True)
    assert_no_kv_left(src, dst)


def test_a_seeded_sampled_request_gives_the_same_output_migrated_or_not(tiny_models, tiny_draft_models) -> None:
    prompts = text_prompts(load(tiny_models["llama"]), 2, offset=5)
    alone = generate(engine(tiny_models, tiny_draft_models), prompts, SAMPLED)

    outcome, results = run_migration(engine(tiny_models, tiny_draft_models), engine(tiny_models, tiny_draft_models),
                                     SAMPLED, prompts)

    assert outcome.status is MigrationStatus.FINISHED
    assert [results[f"r{i}"].token_ids for i in range(2)] == [c.token_ids for c in alone]


@pytest.mark.parametrize("fail_on", ["import", "import_draft", "commit"])
def test_a_destination_that_fails_leaves_the_request_running_at_the_source(tiny_models, tiny_draft_models,
                                                                          fail_on) -> None:
    src, dst = engine(tiny_models, tiny_draft_models), engine(tiny_models, tiny_draft_models)
    prompts = text_prompts(src.target.model, 2, offset=2)

    outcome, results = run_migration(src, dst, GREEDY, prompts, fail_on=fail_on)

    assert outcome.status is MigrationStatus.ABORTED_DST, outcome
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == reference_greedy(tiny_models["llama"], p, TOKENS)
    assert_no_kv_left(src, dst)


def test_a_source_that_dies_before_its_release_leaves_no_second_copy(tiny_models, tiny_draft_models) -> None:
    """Committed at the destination, the source dies before it lets go: the client's stream fails over from its own
    tokens, so the committed copy is cancelled (it would run twice) and holds no KV."""
    src, dst = engine(tiny_models, tiny_draft_models), engine(tiny_models, tiny_draft_models)
    prompts = text_prompts(src.target.model, 1, offset=2)
    results = started(src, prompts)
    a, b = EngineEndpoint(src, results, steps=1, fail_on="release"), EngineEndpoint(dst, results)

    outcome = asyncio.run(migrate("r0", a, b, MigrationConfig(max_stages=3, stop_copy_tokens=2)))

    assert outcome.status is MigrationStatus.ABORTED_SRC and "before its release" in outcome.reason, outcome
    assert not EngineMigration(dst).holds("r0") and not dst.has_unfinished()
    assert dst.target.cache.num_used_blocks == 0 and dst.draft.cache.num_used_blocks == 0


def test_a_destination_without_room_refuses(tiny_models, tiny_draft_models) -> None:
    src, dst = engine(tiny_models, tiny_draft_models), engine(tiny_models, tiny_draft_models, num_blocks=3)
    prompts = text_prompts(src.target.model, 1, offset=2)

    outcome, results = run_migration(src, dst, GREEDY, prompts)

    assert outcome.status is MigrationStatus.ABORTED_DST and "no room" in outcome.reason
    assert results["r0"].token_ids == reference_greedy(tiny_models["llama"], prompts[0], TOKENS)
    assert_no_kv_left(src, dst)


def test_a_request_that_ends_at_the_source_first_aborts_the_migration(tiny_models, tiny_draft_models) -> None:
    src, dst = engine(tiny_models, tiny_draft_models), engine(tiny_models, tiny_draft_models)
    prompts = text_prompts(src.target.model, 1, offset=2)
    short = GREEDY.model_copy(update={"max_tokens": 6})

    outcome, results = run_migration(src, dst, short, prompts, steps_before=1, src_steps=10,
                                     cfg=MigrationConfig(max_stages=4, stop_copy_tokens=0))

    assert outcome.status is MigrationStatus.ABORTED_SRC and "ended at the source" in outcome.reason
    assert results["r0"].token_ids == reference_greedy(tiny_models["llama"], prompts[0], 6)
    assert_no_kv_left(src, dst)


def test_a_queued_request_moves_without_kv_and_starts_at_the_destination(tiny_models, tiny_draft_models) -> None:
    """The `queue` policy's move: a request still waiting at the source (batch full) holds no KV; it migrates by
    the same handshake and commit, starts at the destination, and gives the target's own output."""
    src, dst = engine(tiny_models, tiny_draft_models), engine(tiny_models, tiny_draft_models)
    prompts = text_prompts(src.target.model, 6, offset=1)
    results = started(src, prompts, steps=2)
    queued = [r.request_id for r in src.load("src").waiting]
    assert queued == ["r4", "r5"] and EngineMigration(src).kv_length("r5") == 0  # max_batch_size 4

    outcome = asyncio.run(migrate("r5", EngineEndpoint(src, results, steps=1), EngineEndpoint(dst, results)))

    assert outcome.status is MigrationStatus.FINISHED and outcome.tokens_copied == 0, outcome
    assert not EngineMigration(src).holds("r5") and [s.request_id for s in dst.running + dst.waiting] == ["r5"]
    finish_and_check(src, dst, results, prompts, tiny_models["llama"])


@pytest.mark.parametrize("why", ["source dies", "not there"])
def test_a_source_that_cannot_say_where_the_request_stands_aborts_before_anything_is_reserved(
        tiny_models, tiny_draft_models, why) -> None:
    src, dst = engine(tiny_models, tiny_draft_models), engine(tiny_models, tiny_draft_models)
    prompt = text_prompts(src.target.model, 1, offset=2)[0]
    results = started(src, [prompt], steps=2)
    a = EngineEndpoint(src, results, fail_on="length" if why == "source dies" else "")

    outcome = asyncio.run(migrate("r0" if why == "source dies" else "elsewhere", a, EngineEndpoint(dst, results)))

    assert outcome.status is MigrationStatus.ABORTED_SRC
    assert outcome.reason.startswith("source: ConnectionError") if why == "source dies" else \
        outcome.reason == "the request does not run at the source"
    assert dst.target.cache.num_used_blocks == 0 and not EngineMigration(dst).holds("r0")
    drain(src, results)
    assert results["r0"].token_ids == reference_greedy(tiny_models["llama"], prompt, TOKENS)
    assert_no_kv_left(src, dst)


def test_failover_resumes_from_the_tokens_alone(tiny_models, tiny_draft_models) -> None:
    """No KV and no engine state: the prompt and the tokens streamed so far (KV recomputed) give the same output."""
    src, dst = engine(tiny_models, tiny_draft_models), engine(tiny_models, tiny_draft_models)
    prompt = text_prompts(src.target.model, 1, offset=3)[0]
    src.add_request(Request("r", tuple(prompt), GREEDY))
    before = drain(src, steps=4)["r"]
    assert 0 < len(before.token_ids) < TOKENS

    dst.add_request(Request("r", tuple(prompt), GREEDY, resume=Resume(tuple(before.token_ids), len(before.text))))
    after = drain(dst)["r"]

    assert before.token_ids + after.token_ids == reference_greedy(tiny_models["llama"], prompt, TOKENS)
    assert before.text + after.text == dst.tokenizer.decode(before.token_ids + after.token_ids,
                                                            skip_special_tokens=True)


def test_the_engine_reports_its_load_per_request_for_the_policies(tiny_models, tiny_draft_models) -> None:
    """Engine.load: each running request's target blocks, queued demand head of line first, and the capacity."""
    e = engine(tiny_models, tiny_draft_models, num_blocks=64)
    prompts = text_prompts(e.target.model, 6, offset=1)
    for i, p in enumerate(prompts):
        e.add_request(Request(f"q{i}", tuple(p), GREEDY, priority=1 if i == 5 else 0))
    drain(e, steps=3)
    load_ = e.load("me")
    cache = e.target.cache
    assert load_.instance_id == "me" and load_.capacity_blocks == cache.num_used_blocks + cache.num_free_blocks
    assert {r.request_id: r.blocks for r in load_.running} == {
        s.request_id: -(-EngineMigration(e).kv_length(s.request_id) // cache.block_size) for s in e.running}
    assert len(load_.running) == 4 and len(load_.waiting_blocks) == 2 and load_.max_running == 4  # max_batch_size
    assert all(b >= 1 for b in load_.waiting_blocks)
    assert {r.request_id for r in load_.waiting} == {s.request_id for s in e.waiting}
    for r, s in zip(load_.waiting, sorted(e.waiting, key=lambda s: s.order_key())):  # peak: prompt + max_tokens
        assert r.max_blocks == -(-(len(s.request.prompt_token_ids) + TOKENS) // cache.block_size)
    assert next(r for r in load_.running if r.request_id == "q5").priority == 1  # the high-priority one runs


def test_a_stage_copies_in_chunks_between_the_sources_steps(tiny_models, tiny_draft_models) -> None:
    """Each export asks for at most `chunk_tokens`, the chunks tile the KV with no gap or overlap, and the source
    steps between them (it keeps decoding while a long prefix is copied)."""
    src, dst = engine(tiny_models, tiny_draft_models), engine(tiny_models, tiny_draft_models)
    prompt = text_prompts(src.target.model, 1, offset=4)[0]
    results = started(src, [prompt], SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True), steps=2)
    a, b = EngineEndpoint(src, results, steps=1), EngineEndpoint(dst, results)
    cfg = MigrationConfig(max_stages=2, stop_copy_tokens=1, chunk_tokens=8)

    outcome = asyncio.run(migrate("r0", a, b, cfg))
    drain(dst, results)

    assert outcome.status is MigrationStatus.FINISHED and outcome.stages >= 1, outcome
    assert len(a.exports) >= len(prompt) // 8 and all(0 < e - s <= 8 for s, e in a.exports), a.exports
    assert [s for s, _ in a.exports[1:]] == [e for _, e in a.exports[:-1]]  # contiguous: no gap, no overlap
    assert results["r0"].token_ids == reference_greedy(tiny_models["llama"], prompt, 96)
    assert_no_kv_left(src, dst)


@pytest.mark.parametrize("when", ["during a copy", "just before the stop"])
def test_a_request_preempted_while_it_migrates_stays_and_finishes_at_the_source(tiny_models, tiny_draft_models,
                                                                                 when) -> None:
    """Preemption frees the KV already copied: the stop must not take the request (it would be lost), the migration
    aborts at the source, and the request recomputes and finishes there; no block leaks on either side."""
    src, dst = engine(tiny_models, tiny_draft_models), engine(tiny_models, tiny_draft_models)
    prompts = text_prompts(src.target.model, 2, offset=5)
    results = started(src, prompts, SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True))
    a, b = EngineEndpoint(src, results, steps=1), EngineEndpoint(dst, results)
    exports_seen = []

    def preempt() -> None:
        src.scheduler.preempt(next(s for s in src.running if s.request_id == "r0"))

    def preempt_at_the_second_copy() -> None:
        exports_seen.append(1)
        if len(exports_seen) == 2:
            preempt()
    if when == "during a copy":
        a.between_steps = preempt_at_the_second_copy
    else:
        a.before_stop = preempt

    outcome = asyncio.run(migrate("r0", a, b, MigrationConfig(max_stages=1, stop_copy_tokens=0, chunk_tokens=16)))
    drain(src, results)

    assert outcome.status is MigrationStatus.ABORTED_SRC and outcome.stages == (when != "during a copy"), outcome
    assert EngineMigration(src).holds("r0") is False and not a.detached  # it ran to its end at the source, never out
    for i, p in enumerate(prompts):
        assert results[f"r{i}"].token_ids == reference_greedy(tiny_models["llama"], p, 96), f"r{i}"
    assert_no_kv_left(src, dst)


@pytest.mark.parametrize("draft_kv", ["move", "rebuild"])
def test_the_draft_kv_moves_as_it_stood_or_is_rebuilt_at_the_destination(tiny_models, tiny_draft_models,
                                                                         draft_kv) -> None:
    src, dst = engine(tiny_models, tiny_draft_models), engine(tiny_models, tiny_draft_models)
    prompts = text_prompts(src.target.model, 2, offset=4)
    results = started(src, prompts, steps=4)
    a, b = EngineEndpoint(src, results, steps=1), EngineEndpoint(dst, results)
    sent = []
    a.before_stop = lambda: sent.append(draft_kv_at(src))  # the source's draft KV, as copied

    outcome = asyncio.run(migrate("r0", a, b, MigrationConfig(max_stages=2, stop_copy_tokens=2, draft_kv=draft_kv)))

    assert outcome.status is MigrationStatus.FINISHED, outcome
    if draft_kv == "move":  # the destination's draft holds exactly what the source's held: it catches up from there
        [want] = sent
        got = draft_kv_at(dst)
        assert outcome.draft_tokens == b.draft_imports[-1] == want[0].end == got[0].end > len(prompts[0])
        assert all(torch.equal(x.k, y.k) and torch.equal(x.v, y.v) for x, y in zip(got, want))
    else:
        assert outcome.draft_tokens == 0 and b.draft_imports == [] and not dst.draft.cache.has("r0")
    finish_and_check(src, dst, results, prompts, tiny_models["llama"])


def test_the_draft_kv_moves_in_chunks_between_the_sources_steps(tiny_models, tiny_draft_models) -> None:
    """In chunks of 8 tokens, the source stepping before each: the destination's draft KV is the source's prefix, as
    the source held it, and the output is the target's own."""
    src, dst = engine(tiny_models, tiny_draft_models), engine(tiny_models, tiny_draft_models)
    prompts = text_prompts(src.target.model, 2, offset=4)
    long = GREEDY.model_copy(update={"max_tokens": 96})
    results = started(src, prompts, long, steps=4)
    a, b = EngineEndpoint(src, results), EngineEndpoint(dst, results)
    a.draft_steps = 1
    sent = []
    a.before_stop = lambda: sent.append(draft_kv_at(src))

    outcome = asyncio.run(migrate("r0", a, b, MigrationConfig(max_stages=2, stop_copy_tokens=2, chunk_tokens=8)))

    assert outcome.status is MigrationStatus.FINISHED, outcome
    assert len(b.draft_imports) >= 3 and outcome.draft_tokens == b.draft_imports[-1] > 16, (b.draft_imports, outcome)
    [want], [got] = sent[0], draft_kv_at(dst)
    assert got.end == outcome.draft_tokens <= want.end
    assert torch.equal(got.k, want.k[:, :got.end]) and torch.equal(got.v, want.v[:, :got.end])
    finish_and_check(src, dst, results, prompts, tiny_models["llama"], 96)


class KeptKV:
    """An executor whose KV cannot move, as an EasySpec draft group's (actors/executors/remote.py GroupStages): the core
    executor protocol of in-process stages (actors/executors/protocol.py), and no ExportsKV."""

    replicated_cache = True

    def __init__(self, stage: ModelRunner) -> None:
        self.stages = LocalStages([stage])
        self.layer_ids = self.stages.layer_ids

    def run(self, ops, chunks, parallel=False):
        return self.stages.run(ops, chunks, parallel)

    def cache_usage(self, ops):
        return self.stages.cache_usage(ops)

    def kill(self, stages=None):
        self.stages.kill(stages)


@pytest.mark.parametrize("side", ["source", "destination"])
def test_a_draft_whose_kv_cannot_move_is_rebuilt(tiny_models, tiny_draft_models, side) -> None:
    """An EasySpec group's draft KV is spread over its members (its executor exports none): the migration still
    finishes, the destination's draft catching up, where it used to fail on the draft's export or import."""
    draft = runner(load(tiny_draft_models["llama"]))
    kept = Engine(runner(load(tiny_models["llama"])), PipelineRunner(draft.model, CACHE, KeptKV(draft)),
                  SpeculationConfig(policy="fixed", k=3), SchedulerConfig(max_batch_size=4))
    assert not kept.draft.exports_kv
    other = engine(tiny_models, tiny_draft_models)
    src, dst = (kept, other) if side == "source" else (other, kept)
    prompts = text_prompts(src.target.model, 1, offset=3)

    outcome, results = run_migration(src, dst, GREEDY, prompts)

    assert outcome.status is MigrationStatus.FINISHED and outcome.draft_tokens == 0, outcome
    assert results["r0"].token_ids == reference_greedy(tiny_models["llama"], prompts[0], TOKENS)
    assert_no_kv_left(src, dst)


def test_a_destination_without_draft_room_rebuilds_the_draft_kv(tiny_models, tiny_draft_models) -> None:
    src = engine(tiny_models, tiny_draft_models)
    dst = Engine(runner(load(tiny_models["llama"])), runner(load(tiny_draft_models["llama"]), num_blocks=2),
                 SpeculationConfig(policy="fixed", k=3), SchedulerConfig(max_batch_size=4))
    prompts = text_prompts(src.target.model, 1, offset=6)

    outcome, results = run_migration(src, dst, GREEDY, prompts)

    assert outcome.status is MigrationStatus.FINISHED and outcome.draft_tokens == 0, outcome
    assert results["r0"].token_ids == reference_greedy(tiny_models["llama"], prompts[0], TOKENS)
