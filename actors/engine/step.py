"""The typed hand-offs of one engine step: schedule -> speculation plan -> drafts -> scores -> verdicts -> apply.

Each stage of `Engine.step` (actors/engine/core.py) hands the next one of these, keyed by request id, as vLLM v1
hands `SchedulerOutput` to the model runner and its `ModelRunnerOutput` back to the scheduler: no stage reads
another's lists by position, and none mutates what it was given.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from actors.engine.scheduler import Schedule, Work
from actors.speculation.cost_model import ForwardShape
from cluster.request import TokenLogprob


@dataclass
class Proposal:
    """One work's draft for this step: tokens (k,) and, for a sampled request, q (k, V) (None: one-hot/greedy)."""

    tokens: list[int] = field(default_factory=list)
    probs: torch.Tensor | None = None

    def q(self, vocab_size: int, device: torch.device) -> torch.Tensor:
        """The draft distributions (k, V): the model's, or one-hot on each proposed token."""
        if self.probs is not None:
            return self.probs
        index = torch.tensor(self.tokens, dtype=torch.long, device=device)[:, None]  # (k, 1)
        return torch.zeros(len(self.tokens), vocab_size, device=device).scatter_(1, index, 1.0)


@dataclass(frozen=True)
class Drafting:
    """One work of the step with the drafts it gets: k (0 for a prefill chunk, or a request not drafting now)."""

    work: Work
    k: int = 0

    @property
    def request_id(self) -> str:
        return self.work.seq.request_id


@dataclass(frozen=True)
class SpecPlan:
    """The step's schedule with each work's k, chosen by the speculation policy; KV for the drafts is reserved."""

    schedule: Schedule
    works: tuple[Drafting, ...]  # in the schedule's order

    @property
    def emitting(self) -> tuple[Drafting, ...]:
        """The works the step verifies and emits for (a decode, or a prompt's last chunk)."""
        return tuple(d for d in self.works if d.work.emits)

    @property
    def drafting(self) -> tuple[Drafting, ...]:
        return tuple(d for d in self.works if d.k > 0)


@dataclass(frozen=True)
class Drafts:
    """What the drafter proposed for each drafting request (at most its k tokens), and the draft forwards it ran."""

    proposals: Mapping[str, Proposal]
    shape: ForwardShape = ForwardShape()
    seconds: float = 0.0

    def of(self, request_id: str) -> Proposal:
        """The request's proposal; an empty one where it drafts nothing."""
        return self.proposals.get(request_id) or Proposal()


@dataclass(frozen=True)
class Scores:
    """The target's logits for the k + 1 positions of each emitting request, from the step's one target forward."""

    logits: torch.Tensor  # (N, V): every emitting request's rows, in plan order
    rows: Mapping[str, tuple[int, int]]  # request id -> (first row, number of rows = k + 1)
    shape: ForwardShape = ForwardShape()
    seconds: float = 0.0
    # request id -> (first row, n): rows of the prompt positions a request scores (prompt_logprobs), row i the
    # logits after its prompt token start + i (they give the logprob of token start + i + 1)
    prompt_rows: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def of(self, request_id: str) -> torch.Tensor:
        """The request's logits (k + 1, V)."""
        first, n = self.rows[request_id]
        return self.logits[first:first + n]


@dataclass(frozen=True)
class Verdict:
    """One request's round: how many of its `proposed` drafts were accepted, and the tokens to emit (the accepted
    drafts and the recovered or bonus token)."""

    proposed: int
    accepted: int
    tokens: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token, if the request asked
