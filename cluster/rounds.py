"""`RoundRecord`: one request's speculation round, recorded once and read by every figure that counts rounds."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RoundRecord:
    """What one verification round of one request decided (actors/speculation/verify.py's vocabulary).

    The engine makes one per emitting request per step (actors/engine/core.py `Engine._apply`), and each reader
    folds it into its own figure: the speculation policy's acceptance estimates (engine-wide and the request's,
    actors/speculation/policy.py `Acceptance.observe`), the engine's per-position counters (actors/engine/stats.py
    `StepCounters.observe`) and the request's own stats (`SpecStats.observe`). A round with `proposed` = 0 is a
    plain decode step: it counts in the request's k history only.
    """

    request_id: str
    drafter: str  # the drafter kind that proposed ("model", "model_int8", "ngram", "suffix"; "" without one)
    proposed: int  # k: draft tokens proposed this round
    accepted: int  # how many of them the target accepted (a prefix: 0 <= accepted <= proposed)

    def __post_init__(self) -> None:
        if not 0 <= self.accepted <= self.proposed:
            raise ValueError(f"a round accepts 0..{self.proposed} drafts, not {self.accepted}")

    @property
    def emitted(self) -> int:
        """Tokens the round emits: the accepted drafts and the target's recovered or bonus token."""
        return self.accepted + 1

    @property
    def rejected(self) -> bool:
        """Whether a draft was rejected (the round's last trial failed) rather than all accepted."""
        return self.accepted < self.proposed
