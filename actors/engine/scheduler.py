"""Continuous-batching scheduler: decodes first, prefill chunks in the rest of a token budget, admission
under the KV block budget, priorities, and preemption by recompute.

Each step (Sarathi-Serve, Agrawal et al., arXiv 2403.02310): every running request whose prompt is
done takes one decode token, and room for up to K draft tokens is kept for the speculation policy
(at most half of what the decodes leave); prefill chunks of running requests, then of newly admitted
ones, fill the remaining tokens, so a long prompt is split over steps and never stalls the decodes.
Higher priority is admitted first and preempted last. A request that cannot get KV blocks for its
share of a step preempts the lowest-priority, latest-arrived running request (possibly itself), whose
KV is freed and recomputed on resumption: recompute, not swap, because on CPU a swap is a copy into
the same memory, and recompute gives the same tokens at temperature 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from actors.engine.sequence import EngineSequence, SeqStatus
from cluster.config import SchedulerConfig


class KVSpace(Protocol):
    """What the scheduler needs of the instance's target KV cache (block accounting is per request)."""

    def length(self, request_id: str) -> int: ...
    def has(self, request_id: str) -> bool: ...
    def reserve(self, request_id: str, total_tokens: int) -> bool: ...
    def match(self, request_id: str, names: list[int]) -> int: ...


@dataclass
class Work:
    """One request's share of a step: `num_new` of its known tokens for the target (drafts come on top: the
    speculation plan, actors/speculation/plan.py, gives each emitting work its k)."""

    seq: EngineSequence
    start: int  # the target's cache length before the step: position of the first new token
    num_new: int
    emits: bool = field(init=False)  # the chunk reaches the newest token: the step verifies and emits

    def __post_init__(self) -> None:
        self.emits = self.start + self.num_new == len(self.seq.token_ids)

    @property
    def is_prefill(self) -> bool:
        return self.num_new > 1 or not self.emits


@dataclass(frozen=True)
class Failed:
    """A request the scheduler gave up on this step (it can never fit), with the reason."""

    seq: EngineSequence
    message: str


@dataclass
class Schedule:
    """A step's plan: the works, in priority order, the target tokens left for drafts, and the requests that
    failed to be scheduled (already out of the queues, their KV freed)."""

    works: list[Work]
    draft_budget: int
    failed: list[Failed] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(w.num_new for w in self.works if w.is_prefill)


class Scheduler:
    """Waiting and running queues of one engine, and the per-step plan."""

    def __init__(self, cfg: SchedulerConfig, kv: KVSpace, max_k: int,
                 release: Callable[[EngineSequence], None]) -> None:
        self.cfg = cfg
        self.kv = kv
        self.max_k = max_k  # drafts per request the policy may ask for
        self._release = release  # frees a request's KV in every cache
        self.waiting: list[EngineSequence] = []
        self.running: list[EngineSequence] = []
        self.num_preemptions = 0
        self.prefix_queries = 0  # prompt tokens admitted with the prefix cache asked, and those it held
        self.prefix_hits = 0

    def add(self, seq: EngineSequence) -> None:
        self.waiting.append(seq)

    def remove(self, request_id: str) -> EngineSequence | None:
        """Take a request out of whichever queue holds it (abort, finish); the caller frees its KV."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    return seq
        return None

    def schedule(self) -> Schedule:
        budget = self.cfg.max_num_batched_tokens
        failed: list[Failed] = []
        decodes = [s for s in sorted(self.running, key=EngineSequence.order_key) if self._pending(s) == 1]
        works: list[Work] = []
        for seq in decodes:  # 1: running decodes, one token each
            if seq.status is SeqStatus.RUNNING and self._reserve_or_preempt(seq, 1):
                works.append(Work(seq, self.kv.length(seq.request_id), 1))
        works = [w for w in works if w.seq.status is SeqStatus.RUNNING]  # a later one may have preempted it
        left = budget - len(works)
        draft_room = min(self.max_k * len(works), left // 2)
        left -= draft_room
        for seq in sorted(self.running, key=EngineSequence.order_key):  # 2: running prefills, chunked
            if left <= 0:
                break
            if seq.status is SeqStatus.RUNNING and self._pending(seq) > 1:
                n = min(self._pending(seq), left)
                if self._reserve_or_preempt(seq, n):
                    works.append(Work(seq, self.kv.length(seq.request_id), n))
                    left -= n
        works = [w for w in works if w.seq.status is SeqStatus.RUNNING]
        for seq in sorted(self.waiting, key=EngineSequence.order_key):  # 3: admit new and preempted requests
            if left <= 0 or len(self.running) >= self.cfg.max_batch_size:
                break
            start = self._start(seq)  # 0, the KV a migrated request brought along, or a cached prefix
            n = min(len(seq.token_ids) - start, left)
            if not self.kv.reserve(seq.request_id, start + n):
                self._release(seq)
                if not self.running:  # alone in an empty cache and still no room: it never fits
                    self.waiting.remove(seq)
                    failed.append(Failed(seq, "the request does not fit in the KV cache"))
                    continue
                break
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            if seq.target_names is not None:
                self.prefix_queries += len(seq.token_ids)
                self.prefix_hits += start
            works.append(Work(seq, start, n))
            left -= n
        used = sum(w.num_new for w in works)
        return Schedule(works, budget - used, failed)

    def _start(self, seq: EngineSequence) -> int:
        """Where a request being admitted starts: the KV it holds, or the longest cached prefix of its tokens (all
        but the last: one token must run to give the logits of the next)."""
        rid = seq.request_id
        if seq.target_names is None or self.kv.has(rid):
            return self.kv.length(rid)
        return self.kv.match(rid, seq.target_names.upto(seq.token_ids, len(seq.token_ids) - 1))

    def _pending(self, seq: EngineSequence) -> int:
        """Known tokens the target has not processed yet (1 when decoding)."""
        return len(seq.token_ids) - self.kv.length(seq.request_id)

    def _reserve_or_preempt(self, seq: EngineSequence, num_new: int) -> bool:
        """Reserve KV for `num_new` more tokens of a running request, preempting lower-ranked requests as
        needed; False if `seq` itself was preempted."""
        total = self.kv.length(seq.request_id) + num_new
        while not self.kv.reserve(seq.request_id, total):
            victim = max(self.running, key=EngineSequence.order_key)
            self.preempt(victim)
            if victim is seq:
                return False
        return True

    def preempt(self, seq: EngineSequence) -> None:
        """Send a running request back to the queue; its KV is freed and recomputed later."""
        self.running.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(seq)
