"""How long an instance takes to come back, learned from the starts the router has seen: the failover wait.

A request whose only instance died waits for its replacement (deploy/serve/frontend.py, cluster/router.py). A fixed
wait loses every such request wherever a start happens to be slower than the guess (issue 40: 63 s starts on an
AVX2 machine against a 60 s wait). So the router records two kinds of evidence:

- a **start**: how long an instance took from its Serve replica's construction to its registration (reported by
  the replica when it registers: weights, kernels, calibration, first forward);
- a **replacement**: how long an instance id stayed unregistered after the router removed it as failed, until an
  incarnation registered under the same id (Serve's health check, its restart delay, and the start itself).

The wait is `multiple` times the slowest of the last `window` of these, bounded below by the configured floor and
above by the ceiling: `min(ceiling, max(floor, multiple * slowest))`. With no evidence yet, the floor.

The autoscaler reads the same history for another figure: how long a new instance takes to serve, the median of the
last `window` starts (replacements left out: they include Serve noticing a death, which a scale-out does not wait
for). Its predictive step up (cluster/autoscale.py) projects the load that far ahead.

A guess from past starts can still be short (a loaded machine, a cold cache), so a replica also **announces** its
start as it begins (`starting`): while an announced start has not registered, a waiting request keeps waiting, up
to the ceiling from when its wait began. The learned wait covers the time before a replacement is even scheduled
(Serve noticing the death); the announcement covers however long the start itself takes.
`StartHistory` is pure: no Ray, no clock of its own (times are passed in). `Arrivals` applies it on the router's event
loop: a request that finds no instance of its model waits that long for one to register (cluster/router.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.registry import NoInstanceAvailable, Registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class FailoverWait:
    """The wait in force and why: seconds, and the slowest recent start or replacement it was derived from."""

    wait_s: float
    slowest_s: float | None  # None: no start seen yet (the floor applies)
    floor_s: float
    ceiling_s: float
    multiple: float
    samples: int
    starting: int = 0  # starts announced and not yet registered: a waiting request waits for them, up to the ceiling
    # the last start's seconds phase by phase (actors/start_phases.py: replica, process, imports, weights, ...),
    # where its instance reported them
    last_start: tuple[tuple[str, float], ...] = ()
    # the median of the last starts (replacements left out): how long a scale-out takes to serve; None: none seen
    expected_start_s: float | None = None

    @property
    def why(self) -> str:
        """The reason for this wait, in words."""
        if self.slowest_s is None:
            return "the configured floor: no start seen yet"
        return (f"{self.multiple:g} x the slowest of the last {self.samples} starts, {self.slowest_s:.0f} s, within "
                f"the floor {self.floor_s:.0f} s and the ceiling {self.ceiling_s:.0f} s")


@dataclass
class StartHistory:
    """The last `window` start and replacement durations (seconds), and when each failed instance was removed."""

    floor_s: float
    ceiling_s: float
    multiple: float = 2.0
    window: int = 8
    durations: deque[float] = field(default_factory=deque)
    start_durations: deque[float] = field(default_factory=deque)  # starts alone, the last `window`
    _lost_at: dict[str, float] = field(default_factory=dict)  # instance id -> when it was removed as failed
    _recorded: dict[str, str] = field(default_factory=dict)  # instance id -> the incarnation last recorded
    _starting: dict[str, float] = field(default_factory=dict)  # instance id -> when its start was announced
    _last_phases: tuple[tuple[str, float], ...] = ()

    def __post_init__(self) -> None:
        if not 0 <= self.floor_s <= self.ceiling_s:
            raise ValueError(f"the failover wait's floor {self.floor_s} s must be within [0, ceiling "
                             f"{self.ceiling_s} s]")
        if self.multiple < 1.0 or self.window < 1:
            raise ValueError("the failover wait's multiple must be >= 1 and its window >= 1")

    def lost(self, instance_id: str, now: float) -> None:
        """`instance_id` was removed as failed at `now`: its replacement's registration will say how long it took."""
        self._lost_at.setdefault(instance_id, now)

    def starting(self, instance_id: str, now: float) -> None:
        """A replica of `instance_id` began its start at `now` (it registers when done)."""
        self._starting[instance_id] = now

    def start_in_progress(self, now: float) -> bool:
        """Whether an announced start is still under way (announced less than the ceiling ago, not registered)."""
        return any(now - t < self.ceiling_s for t in self._starting.values())

    def registered(self, instance_id: str, incarnation: str, now: float, start_s: float | None,
                   phases: tuple[tuple[str, float], ...] = ()) -> None:
        """An incarnation of `instance_id` registered at `now`, `start_s` seconds after its replica began (None: not
        reported; `phases`: where they went). A repeated registration of one incarnation (the router restarted)
        adds nothing."""
        self._starting.pop(instance_id, None)
        if self._recorded.get(instance_id) == incarnation:
            return
        self._recorded[instance_id] = incarnation
        if start_s is not None and start_s >= 0:
            self._add(start_s)
            self.start_durations.append(start_s)
            while len(self.start_durations) > self.window:
                self.start_durations.popleft()
            self._last_phases = tuple(phases)
        lost = self._lost_at.pop(instance_id, None)
        if lost is not None and now >= lost:
            self._add(now - lost)

    def _add(self, seconds: float) -> None:
        self.durations.append(seconds)
        while len(self.durations) > self.window:
            self.durations.popleft()

    def wait(self) -> FailoverWait:
        """How long a request may wait now for an instance to register.

        >>> h = StartHistory(floor_s=10.0, ceiling_s=300.0)
        >>> h.wait().wait_s
        10.0
        >>> h.registered("i0", "a", now=100.0, start_s=40.0)
        >>> h.wait().wait_s, h.wait().slowest_s
        (80.0, 40.0)
        >>> h.lost("i0", now=200.0); h.registered("i0", "b", now=390.0, start_s=50.0)
        >>> h.wait().wait_s  # the replacement took 190 s: twice that, capped at the ceiling
        300.0
        """
        slowest = max(self.durations) if self.durations else None
        wait = self.floor_s if slowest is None else max(self.floor_s, self.multiple * slowest)
        return FailoverWait(min(self.ceiling_s, wait), slowest, self.floor_s, self.ceiling_s, self.multiple,
                            len(self.durations), len(self._starting), self._last_phases, self.expected_start())

    def expected_start(self) -> float | None:
        """The median of the last `window` starts (seconds; replacements left out), None before the first.

        >>> h = StartHistory(floor_s=10.0, ceiling_s=300.0)
        >>> for i, s in enumerate((6.0, 30.0, 7.0)): h.registered(f"i{i}", "a", now=0.0, start_s=s)
        >>> h.expected_start()  # one slow start does not move it far
        7.0
        """
        if not self.start_durations:
            return None
        ordered = sorted(self.start_durations)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


class Arrivals:
    """Instances registering, as the router's placements wait for them: `joined` wakes every waiting `placed`."""

    def __init__(self, starts: StartHistory, registry: Registry) -> None:
        self.starts, self.registry = starts, registry
        self._joined = asyncio.Event()  # set (and replaced) whenever an instance registers

    def joined(self) -> None:
        self._joined.set()
        self._joined = asyncio.Event()

    async def placed(self, place: Callable[[], str], model: str | None) -> str:
        """`place()`'s instance; while none can take the request because none of `model` is up (none registered
        yet, or the last one failed and its replacement is starting), wait for one to register: the failover wait
        (learned from the starts seen, within the configured floor and ceiling), and longer while a
        replacement has announced its start and not registered yet (up to the ceiling). The client sees a pause,
        not an error. An instance drained on purpose is no reason to wait: then NoInstanceAvailable at once, as when
        the wait runs out (its message names the wait and why)."""
        allowed = self.starts.wait()
        began = time.monotonic()
        warned = False
        while True:
            joined = self._joined
            try:
                return place()
            except NoInstanceAvailable as e:
                now = time.monotonic()
                if any(i.draining and i.healthy for i in self.registry.instances.values()
                       if model is None or i.model == model):
                    raise
                left = began + allowed.wait_s - now
                if left <= 0 and self.starts.start_in_progress(now):  # a replacement is starting: wait in slices
                    left = min(5.0, began + allowed.ceiling_s - now)
                if left <= 0:
                    raise NoInstanceAvailable(f"{e}; none registered within the failover wait of "
                                              f"{now - began:.1f} s ({allowed.why})") from None
                if not warned:
                    log.warning("no instance of %s is up: waiting up to %.0f s for one to register (longer while a "
                                "replacement is starting)", model or "any model", left)
                    warned = True
                try:
                    await asyncio.wait_for(joined.wait(), left)
                except asyncio.TimeoutError:
                    pass
