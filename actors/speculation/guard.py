"""A measured guard on speculation: per batch size, drafting continues only while steps that draft measure at least
as fast, in emitted tokens per second of wall time, as steps that do not.

The goodput policy (actors/speculation/policy.py) decides k from a cost model; when the model is wrong, it can keep
a batch size below plain decoding for good (docs/benchmarks.md: n-gram goodput at 0.90x of plain at batch 8 on this
CPU, its rare drafts costing more than they returned). This guard judges the outcome instead of the model, in the
spirit of SmartSpec's adaptive speculation (Liu et al., arXiv 2406.14066) but measured, not modelled:
for each batch-size bucket it keeps two decayed ratios, tokens / seconds of the decode steps that drafted and of
those that did not. While the drafting ratio is the lower, the bucket is closed: its steps take the plain path
(k = 0 for every request, no lookup, no search). One closed step in `explore_every` still goes to the policy, which
drafts only where its cost model says it pays; what that step measures may reopen the bucket. Symmetrically, an
open bucket that has drafted for `explore_every` steps without a plain one takes a plain step while drafting
measures within `recheck_margin` of plain (or plain has too few samples), so near break-even both ratios follow the
machine's current load, and where drafting clearly wins it is not interrupted. Pure Python, no Ray; the engine feeds it each step (actors/engine/core.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Throughput:
    """Decayed sums of tokens and seconds: their ratio is the recent tokens per second (a ratio of sums, so one
    long step weighs by its length, not as one sample)."""

    tokens: float = 0.0
    seconds: float = 0.0
    samples: int = 0

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    def add(self, tokens: int, seconds: float, decay: float) -> None:
        self.tokens = decay * self.tokens + tokens
        self.seconds = decay * self.seconds + seconds
        self.samples += 1


@dataclass
class Bucket:
    """One batch-size bucket's two measurements and its exploration counter."""

    drafting: Throughput = field(default_factory=Throughput)
    plain: Throughput = field(default_factory=Throughput)
    steps: int = 0  # steps of this bucket asked about (`allows`)
    explored: int = 0  # the step of its last exploration while closed
    plain_at: int = 0  # the step of its last plain measurement
    declined: bool = False  # the policy's last search here gave every request k = 0 (a model draft: `declined`)


def bucket_of(batch: int) -> int:
    """The bucket of a batch of `batch` emitting requests (its upper bound): each size up to 8 its own (a step's
    tokens per second grows with the batch, so sizes mixed in one bucket would favour whichever arm ran the larger
    batches), then 9-16, 17-32, ..."""
    b = 8
    if batch <= b:
        return batch
    while b < batch:
        b *= 2
    return b


class MeasuredGuard:
    """Per batch-size bucket: may this step speculate (`allows`), from what earlier steps measured (`observe`)."""

    def __init__(self, explore_every: int = 8, decay: float = 0.8, min_samples: int = 3,
                 recheck_margin: float = 0.25) -> None:
        if explore_every < 2 or not 0.0 < decay <= 1.0 or min_samples < 1 or recheck_margin < 0:
            raise ValueError("explore_every >= 2, 0 < decay <= 1, min_samples >= 1 and recheck_margin >= 0 are "
                             "required")
        self.explore_every, self.decay, self.min_samples = explore_every, decay, min_samples
        self.recheck_margin = recheck_margin
        self.buckets: dict[int, Bucket] = {}

    def _bucket(self, batch: int) -> Bucket:
        return self.buckets.setdefault(bucket_of(batch), Bucket())

    def closed(self, batch: int) -> bool:
        """Whether drafting has measured slower than plain decoding at this batch size (both with evidence)."""
        b = self.buckets.get(bucket_of(batch))
        if b is None or b.drafting.samples < self.min_samples or b.plain.samples < self.min_samples:
            return False
        return b.drafting.rate < b.plain.rate

    def allows(self, batch: int) -> bool:
        """Whether this step of `batch` emitting requests goes to the policy (False: the plain path, k = 0 for all).
        Closed: one step in `explore_every` lets the policy try again. Open: one step in `explore_every` is plain
        if no plain step was measured since, so the two arms are measured under the same load."""
        b = self._bucket(batch)
        b.steps += 1
        if self.closed(batch) or b.declined:
            if b.steps - b.explored >= self.explore_every:
                b.explored, b.declined = b.steps, False  # this step's search may decline again
                return True
            return False
        if b.drafting.samples >= self.min_samples and b.steps - b.plain_at >= self.explore_every and self._near(b):
            b.plain_at = b.steps
            return False
        return True

    def _near(self, b: Bucket) -> bool:
        """Whether an open bucket needs a fresh plain measurement: too few plain steps to judge by, or drafting within
        `recheck_margin` of plain. A bucket where drafting clearly wins (a lone request with matches, 1.3x and more)
        is not made to decode plainly one step in `explore_every`: that would cost it an eighth of its gain."""
        return b.plain.samples < self.min_samples or b.drafting.rate < (1.0 + self.recheck_margin) * b.plain.rate

    def declined(self, batch: int) -> None:
        """The policy searched at this batch size and gave every request k = 0: until the next exploration its
        steps take the plain path without searching again. For a draft model only (`GoodputPolicy.declined`):
        its candidates are the same every step, so the answer changes only as the estimates do, while a search
        costs milliseconds (3.2 ms of a 33 ms step of the default model at batch 8, its int8 self-draft never
        paying; the guard itself never closes there, having no drafting step to judge)."""
        self._bucket(batch).declined = True

    def observe(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        """A decode step of `batch` emitting requests (no prefill in it) emitted `tokens` in `seconds` of wall time,
        with drafts (`drafted`) or without."""
        if batch <= 0 or seconds <= 0:
            return
        b = self._bucket(batch)
        (b.drafting if drafted else b.plain).add(tokens, seconds, self.decay)
        if not drafted:
            b.plain_at = b.steps
