"""The speculation plan of a step: each emitting request's k, from the policy, what the drafter can propose and
the KV that can be reserved for the drafts.

The draft follows no prefill chunk: it catches up when a request next drafts, and the policy is told each
request's catch-up (its draft backlog) as part of that request's cost (actors/speculation/policy.py).
"""

from __future__ import annotations

from typing import Protocol

from actors.speculation.cost_model import ATTENTION_UNIT, ForwardShape
from actors.speculation.drafters import Drafter
from actors.speculation.evidence import EvidenceAcceptance
from actors.speculation.policy import Acceptance, BatchBase, Candidate, SpecPolicy
from actors.speculation.step import Drafting, Schedule, SpecPlan, Work


class TargetKV(Protocol):
    def reserve(self, request_id: str, total_tokens: int) -> bool: ...


class SpeculationPlanner:
    """Chooses each emitting work's k (0..`max_k`) and reserves KV for its drafts in the target and the drafter."""

    def __init__(self, policy: SpecPolicy, drafter: Drafter | None, target: TargetKV, max_k: int,
                 acceptance: Acceptance) -> None:
        self.policy, self.drafter, self.target = policy, drafter, target
        self.max_k = max_k  # 0 when the policy is off or there is nothing to draft with
        self.acceptance = acceptance  # the engine-wide estimate (updated as rounds are verified)
        # per class of a lookup's match, per position (the engine feeds it each verified round: `observe`)
        self.evidence = EvidenceAcceptance()

    def plan(self, schedule: Schedule, running: int) -> SpecPlan:
        """The schedule's works with their ks; `running` is the batch the engine settles into (`BatchBase.running`)."""
        emitting = [w for w in schedule.works if w.emits]
        if self.max_k == 0 or not emitting or self.drafter is None or not self.policy.allows(len(emitting)):
            return SpecPlan(schedule, tuple(Drafting(w) for w in schedule.works))  # the plain path: no lookup, no search
        chunks = [w for w in schedule.works if not w.emits]
        tokens = sum(w.num_new for w in chunks)
        attention = sum(w.num_new * (w.start + w.num_new) for w in chunks) / ATTENTION_UNIT
        base = BatchBase(ForwardShape(1, tokens, attention), running=running)
        cands, evidence = [], {}
        for w in emitting:
            end = w.start + w.num_new
            limit = max(0, min(self.max_k, w.seq.remaining - 1))
            limit = self.drafter.lookahead(w.seq, limit) if limit else 0
            # the request's own rounds over a prior that is the engine's current estimate (learnt from every
            # request): a fixed prior outweighed one failed round, and a refit then made a random draft look worth it
            rate = w.seq.acceptance.blend(self.acceptance.rate)
            expected: tuple[float, ...] = ()
            if limit and (ev := self.drafter.evidence(w.seq)) is not None:
                # a lookup's drafts go by what drafts of its match class did, position by position, over that rate
                evidence[id(w)] = ev
                expected = self.evidence.expected(ev, limit, rate)
                rate = expected[1] - 1.0  # the first position's: what orders requests in the policy's search
            cands.append(Candidate(rate, limit, w.num_new, end, draft_backlog=self.drafter.backlog(w.seq, end),
                                   remaining=w.seq.remaining, expected=expected))
        if not any(c.max_k for c in cands):  # nothing to draft for anyone (no lookup match): no search
            return SpecPlan(schedule, tuple(Drafting(w) for w in schedule.works))
        chosen = self.policy.choose(cands, base, schedule.draft_budget)
        if not any(chosen) and not chunks and all(w.num_new == 1 for w in emitting):  # a steady decode step said no
            self.policy.declined(len(emitting))
        ks = {id(w): self._reserve(w, k) for w, k in zip(emitting, chosen)}
        return SpecPlan(schedule, tuple(Drafting(w, ks.get(id(w), 0), evidence.get(id(w)))
                                        for w in schedule.works))

    def observe(self, d: Drafting, proposed: int, accepted: int) -> None:
        """A verified round of `d`: what its match class's drafts did (a plain round or a model's drafts: nothing)."""
        if d.evidence is not None:
            self.evidence.observe(d.evidence, proposed, accepted)

    def _reserve(self, w: Work, k: int) -> int:
        """Reserve KV for k drafts (target: n + k tokens; the drafter its own); the k that fits."""
        rid, n = w.seq.request_id, w.start + w.num_new
        while k > 0 and not self.target.reserve(rid, n + k):
            k -= 1
        return self.drafter.reserve(w, k) if k > 0 else 0
