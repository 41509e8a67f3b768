"""The engine's running figures (steps, batch shape, acceptance by draft position) and the `EngineStats` it reports."""

from __future__ import annotations

from dataclasses import dataclass, field

from actors.speculation.step import SpecPlan, Verdict
from cluster.request import TokenDelta


@dataclass
class StepCounters:
    """Running figures behind Engine.stats(), updated once per step."""

    steps: int = 0
    step_s: float = 0.0
    step_ema_s: float = 0.0
    batch_size: int = 0
    batch_tokens: int = 0
    prefill_tokens: int = 0
    mean_k: float = 0.0
    tokens_emitted: int = 0
    drafted: int = 0  # draft tokens proposed by a draft model, and the draft stage's seconds for them
    draft_s: float = 0.0
    proposed_at: list[int] = field(default_factory=list)  # per draft position: rounds that drafted it
    accepted_at: list[int] = field(default_factory=list)  # and in how many it was accepted

    def by_position(self, verdict: Verdict) -> None:
        """A round of `verdict.proposed` drafts of which the first `verdict.accepted` were taken."""
        k = verdict.proposed
        while len(self.proposed_at) < k:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for j in range(k):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < verdict.accepted

    def record(self, plan: SpecPlan, deltas: list[TokenDelta], seconds: float) -> None:
        self.steps += 1
        self.step_s = seconds
        self.step_ema_s = seconds if self.steps == 1 else 0.9 * self.step_ema_s + 0.1 * seconds
        self.batch_size = len(plan.works)
        self.batch_tokens = sum(d.work.num_new + d.k for d in plan.works)
        self.prefill_tokens = plan.schedule.num_prefill_tokens
        ks = [d.k for d in plan.emitting]
        self.mean_k = sum(ks) / len(ks) if ks else 0.0
        self.tokens_emitted += sum(len(d.token_ids) for d in deltas)

    def draft_stage(self, drafted: int, seconds: float) -> None:
        """A draft model proposed `drafted` tokens this step in `seconds`."""
        self.drafted += drafted
        self.draft_s += seconds

    @property
    def draft_s_per_token(self) -> float:
        return self.draft_s / self.drafted if self.drafted else 0.0

    @property
    def acceptance_by_position(self) -> tuple[float, ...]:
        return tuple(a / p for a, p in zip(self.accepted_at, self.proposed_at))
