"""Prefill/decode disaggregation: which instance prefills a request and which one decodes it (pure policy, no Ray).

Instances take a role: `prefill`, `decode` or `both` (the default: every instance does both, as without
disaggregation). A request is placed on a pair: it starts on a prefill instance, and once that instance has produced
its first token the router moves it to its decode instance through the staged live migration (cluster/migration.py),
KV and draft state included; the client's stream follows it there. This is DistServe's split (Zhong et al., OSDI
'24) and Splitwise's (Patel et al., ISCA '24), with our migration in the place of NIXL or Mooncake.

The pair (`DisaggPolicy.place`), on plain data:
- the decode instance: among decode-capable instances (`decode` or `both`), the one holding most of the prompt's
  leading KV blocks within `max_load_gap` of the least loaded one's virtual usage, else the least loaded;
- skip the prefill instance when the prompt's part that instance does not cache is shorter than
  `skip_prefill_tokens`: it prefills there itself (llm-d's prefix-based decider: a request whose prefix the decode
  pod holds, or a short prompt, goes to the decode pod alone);
- else the prefill instance: the least loaded prefill-capable one (`prefill` or `both`), preferring one that holds
  more of the prefix, under the same margin;
- with no decode-capable instance the request runs aggregated where it starts (any accepting instance), and with
  no prefill-capable one aggregated on its decode instance: a missing role degrades to today's behaviour, never to
  an error.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

Role = Literal["prefill", "decode", "both"]
ROLES: tuple[Role, ...] = ("prefill", "decode", "both")
# why a request was placed as it was (`Placement.reason`; counted by the router)
REASONS = ("disaggregated", "prefix_hit", "short_prompt", "no_prefill_instance", "no_decode_instance",
           "same_instance", "no_prompt_shape", "no_candidate")


class DisaggConfig(BaseModel):
    """`router.disaggregation`: the instances' roles and the pair policy's margins (docs/disaggregation.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # one role per instance, in the order instances are numbered (fleet.instances of them); empty: every instance
    # is `both`, and dispatch is as without disaggregation
    roles: tuple[Role, ...] = ()
    # a request whose prompt has fewer tokens than this that its decode instance does not cache is prefilled there
    # (no move); llm-d's decider has the same threshold on non-cached tokens
    skip_prefill_tokens: int = Field(default=256, ge=0)
    # a prefix holder is preferred over the least loaded instance of its role if its virtual usage is at most this
    # much above (a fraction of its KV), as cache_aware dispatch does
    max_load_gap: float = Field(default=0.25, ge=0.0)
    # how often the router reads a prefill instance's requests while some wait for their first token there
    handoff_poll_s: float = Field(default=0.02, gt=0.0)

    @property
    def enabled(self) -> bool:
        """Whether any instance has a role other than `both` (else disaggregation is off)."""
        return any(r != "both" for r in self.roles)

    def role_of(self, index: int) -> Role:
        """The role of the instance numbered `index` (0-based); `both` past the list's end."""
        return self.roles[index] if index < len(self.roles) else "both"


@dataclass(frozen=True)
class PromptShape:
    """What the router needs to know of a prompt to place it on a pair: its length and the KV block size its block
    names were made with (cluster/prefix.py), so it can tell how much of it an instance caches."""

    tokens: int
    block_size: int


@dataclass(frozen=True)
class Candidate:
    """One accepting instance as the pair policy sees it."""

    instance_id: str
    role: Role
    usage: float  # virtual usage (cluster/dispatch.py, InstanceView.virtual_usage): smaller is less loaded
    in_flight: int = 0
    cached_blocks: int = 0  # leading blocks of the request's prompt it holds (the prefix index's count)

    @property
    def prefills(self) -> bool:
        return self.role != "decode"

    @property
    def decodes(self) -> bool:
        return self.role != "prefill"


@dataclass(frozen=True)
class Placement:
    """Where a request starts (`first`) and, if it is disaggregated, where it moves after its first token."""

    first: str
    decode: str | None  # None: it stays where it starts
    reason: str  # one of REASONS

    @property
    def disaggregated(self) -> bool:
        return self.decode is not None


class DisaggPolicy:
    """Places a request on a (prefill, decode) pair, or on one instance when the split does not pay."""

    def __init__(self, cfg: DisaggConfig) -> None:
        self.cfg = cfg

    def _best(self, candidates: Sequence[Candidate]) -> Candidate:
        """The holder of most of the prefix within `max_load_gap` of the least loaded, else the least loaded."""
        least = min(candidates, key=_load)
        ceiling = least.usage + self.cfg.max_load_gap
        holders = [c for c in candidates if c.cached_blocks > least.cached_blocks and c.usage <= ceiling]
        return min(holders, key=lambda c: (-c.cached_blocks, _load(c))) if holders else least

    def decode_instance(self, candidates: Sequence[Candidate], exclude: frozenset[str] = frozenset()) -> str | None:
        """The decode-capable instance a request should decode on (None if there is none), leaving out `exclude`."""
        decoders = [c for c in candidates if c.decodes and c.instance_id not in exclude]
        return self._best(decoders).instance_id if decoders else None

    def place(self, candidates: Sequence[Candidate], prompt: PromptShape | None) -> Placement:
        """The pair for a request over the accepting instances `candidates` (non-empty). `prompt`: its length and
        block size (None when the caller could not say: then it is not split, and decodes where it starts)."""
        if not candidates:
            raise ValueError("no candidate instance")
        decoders = [c for c in candidates if c.decodes]
        prefillers = [c for c in candidates if c.prefills]
        if not decoders:
            return Placement(self._best(candidates).instance_id, None, "no_decode_instance")
        decode = self._best(decoders)
        if prompt is None:
            return Placement(decode.instance_id, None, "no_prompt_shape")
        uncached = max(0, prompt.tokens - decode.cached_blocks * prompt.block_size)
        if uncached < self.cfg.skip_prefill_tokens:
            return Placement(decode.instance_id, None, "prefix_hit" if decode.cached_blocks else "short_prompt")
        if not prefillers:
            return Placement(decode.instance_id, None, "no_prefill_instance")
        prefill = self._best(prefillers)
        if prefill.instance_id == decode.instance_id:  # a `both` instance is best at each: no move
            return Placement(decode.instance_id, None, "same_instance")
        return Placement(prefill.instance_id, decode.instance_id, "disaggregated")


def _load(c: Candidate) -> tuple[float, int, str]:
    return (c.usage if math.isfinite(c.usage) else math.inf), c.in_flight, c.instance_id


def prefilled(prompt_tokens: int, tokens_now: int) -> bool:
    """Whether a request whose prompt has `prompt_tokens` tokens has produced its first token (its tokens now, the
    prompt and those generated, as its instance reports them: cluster/migration_policy.py, RequestLoad.tokens)."""
    return tokens_now > prompt_tokens
