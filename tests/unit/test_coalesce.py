"""Coalescing a request's stream items (cluster/coalesce.py): what a client assembles is unchanged, chunks are fewer."""

from __future__ import annotations

import asyncio

import pytest

from cluster.coalesce import Coalescer, coalesce, coalesce_choices, merge, mergeable
from cluster.request import FinishReason, SpecStats, StreamItem, TokenDelta, TokenLogprob


def item(tokens: tuple[int, ...], text: str, finish: FinishReason | None = None, rid: str = "r", logprobs=False,
         **kw) -> StreamItem:
    lp = tuple(TokenLogprob(t, -0.1 * t, ((t, -0.1 * t),)) for t in tokens) if logprobs else None
    return StreamItem(TokenDelta(rid, tokens, text, finish, logprobs=lp), **kw)


def assembled(items: list[StreamItem]) -> tuple:
    """What a client builds from a stream: tokens, text, logprobs, its end, its stats, its first queue time."""
    return (sum((i.delta.token_ids for i in items), ()), "".join(i.delta.text for i in items),
            sum((i.delta.logprobs or () for i in items), ()), items[-1].delta.finish_reason, items[-1].stats,
            next((i.queue_s for i in items if i.queue_s is not None), None))


def stream(n: int, logprobs: bool = False) -> list[StreamItem]:
    out = [item((i,), f"t{i} ", logprobs=logprobs, queue_s=0.25 if i == 0 else None) for i in range(n)]
    out.append(item((n,), "end", FinishReason.LENGTH, logprobs=logprobs, stats=SpecStats(proposed=3, accepted=2)))
    return out


@pytest.mark.parametrize("logprobs", [False, True])
def test_a_coalesced_stream_assembles_to_the_same_output(logprobs: bool) -> None:
    items = stream(6, logprobs)
    merged = coalesce(items)
    assert len(merged) == 1
    assert assembled(merged) == assembled(items)
    assert merged[0].delta.logprobs == (tuple(i.delta.logprobs[0] for i in items) if logprobs else None)


def test_the_prompts_logprobs_stay_with_the_first_delta() -> None:
    first = StreamItem(TokenDelta("r", (1,), "a", prompt_logprobs=(None, TokenLogprob(7, -1.0))))
    assert merge(first, item((2,), "b")).delta.prompt_logprobs == first.delta.prompt_logprobs


def test_ends_and_hand_overs_and_errors_are_never_merged_across() -> None:
    hand_over = StreamItem(TokenDelta("r", (), ""), migrated_to=("inst-1", None))
    err = StreamItem(TokenDelta("r", (), "", FinishReason.ERROR, error="lost a shard", instance_failure=True))
    assert not mergeable(item((1,), "a", FinishReason.STOP), item((2,), "b"))
    assert not mergeable(item((1,), "a"), hand_over)
    assert not mergeable(hand_over, item((1,), "a"))
    assert not mergeable(item((1,), "a"), err)  # the tokens' chunk comes before the error's
    assert not mergeable(item((1,), "a"), item((2,), "b", rid="other"))
    assert not mergeable(item((1,), "a"), item((2,), "b", logprobs=True))
    out = coalesce([item((1,), "a"), item((2,), "b"), hand_over])
    assert [len(i.delta.token_ids) for i in out] == [2, 0] and out[1].migrated_to == ("inst-1", None)


def test_choices_are_merged_each_on_its_own_in_order() -> None:
    pairs = [(0, item((1,), "a", rid="c0")), (1, item((5,), "x", rid="c1")), (0, item((2,), "b", rid="c0")),
             (1, item((6,), "y", FinishReason.STOP, rid="c1")), (0, item((3,), "c", rid="c0"))]
    out = coalesce_choices(pairs)
    assert [(i, it.delta.token_ids, it.delta.text) for i, it in out] == [(0, (1, 2, 3), "abc"), (1, (5, 6), "xy")]
    assert out[1][1].delta.finish_reason is FinishReason.STOP


async def _drain(coalescer: Coalescer, q: asyncio.Queue, feed: list[StreamItem], pause: int | None) -> list:
    """Feed `feed` one item per loop turn (a step each), read with `coalescer` until the stream ends."""
    async def producer() -> None:
        for it in feed:
            q.put_nowait(it)
            for _ in range(pause or 0):
                await asyncio.sleep(0)

    task = asyncio.create_task(producer())
    out = []
    while not out or not (out[-1].delta.finished or out[-1].migrated_to is not None):
        out.append(await asyncio.wait_for(coalescer.next(), 5))
    await task
    return out


@pytest.mark.parametrize("interval", [1, 3, 4])
def test_an_interval_holds_tokens_but_never_the_first_or_the_last(interval: int) -> None:
    items = stream(9)  # 10 items of one token each, the last a finish
    q: asyncio.Queue = asyncio.Queue()
    out = asyncio.run(_drain(Coalescer(q, interval), q, items, pause=3))  # the reader keeps up: nothing waits
    assert assembled(out) == assembled(items)
    sizes = [len(i.delta.token_ids) for i in out]
    assert sizes[0] == 1  # the first token goes at once
    assert all(s == interval for s in sizes[1:-1])  # the ones between carry `interval` tokens each
    assert 1 <= sizes[-1] <= interval and out[-1].delta.finished


def test_whatever_waits_goes_as_one_item() -> None:
    items = stream(7)
    q: asyncio.Queue = asyncio.Queue()
    for it in items:  # the reader fell behind: everything is already there
        q.put_nowait(it)
    out = asyncio.run(_drain(Coalescer(q, 1), q, [], pause=None))
    assert len(out) == 1 and assembled(out) == assembled(items)


def test_a_held_item_goes_out_before_a_hand_over() -> None:
    hand_over = StreamItem(TokenDelta("r", (), ""), migrated_to=("inst-1", None))
    feed = [item((1,), "a"), item((2,), "b"), hand_over]
    q: asyncio.Queue = asyncio.Queue()
    out = asyncio.run(_drain(Coalescer(q, 8), q, feed, pause=3))
    assert [i.delta.token_ids for i in out] == [(1,), (2,), ()] and out[-1].migrated_to is not None
