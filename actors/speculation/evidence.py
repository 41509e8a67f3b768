"""Acceptance by the evidence behind a lookup draft: per matched context length, per draft position, engine-wide.

A lookup's drafts are not alike: on the default model's chat prompts (docs/benchmarks.md, "Acceptance by the
n-gram's length"), a 4-gram match's first draft token was the target's next token 91% of the time, a 2-gram's
36%. One estimate per request mixes them, and at batch 8, where a verified row costs about 40% of what a plain
step's token does, it drafts the 2-gram matches at a loss and values the 4-gram ones at half their worth. So the
planner keys an engine-wide estimate by the length of the context the lookup matched (its `evidence`), as
SuffixDecoding (Oliaro et al., arXiv 2411.04975) scores each draft by its own match and path statistics rather
than by a request-wide rate. Acceptance after the first position is not independent of it (a 2-gram's later
tokens are accepted 57-84% of the time once the first was), so each position keeps its own conditional rate:
E(k) = 1 + r_1 + r_1 r_2 + ... + r_1...r_k, the i.i.d. formula's generalisation (Leviathan et al.'s E(alpha, k)
is the case r_j = alpha). Pure Python, no Ray; the planner reads it (actors/speculation/plan.py) and the engine
feeds it each verified round (actors/engine/core.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

DECAY = 0.97  # per update of a position: engine-wide, so it sees many rounds; about the last 30 weigh
PRIOR_WEIGHT = 2.0  # trials' worth of the request's own estimate behind each position's rate


def match_class(n: int) -> int:
    """The class of a match of n context tokens: n itself up to 4, then 8, 16, 32 (a suffix match can run to the
    trie's depth; each class must still see enough rounds to learn from)."""
    c = n if n <= 4 else 8
    while c < n and c < 32:
        c *= 2
    return c


@dataclass
class PositionRates:
    """Decayed per-position acceptance: position j's rate is P(draft j accepted | drafts before j accepted)."""

    successes: list[float] = field(default_factory=list)
    trials: list[float] = field(default_factory=list)

    def update(self, proposed: int, accepted: int, decay: float = DECAY) -> None:
        """One verified round of `proposed` drafts with `accepted` of them accepted: positions up to the first
        rejection were tried, the ones before it succeeded (the rest were never tested)."""
        for j in range(min(accepted + 1, proposed)):
            if j == len(self.trials):
                self.successes.append(0.0)
                self.trials.append(0.0)
            self.successes[j] = decay * self.successes[j] + (1.0 if j < accepted else 0.0)
            self.trials[j] = decay * self.trials[j] + 1.0

    def rate(self, j: int, prior: float, weight: float = PRIOR_WEIGHT) -> float:
        """Position j's rate over a prior of `weight` trials at `prior` (the prior alone where j was never tried)."""
        s, t = (self.successes[j], self.trials[j]) if j < len(self.trials) else (0.0, 0.0)
        return (s + weight * prior) / (t + weight)

    def expected(self, k: int, prior: float) -> tuple[float, ...]:
        """Expected tokens a round emits with 0..k drafts (accepted drafts + the target's own token)."""
        out, reach = [1.0], 1.0
        for j in range(k):
            reach *= self.rate(j, prior)
            out.append(out[-1] + reach)
        return tuple(out)


class EvidenceAcceptance:
    """Per evidence class (a lookup's matched context length), the per-position rates of its drafts."""

    def __init__(self, decay: float = DECAY) -> None:
        self.decay = decay
        self.by_class: dict[int, PositionRates] = {}

    def observe(self, evidence: int, proposed: int, accepted: int) -> None:
        """A verified round whose drafts came from a match of class `evidence` (a round without drafts: no news)."""
        if proposed > 0:
            self.by_class.setdefault(evidence, PositionRates()).update(proposed, accepted, self.decay)

    def expected(self, evidence: int, k: int, prior: float) -> tuple[float, ...]:
        """Expected tokens with 0..k drafts of class `evidence`, over the request's own estimate `prior`."""
        return self.by_class.get(evidence, PositionRates()).expected(k, prior)
