"""The serving loop: an engine's step() on its own thread, with requests coming in and deltas going out between steps.

This is continuous batching as a server needs it: `submit` and `abort` may be called from any thread (the Ray
actor's event loop, in actors/instance_server.py); the loop applies them before the next step, runs the step,
and hands each request's delta to that request's sink. The engine is only ever touched by the loop thread,
so it needs no locks. The loop sleeps while there is no work and wakes when a request arrives.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

from actors.sequence import Sequence, SeqStatus
from cluster.request import FinishReason, Request, RequestStatus, SpecStats, TokenDelta


@dataclass(frozen=True)
class StreamItem:
    """One message of a request's stream: a delta, and on the last one the request's stats and timings."""

    delta: TokenDelta
    stats: SpecStats | None = None  # set on the final item
    queue_s: float | None = None  # from submission to first being scheduled; set on the first item that has it
    rejected: bool = False  # the engine refused the request (delta.error says why); nothing was generated
    # the request moved to another instance (live migration): (instance id, its actor handle) to follow; the
    # stream ends here without a finish, and the destination's `resume_stream` carries on from the next token
    migrated_to: tuple[str, object] | None = None


Sink = Callable[[StreamItem], None]


class Steppable(Protocol):
    """What the loop drives: an Instance (actors/instance.py) or a bare Engine (actors/engine.py)."""

    waiting: list[Sequence]
    running: list[Sequence]

    def add_request(self, request: Request) -> None: ...
    def abort(self, request_id: str) -> TokenDelta | None: ...
    def step(self) -> list[TokenDelta]: ...
    def has_unfinished(self) -> bool: ...
log = logging.getLogger(__name__)
KEEP_ENDED = 4096  # ended requests remembered for `states` (the router asks about its own within a poll or two)


@dataclass
class _Tracked:
    sink: Sink
    submitted_at: float
    scheduled_at: float | None = None
    queue_reported: bool = False
    stats: SpecStats = field(default_factory=SpecStats)


class ServingLoop:
    """Runs `step` (the engine's own by default) repeatedly on a daemon thread while the engine has work."""

    def __init__(self, engine: Steppable, step: Callable[[], list[TokenDelta]] | None = None,
                 name: str = "engine-loop") -> None:
        self.engine = engine
        self._step = step or engine.step
        self._inbox: queue.SimpleQueue[tuple[str, object, Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._ended: OrderedDict[str, RequestStatus] = OrderedDict()  # newest last, at most KEEP_ENDED
        self.error: BaseException | None = None  # an unexpected exception that stopped the loop
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- called from other threads --------------------------------------------------------------
    def submit(self, request: Request, sink: Sink) -> Future:
        """Queue `request`; the future resolves once the engine took it (or carries its RequestError)."""
        return self._post("add", (request, sink))

    def abort(self, request_id: str) -> Future:
        """Cancel a request; the future resolves to whether it was in flight. Its sink gets a final ABORT item."""
        return self._post("abort", request_id)

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the loop thread between two steps (it may use the engine); the future has its result."""
        return self._post("call", fn)

    def hand_over(self, request_id: str, destination: tuple[str, object]) -> Future:
        """A request left for another instance (migration): its stream ends with a `migrated_to` item, and the loop
        forgets it (it is neither running nor ended here)."""
        return self._post("hand_over", (request_id, destination))

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the loop; requests in flight end with an ABORT item."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def states(self, request_ids: Iterable[str]) -> dict[str, RequestStatus]:
        """What this loop knows of each request: RUNNING while it holds it (queued or running), its final status
        once it ended; ids it never took (or ended too long ago) are left out. Safe from any thread: a request
        is recorded as ended before it stops being tracked, and lookups are read in that opposite order."""
        out = {}
        for rid in request_ids:
            if rid in self._tracked:
                out[rid] = RequestStatus.RUNNING
            elif (status := self._ended.get(rid)) is not None:
                out[rid] = status
        return out

    def tracks(self, request_id: str) -> bool:
        """Whether a request's stream is still open here (loop thread: inside `call`)."""
        return request_id in self._tracked

    def tracked_ids(self) -> list[str]:
        """Every request whose stream is open here (loop thread: inside `call`)."""
        return list(self._tracked)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.error is None

    def _post(self, op: str, arg: object) -> Future:
        fut: Future = Future()
        if self._stop.is_set() or self.error is not None:
            fut.set_exception(RuntimeError("the engine loop has stopped"))
            return fut
        self._inbox.put((op, arg, fut))
        self._wake.set()
        return fut

    # ---- the loop thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_inbox()
                if not self.engine.has_unfinished():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                deltas = self._step()
                self._deliver(deltas)
        except Exception as e:  # noqa: BLE001 - ends every request in flight, then kept for health()
            log.exception("the engine loop failed")
            self.error = e
            self._fail_inbox()
            self._end_all(FinishReason.ERROR, f"the engine loop failed: {type(e).__name__}: {e}", failure=True)
            return
        self._fail_inbox()
        self._end_all(FinishReason.ABORT, "the instance is shutting down")

    def _take_inbox(self) -> Iterator[tuple[str, object, Future]]:
        """Everything posted so far whose caller still waits (a cancelled future is dropped)."""
        while True:
            try:
                op, arg, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                yield op, arg, fut

    def _apply_inbox(self) -> None:
        for op, arg, fut in self._take_inbox():
            try:
                fut.set_result(self._apply(op, arg))
            except Exception as e:  # noqa: BLE001 - handed to the caller through its future
                fut.set_exception(e)

    def _apply(self, op: str, arg: object) -> object:
        if op == "add":
            request, sink = arg
            try:
                self.engine.add_request(request)  # raises RequestError (or InstanceUnhealthy) to the caller
            except Exception:
                self._record_end(request.request_id, RequestStatus.FAILED)
                raise
            self._tracked[request.request_id] = _Tracked(sink, time.monotonic(), stats=self._stats_of(request))
            return None
        if op == "call":
            return arg()
        if op == "hand_over":
            rid, destination = arg
            t = self._tracked.pop(rid, None)
            if t is not None:
                t.sink(StreamItem(TokenDelta(rid, (), ""), migrated_to=destination))
            return t is not None
        if op == "abort":
            tracked = self._tracked.get(arg)
            final = self.engine.abort(arg)
            if tracked is not None:
                self._end(arg, RequestStatus.ABORTED)
                delta = final or TokenDelta(arg, (), "", FinishReason.ABORT)
                tracked.sink(StreamItem(delta, stats=tracked.stats))
            return tracked is not None
        raise ValueError(op)

    def _stats_of(self, request: Request) -> SpecStats:
        """The engine's live stats object of a just-queued request (filled in as it runs)."""
        for seq in self.engine.waiting:
            if seq.request_id == request.request_id:
                return seq.stats
        return SpecStats()

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        now = time.monotonic()
        for seq in self.engine.running:  # first scheduling ends a request's queue time
            t = self._tracked.get(seq.request_id)
            if t is not None and t.scheduled_at is None and seq.status == SeqStatus.RUNNING:
                t.scheduled_at = now
        for delta in deltas:
            t = self._tracked.get(delta.request_id)
            if t is None:
                continue
            if t.scheduled_at is None:  # finished (or failed) in its first step
                t.scheduled_at = now
            queue_s = None
            if not t.queue_reported:
                queue_s, t.queue_reported = t.scheduled_at - t.submitted_at, True
            if delta.finished:
                self._end(delta.request_id, RequestStatus.of(delta.finish_reason))
            t.sink(StreamItem(delta, stats=t.stats if delta.finished else None, queue_s=queue_s))

    def _end_all(self, reason: FinishReason, message: str, failure: bool = False) -> None:
        for rid, t in list(self._tracked.items()):
            self._end(rid, RequestStatus.of(reason))
            t.sink(StreamItem(TokenDelta(rid, (), "", reason, error=message, instance_failure=failure), stats=t.stats))

    def _end(self, request_id: str, status: RequestStatus) -> None:
        """A tracked request ended: recorded as ended first, then untracked (see `states`)."""
        self._record_end(request_id, status)
        del self._tracked[request_id]

    def _record_end(self, request_id: str, status: RequestStatus) -> None:
        self._ended[request_id] = status
        while len(self._ended) > KEEP_ENDED:
            self._ended.popitem(last=False)

    def _fail_inbox(self) -> None:
        for _, _, fut in self._take_inbox():
            fut.set_exception(RuntimeError("the engine loop has stopped"))
