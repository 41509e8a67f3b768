"""An instance start timed phase by phase: what `specfleet bench start` and `specfleet status` show of a start.

A start is a recorder (`StartClock`) made current for the code that builds the instance; what that code calls marks
its own phases (`phase("weights")`), wherever it sits, without a clock passed down to it: outside a recorder a
phase is a no-op. A phase named twice adds up (two models' weights), and time inside a phase is not counted again
by one nested in it (the kernels loaded while a layer is packed count as kernels, not as packing), so the phases
add up to the start's wall time, less what no phase covers ("other"). The vocabulary, in start order:

  process      the instance's Ray actor scheduled and its worker process started, until its module runs
  imports      the instance server's imports (torch, transformers, ours)
  tokenizer    the tokenizer and the model's config read
  weights      the checkpoint's tensors opened (memory-mapped safetensors, the GGUF file's index)
  kernels      our CPU kernels built (a first start on a machine) or loaded (actors/model/cpu_kernels.py)
  layout       the stored weights laid out for our kernels (actors/model/qlinear.py), or read from their cache
  calibration  the goodput policy's forward times, timed or read back (actors/speculation/calibration.py)
  shards       an instance over shard actors: theirs started, each loading its layers in its own process
  injected delay  a start slowed on purpose by the fault tests (actors/serving/server.py)
  first forward  the first engine step (measured by whoever sends the first request)
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Iterator
from dataclasses import dataclass



@dataclass(frozen=True)
class StartPhases:
    """Seconds per phase of one start, in the order they began, and the start's wall time (`total_s`)."""

    phases: tuple[tuple[str, float], ...]
    total_s: float

    def seconds(self, name: str) -> float:
        """The phase's seconds (0.0 if the start had no such phase)."""
        return sum(s for n, s in self.phases if n == name)

    @property
    def other_s(self) -> float:
        """What no phase covers (the engine's own set-up, Python between phases)."""
        return max(0.0, self.total_s - sum(s for _, s in self.phases))

    def with_phase(self, name: str, seconds: float, first: bool = False) -> "StartPhases":
        """This start with a phase measured elsewhere (the process start, seen from its spawner) added to it."""
        row = ((name, round(seconds, 3)),)
        return StartPhases(row + self.phases if first else self.phases + row, round(self.total_s + seconds, 3))


class StartClock:
    """Records the phases of one start; `phase` marks them while it is current (`current`)."""

    def __init__(self) -> None:
        self._began = time.monotonic()
        self._seconds: dict[str, float] = {}
        self._open: list[list[float]] = []  # per open phase: its begin and the time its nested phases took

    def add(self, name: str, seconds: float) -> None:
        self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        frame = [time.monotonic(), 0.0]
        self._open.append(frame)
        try:
            yield
        finally:
            self._open.pop()
            took = time.monotonic() - frame[0]
            self.add(name, took - frame[1])
            if self._open:  # the enclosing phase does not count this time again
                self._open[-1][1] += took

    def result(self) -> StartPhases:
        return StartPhases(tuple((n, round(s, 3)) for n, s in self._seconds.items()),
                           round(time.monotonic() - self._began, 3))

    @contextlib.contextmanager
    def current(self) -> Iterator["StartClock"]:
        """Make this recorder the one `phase` marks, in this thread (and tasks it starts) for the block."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)


_CURRENT: contextvars.ContextVar[StartClock | None] = contextvars.ContextVar("start_clock", default=None)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as start phase `name` of the current start, if one is being recorded (else nothing)."""
    clock = _CURRENT.get()
    if clock is None:
        yield
        return
    with clock.phase(name):
        yield
