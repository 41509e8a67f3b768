"""Coalescing a request's stream: consecutive StreamItems merged into one, so a stream carries fewer, larger items.

Every engine step hands each running request one TokenDelta (actors/serving/loop.py), and each crosses Ray as its own
streaming item (instance actor -> API replica) and then as its own SSE event or gRPC message. Items that wait to be
sent (a consumer behind the engine) are merged here, as vLLM and SGLang buffer a request's output (their
`stream_interval`): tokens, text and per-token logprobs are concatenated in order, so what a client assembles is the
same; only the number of chunks changes. `Coalescer` adds the buffer: an item is held back until it carries at least
`interval` tokens, except a stream's first tokens (time to first token is never delayed), its final item and anything
before a hand-over to another instance (a migration's `migrated_to` item, never merged).
"""

from __future__ import annotations

import asyncio
import dataclasses

from cluster.request import StreamItem, TokenDelta


def mergeable(a: StreamItem, b: StreamItem) -> bool:
    """Whether `b`, the item after `a` in the same stream, can ride on `a`: `a` is not the stream's last (a finish,
    a rejection, a hand-over), `b` is no hand-over, and both or neither carry logprobs."""
    return (not a.delta.finished and a.migrated_to is None and b.migrated_to is None and not a.rejected
            and b.delta.error is None and not b.rejected
            and a.delta.request_id == b.delta.request_id
            and (a.delta.logprobs is None) == (b.delta.logprobs is None))


def merge(a: StreamItem, b: StreamItem) -> StreamItem:
    """`a` then `b` as one item (`mergeable(a, b)` must hold): b's end, stats and rejection; a's queue time first."""
    da, db = a.delta, b.delta
    logprobs = None if da.logprobs is None else da.logprobs + db.logprobs
    delta = TokenDelta(da.request_id, da.token_ids + db.token_ids, da.text + db.text, db.finish_reason, db.error,
                       db.instance_failure, logprobs,
                       da.prompt_logprobs if da.prompt_logprobs is not None else db.prompt_logprobs)
    return dataclasses.replace(b, delta=delta, queue_s=a.queue_s if a.queue_s is not None else b.queue_s)


def coalesce(items: list[StreamItem]) -> list[StreamItem]:
    """Consecutive items of one stream, each run of mergeable ones merged into one (order kept)."""
    out: list[StreamItem] = []
    for item in items:
        if out and mergeable(out[-1], item):
            out[-1] = merge(out[-1], item)
        else:
            out.append(item)
    return out


def coalesce_choices(items: list[tuple[int, StreamItem]]) -> list[tuple[int, StreamItem]]:
    """(choice index, item) pairs of several streams, each choice's run merged (`coalesce`); a choice's order kept."""
    by_choice: dict[int, list[StreamItem]] = {}
    for index, item in items:
        by_choice.setdefault(index, []).append(item)
    return [(index, item) for index, choice in by_choice.items() for item in coalesce(choice)]


def waiting(queue: asyncio.Queue) -> list:
    """Everything `queue` holds now, taken out without waiting."""
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


def ends_stream(item: StreamItem) -> bool:
    """The last item of a stream at this instance: a finish (done, aborted, failed) or a hand-over."""
    return item.delta.finished or item.migrated_to is not None


class Coalescer:
    """Reads a request's items from `queue` and hands them out merged: whatever is waiting is merged into one item,
    and with `interval` > 1 an item with fewer tokens is held until more come (never the first tokens, a last item or
    what precedes a hand-over). `next()` returns the next item to send."""

    def __init__(self, queue: asyncio.Queue[StreamItem], interval: int = 1) -> None:
        self.queue = queue
        self.interval = interval
        self._held: StreamItem | None = None  # merged, not yet sent
        self._next: StreamItem | None = None  # read, but could not be merged into what is held
        self._sent_tokens = False

    async def next(self) -> StreamItem:
        while True:
            held = self._held
            if held is None:
                held = self._next or await self.queue.get()
                self._next = None
            while self._next is None and not ends_stream(held) and not self.queue.empty():
                item = self.queue.get_nowait()
                if mergeable(held, item):
                    held = merge(held, item)
                else:
                    self._next = item
            if (self._next is not None or ends_stream(held) or not self._sent_tokens
                    or len(held.delta.token_ids) >= self.interval):
                self._held = None
                self._sent_tokens |= bool(held.delta.token_ids)
                return held
            self._held = held  # too few tokens yet: wait for the next item
            self._next = await self.queue.get()
            if mergeable(held, self._next):
                self._held, self._next = merge(held, self._next), None
