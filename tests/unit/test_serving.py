"""The serving loop: requests submitted from other threads while the engine steps, deltas to per-request sinks."""

from __future__ import annotations

import threading
import time

import pytest

from actors.engine.core import RequestError
from actors.engine.migration import EngineMigration
from actors.serving.loop import ServingLoop, StepBarrier
from cluster.request import FinishReason, Request, RequestStatus, SamplingParams, StreamItem
from tests.unit.helpers import load, reference_greedy, text_prompts
from tests.unit.test_scheduler import engine_for


class Collector:
    """A sink per request, gathering its items; `wait` blocks until the request's final item."""

    def __init__(self) -> None:
        self.items: dict[str, list[StreamItem]] = {}
        self.done: dict[str, threading.Event] = {}

    def sink(self, rid: str):
        self.items[rid], self.done[rid] = [], threading.Event()

        def put(item: StreamItem) -> None:
            assert not self.done[rid].is_set(), f"{rid} got an item after its final one"
            self.items[rid].append(item)
            if item.delta.finished:
                self.done[rid].set()
        return put

    def wait(self, rid: str, timeout: float = 60.0) -> list[StreamItem]:
        assert self.done[rid].wait(timeout), f"{rid} did not finish"
        return self.items[rid]


def greedy(n: int, ignore_eos: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=ignore_eos)


def test_requests_arriving_while_it_steps_get_the_targets_greedy_output(tiny_models, tiny_draft_models) -> None:
    engine = engine_for(tiny_models["llama"], tiny_draft_models["llama"], k=3)
    loop, got = ServingLoop(engine), Collector()
    prompts = text_prompts(load(tiny_models["llama"]), 5, offset=2)
    try:
        for i, p in enumerate(prompts):  # staggered: later ones join a running batch
            loop.submit(Request(f"r{i}", tuple(p), greedy(20)), got.sink(f"r{i}")).result(30)
            time.sleep(0.01 * i)
        for i, p in enumerate(prompts):
            items = got.wait(f"r{i}")
            assert [t for it in items for t in it.delta.token_ids] == reference_greedy(tiny_models["llama"], p, 20)
            assert sum(it.queue_s is not None for it in items) == 1 and items[0].queue_s >= 0
            assert items[-1].stats is not None and items[-1].stats.proposed > 0
            assert all(it.stats is None for it in items[:-1])
    finally:
        loop.close()
    assert engine.target.cache.num_used_blocks == 0 and engine.draft.cache.num_used_blocks == 0


def test_abort_ends_the_stream_and_frees_kv_and_bad_requests_fail_their_future(tiny_models, tiny_draft_models) -> None:
    engine = engine_for(tiny_models["llama"], tiny_draft_models["llama"], k=3)
    loop, got = ServingLoop(engine), Collector()
    prompt = tuple(text_prompts(load(tiny_models["llama"]), 1)[0])
    try:
        with pytest.raises(RequestError, match="empty"):
            loop.submit(Request("bad", (), greedy(4)), got.sink("bad")).result(30)
        loop.submit(Request("long", prompt, greedy(200, ignore_eos=True)), got.sink("long")).result(30)
        while not got.items["long"]:
            time.sleep(0.01)
        assert loop.abort("long").result(30) is True
        items = got.wait("long")
        assert items[-1].delta.finish_reason == FinishReason.ABORT
        assert len([t for it in items for t in it.delta.token_ids]) < 200
        assert loop.abort("long").result(30) is False  # already gone
        assert engine.target.cache.num_used_blocks == 0 and engine.draft.cache.num_used_blocks == 0
        # closing ends what is still in flight
        loop.submit(Request("open", prompt, greedy(200, ignore_eos=True)), got.sink("open")).result(30)
    finally:
        loop.close()
    assert got.wait("open")[-1].delta.finish_reason == FinishReason.ABORT
    with pytest.raises(RuntimeError, match="stopped"):
        loop.submit(Request("late", prompt, greedy(4)), got.sink("late")).result(1)


def test_an_engine_failure_ends_every_request_with_an_error_and_marks_the_loop_dead(tiny_models) -> None:
    engine = engine_for(tiny_models["llama"], None, policy="off")
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("shard lost")
        return engine.step()

    loop, got = ServingLoop(engine, step=failing_step), Collector()
    prompt = tuple(text_prompts(load(tiny_models["llama"]), 1)[0])
    loop.submit(Request("r", prompt, greedy(100, ignore_eos=True)), got.sink("r")).result(30)
    final = got.wait("r")[-1].delta
    assert final.finish_reason == FinishReason.ERROR and "shard lost" in final.error
    loop._thread.join(10)
    assert not loop.alive and isinstance(loop.error, RuntimeError)


def test_states_report_held_requests_as_running_and_ended_ones_with_their_status(tiny_models, tiny_draft_models) -> None:
    engine = engine_for(tiny_models["llama"], tiny_draft_models["llama"], k=3)
    loop, got = ServingLoop(engine), Collector()
    prompt = tuple(text_prompts(load(tiny_models["llama"]), 1)[0])
    try:
        with pytest.raises(RequestError):
            loop.submit(Request("bad", (), greedy(4)), got.sink("bad")).result(30)
        loop.submit(Request("short", prompt, greedy(3, ignore_eos=True)), got.sink("short")).result(30)
        loop.submit(Request("long", prompt, greedy(200, ignore_eos=True)), got.sink("long")).result(30)
        assert loop.states(["long", "never"]) == {"long": RequestStatus.RUNNING}
        got.wait("short")
        assert loop.abort("long").result(30) is True
        got.wait("long")
        assert loop.states(["bad", "short", "long", "never"]) == {
            "bad": RequestStatus.FAILED, "short": RequestStatus.FINISHED, "long": RequestStatus.ABORTED}
    finally:
        loop.close()


def held_after_two_steps(tiny_models, max_tokens: int):
    """A loop (no speculation) serving request "r" of `max_tokens` greedy tokens, held by its barrier after step 2
    (a prompt that fits one step: one token a step): the engine, barrier, loop, collector and prompt."""
    engine = engine_for(tiny_models["llama"], None, policy="off")
    barrier = StepBarrier(after=2, timeout_s=30)
    loop, got = ServingLoop(engine, between_steps=barrier), Collector()
    prompt = tuple(text_prompts(load(tiny_models["llama"]), 1)[0])
    try:
        loop.submit(Request("r", prompt, greedy(max_tokens, ignore_eos=True)), got.sink("r")).result(30)
        assert barrier.reached.wait(30)
    except BaseException:
        loop.close()
        raise
    return engine, barrier, loop, got, prompt


def test_a_step_barrier_places_an_abort_between_two_chosen_steps(tiny_models) -> None:
    """Held after its second step, the loop applies an abort posted meanwhile before its third: the stream has the
    two steps' tokens (no speculation, a prompt that fits one step: one token each), then the abort, nothing else."""
    engine, barrier, loop, got, prompt = held_after_two_steps(tiny_models, 50)
    try:
        aborted = loop.abort("r")  # posted while the loop is held between steps 2 and 3
        barrier.release()
        assert aborted.result(30) is True
        items = got.wait("r")
    finally:
        loop.close()
    assert [t for it in items for t in it.delta.token_ids] == reference_greedy(tiny_models["llama"], prompt, 2)
    assert [it.delta.finish_reason for it in items] == [None, None, FinishReason.ABORT]
    assert barrier.steps == 2 and engine.target.cache.num_used_blocks == 0


def test_a_paused_loop_takes_no_step_but_applies_commands_until_resumed_or_its_deadline(tiny_models) -> None:
    """Paused between steps 2 and 3, the stream holds its two tokens while calls still run; resumed, it finishes with
    the target's output. A pause nobody ends lasts only its deadline."""
    engine, barrier, loop, got, prompt = held_after_two_steps(tiny_models, 12)
    try:
        paused = loop.pause(60.0)  # applied before step 3
        barrier.release()
        paused.result(30)
        assert loop.paused
        steps = engine.stats().step.num_steps
        held = loop.call(lambda: EngineMigration(engine).kv_length("r")).result(30)  # commands still run
        assert held == len(prompt) + 1
        time.sleep(0.5)
        assert engine.stats().step.num_steps == steps == 2 and not got.done["r"].is_set()
        loop.resume().result(30)
        items = got.wait("r")
        assert [t for it in items for t in it.delta.token_ids] == reference_greedy(tiny_models["llama"], prompt, 12)

        t0 = time.monotonic()
        loop.pause(0.5).result(30)  # its deadline ends it
        loop.submit(Request("s", prompt, greedy(4, ignore_eos=True)), got.sink("s")).result(30)
        assert [t for it in got.wait("s", timeout=30) for t in it.delta.token_ids] == \
            reference_greedy(tiny_models["llama"], prompt, 4)
        assert time.monotonic() - t0 >= 0.5 and not loop.paused
    finally:
        loop.close()
