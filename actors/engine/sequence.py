"""Per-request state inside an engine: tokens so far, output and stop logic, speculation stats, RNG."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from actors.engine.output import RequestOutput
from actors.speculation.policy import Acceptance
from actors.speculation.structured import GrammarState
from cluster.prefix import ChainNames
from cluster.request import Request, SpecStats, TokenLogprob


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued, or preempted (its KV freed; it recomputes on resumption)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class EngineSequence:
    """One request being served. `token_ids` is the prompt followed by every generated token."""

    request: Request
    token_ids: list[int]
    output: RequestOutput
    generator: torch.Generator | None  # None for greedy requests
    stats: SpecStats = field(default_factory=SpecStats)
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    seqno: int = 0  # order of arrival at this engine, the tie-break after arrival_time
    acceptance: Acceptance = field(default_factory=lambda: Acceptance.prior(0.7))  # per-token acceptance estimate
    # its blocks' names in the target's and the draft's prefix caches (None: that cache does not share blocks)
    target_names: ChainNames | None = None
    draft_names: ChainNames | None = None
    grammar: GrammarState | None = None  # its structured output's matcher, at the tokens it emitted
    # its prompt's logprobs as the prefill computes them (the first token has none), delivered with its first delta
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_sent: bool = False

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def greedy(self) -> bool:
        return self.request.params.greedy

    @property
    def remaining(self) -> int:
        """Tokens still allowed before the length limit."""
        return self.output.max_new_tokens - len(self.output.token_ids)

    def order_key(self) -> tuple[int, float, int]:
        """Sort key: higher priority first, then earlier arrival."""
        return (-self.request.priority, self.request.arrival_time, self.seqno)
