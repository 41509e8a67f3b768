"""The typed hand-offs of one engine step: schedule -> speculation plan -> drafts -> scores -> verdicts -> apply.

Each stage of `Engine.step` (actors/engine/core.py) hands the next one of these, keyed by request id, as vLLM v1
hands `SchedulerOutput` to the model runner and its `ModelRunnerOutput` back to the scheduler: no stage reads
another's lists by position, and none mutates what it was given.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from actors.speculation.cost_model import ForwardShape
from actors.speculation.policy import Acceptance
from actors.speculation.structured import GrammarState
from cluster.prefix import ChainNames
from cluster.request import Request, TokenLogprob


# What speculation reads of the engine's records (actors/engine/sequence.py's Sequence, actors/engine/scheduler.py's
# Work and Schedule), as protocols in this lower layer: speculation imports nothing of the engine above it.
class Emitted(Protocol):
    """A request's output so far: the tokens it emitted and the tokens that stop it."""

    token_ids: list[int]
    stop_ids: set[int]


class SeqState(Protocol):
    """A request being served, as the drafters, the plan and verification read it."""

    request: Request
    token_ids: list[int]  # the prompt followed by every generated token
    output: Emitted
    generator: torch.Generator | None  # None for greedy requests
    acceptance: Acceptance
    draft_names: ChainNames | None
    grammar: GrammarState | None

    @property
    def request_id(self) -> str: ...
    @property
    def greedy(self) -> bool: ...
    @property
    def remaining(self) -> int: ...


class Work(Protocol):
    """One request's share of a step: `num_new` tokens from position `start`; `emits` when it reaches the newest."""

    seq: SeqState
    start: int
    num_new: int
    emits: bool


class Schedule(Protocol):
    """A step's works in priority order, and the target tokens left for drafts."""

    works: Sequence[Work]
    draft_budget: int


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
    evidence: int | None = None  # the class of the lookup match behind its drafts (actors/speculation/evidence.py)

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
