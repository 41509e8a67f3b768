"""The serving loop: an engine's step() on its own thread, with requests coming in and deltas going out between steps.

This is continuous batching as a server needs it: `submit`, `abort`, `call` and `hand_over` may be called from any
thread (the Ray actor's event loop, in actors/serving/server.py); each posts a typed command (Add, Abort, RunOnLoop,
HandOver, Pause, EndPause) that the loop applies before the next step; it runs the step, and hands each request's
delta to that request's sink (StreamItems, cluster/request.py). The engine is only ever touched by the loop thread, so
it needs no locks. The loop sleeps while there is no work and wakes when a request arrives. A `between_steps` hook
(StepBarrier) lets a test hold the loop between two chosen steps.
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

from actors.engine.sequence import EngineSequence, SeqStatus
from actors.speculation.structured import CompiledGrammar
from cluster.request import FinishReason, Request, RequestStatus, SpecStats, StreamItem, TokenDelta


Sink = Callable[[StreamItem], None]


# ---- what other threads post to the loop, applied between two steps (by type, in `ServingLoop._apply`)
@dataclass(frozen=True)
class Add:
    """Queue `request`, its stream going to `sink`; `grammar`: its structured output, compiled off the loop."""

    request: Request
    sink: Sink
    grammar: CompiledGrammar | None = None


@dataclass(frozen=True)
class Abort:
    """Cancel a request; its sink gets a final ABORT item."""

    request_id: str


@dataclass(frozen=True)
class RunOnLoop:
    """Run `fn` on the loop thread (it may use the engine)."""

    fn: Callable[[], object]


@dataclass(frozen=True)
class HandOver:
    """A request left for `destination` (instance id, actor handle): its stream ends with a `migrated_to` item."""

    request_id: str
    destination: tuple[str, object]


@dataclass(frozen=True)
class Pause:
    """Take no step until `until` (time.monotonic) or an EndPause; commands are still applied meanwhile (a migration's
    copies go on, aborts end streams), and requests keep their place. As vLLM's pause_generation, with a deadline
    so that a pause nobody ends cannot hold an instance for good."""

    until: float


@dataclass(frozen=True)
class EndPause:
    """End a pause."""


Command = Add | Abort | RunOnLoop | HandOver | Pause | EndPause


class Steppable(Protocol):
    """What the loop drives: an Instance (actors/serving/instance.py) or a bare Engine (actors/engine/core.py)."""

    waiting: list[EngineSequence]
    running: list[EngineSequence]

    def add_request(self, request: Request, grammar: CompiledGrammar | None = None) -> EngineSequence: ...
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
    """Runs `step` (the engine's own by default) repeatedly on a daemon thread while the engine has work; commands
    posted from other threads are applied between two steps."""

    def __init__(self, engine: Steppable, step: Callable[[], list[TokenDelta]] | None = None,
                 name: str = "engine-loop", between_steps: Callable[[], None] | None = None,
                 idle: Callable[[], bool] | None = None) -> None:
        """`idle`: work in small pieces for the loop thread while the engine has no request and nothing is posted
        (a calibration left off the start: actors/engine/core.py, `idle_work`); it returns True while more remains."""
        self.engine = engine
        self._step = step or engine.step
        self._idle = idle
        # called on the loop thread after each step's deltas went out, before anything posted is applied: a test's
        # step barrier (StepBarrier) places an event exactly between two steps
        self._between_steps = between_steps or (lambda: None)
        self._inbox: queue.SimpleQueue[tuple[Command, Future]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._tracked: dict[str, _Tracked] = {}
        self._ended: OrderedDict[str, RequestStatus] = OrderedDict()  # newest last, at most KEEP_ENDED
        self._paused_until = 0.0  # time.monotonic() before which no step is taken (Pause)
        self.error: BaseException | None = None  # an unexpected exception that stopped the loop
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ---- called from other threads --------------------------------------------------------------
    def submit(self, request: Request, sink: Sink, grammar: CompiledGrammar | None = None) -> Future:
        """Queue `request`; the future resolves once the engine took it (or carries its RequestError). `grammar`: its
        structured output compiled beforehand (actors/serving/grammar_pool.py), so the loop only copies it."""
        return self._post(Add(request, sink, grammar))

    def abort(self, request_id: str) -> Future:
        """Cancel a request; the future resolves to whether it was in flight. Its sink gets a final ABORT item."""
        return self._post(Abort(request_id))

    def call(self, fn: Callable[[], object]) -> Future:
        """Run `fn` on the loop thread between two steps (it may use the engine); the future has its result."""
        return self._post(RunOnLoop(fn))

    def hand_over(self, request_id: str, destination: tuple[str, object]) -> Future:
        """A request left for another instance (migration): its stream ends with a `migrated_to` item, and the loop
        forgets it (it is neither running nor ended here)."""
        return self._post(HandOver(request_id, destination))

    def pause(self, seconds: float) -> Future:
        """Stop stepping for at most `seconds`; the future resolves once the loop is between two steps and takes no
        more (fault tests hold streams mid-stream with it, operators inspect an instance at rest)."""
        return self._post(Pause(time.monotonic() + seconds))

    def resume(self) -> Future:
        """Step again (a loop that is not paused is unchanged)."""
        return self._post(EndPause())

    @property
    def paused(self) -> bool:
        return time.monotonic() < self._paused_until

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

    def _post(self, command: Command) -> Future:
        fut: Future = Future()
        if self._stop.is_set() or self.error is not None:
            fut.set_exception(RuntimeError("the engine loop has stopped"))
            return fut
        self._inbox.put((command, fut))
        self._wake.set()
        return fut

    # ---- the loop thread --------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_inbox()
                if (held := self._paused_until - time.monotonic()) > 0 or not self.engine.has_unfinished():
                    if held <= 0 and self._idle is not None and self._inbox.empty():
                        if not self._idle():  # one piece; what is posted meanwhile is applied before the next
                            self._idle = None
                        continue
                    self._wake.wait(min(held, 0.5) if held > 0 else 0.5)
                    self._wake.clear()
                    continue
                deltas = self._step()
                self._deliver(deltas)
                self._between_steps()
        except Exception as e:  # noqa: BLE001 - ends every request in flight, then kept for health()
            log.exception("the engine loop failed")
            self.error = e
            self._fail_inbox()
            self._end_all(FinishReason.ERROR, f"the engine loop failed: {type(e).__name__}: {e}", failure=True)
            return
        self._fail_inbox()
        self._end_all(FinishReason.ABORT, "the instance is shutting down")

    def _take_inbox(self) -> Iterator[tuple[Command, Future]]:
        """Everything posted so far whose caller still waits (a cancelled future is dropped)."""
        while True:
            try:
                command, fut = self._inbox.get_nowait()
            except queue.Empty:
                return
            if fut.set_running_or_notify_cancel():
                yield command, fut

    def _apply_inbox(self) -> None:
        for command, fut in self._take_inbox():
            try:
                fut.set_result(self._apply(command))
            except Exception as e:  # noqa: BLE001 - handed to the caller through its future
                fut.set_exception(e)

    def _apply(self, command: Command) -> object:
        match command:
            case Add(request, sink, grammar):
                return self._add(request, sink, grammar)
            case RunOnLoop(fn):
                return fn()
            case HandOver(rid, destination):
                return self._hand_over(rid, destination)
            case Abort(rid):
                return self._abort(rid)
            case Pause(until):
                self._paused_until = until
                return None
            case EndPause():
                self._paused_until = 0.0
                return None
        raise TypeError(f"not a serving loop command: {command!r}")

    def _add(self, request: Request, sink: Sink, grammar: CompiledGrammar | None) -> None:
        try:
            seq = self.engine.add_request(request, grammar)  # raises RequestError (or InstanceUnhealthy) to the caller
        except Exception:
            self._record_end(request.request_id, RequestStatus.FAILED)
            raise
        self._tracked[request.request_id] = _Tracked(sink, time.monotonic(), stats=seq.stats)  # filled in as it runs

    def _hand_over(self, rid: str, destination: tuple[str, object]) -> bool:
        t = self._tracked.pop(rid, None)
        if t is not None:
            t.sink(StreamItem(TokenDelta(rid, (), ""), migrated_to=destination))
        return t is not None

    def _abort(self, rid: str) -> bool:
        tracked = self._tracked.get(rid)
        final = self.engine.abort(rid)
        if tracked is not None:
            self._end(rid, RequestStatus.ABORTED)
            delta = final or TokenDelta(rid, (), "", FinishReason.ABORT)
            tracked.sink(StreamItem(delta, stats=tracked.stats))
        return tracked is not None

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
        for _, fut in self._take_inbox():
            fut.set_exception(RuntimeError("the engine loop has stopped"))


class StepBarrier:
    """A `between_steps` hook that holds the loop after its `after`-th step until `release`: a test then places an
    event exactly between two steps (an abort, a migration's stop, a client leaving) instead of racing a long stream.
    Held longer than `timeout_s`, it raises on the loop thread (the loop fails loudly, ending every request)."""

    def __init__(self, after: int = 1, timeout_s: float = 60.0) -> None:
        self.steps = 0  # steps seen so far
        self.after, self.timeout_s = after, timeout_s
        self.reached = threading.Event()  # set once the loop is held
        self._go = threading.Event()

    def __call__(self) -> None:
        self.steps += 1
        if self.steps == self.after:
            self.reached.set()
            if not self._go.wait(self.timeout_s):
                raise TimeoutError(f"the step barrier after step {self.after} was not released in {self.timeout_s} s")

    def release(self) -> None:
        self._go.set()
