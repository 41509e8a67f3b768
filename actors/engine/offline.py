"""Offline generation: a batch of tokenized prompts served to completion by an Engine or an Instance, in this process.

    completions = generate(engine, prompts, SamplingParams(temperature=0.0, max_tokens=32))
    completions = generate(instance, prompts, params)   # a shard failure ends the batch's requests with an error

The one home of the offline loop (the CLI's `generate`, the benchmarks, the tests): queue every prompt, step until
each has finished, gather each request's deltas. What it drives steps as it would in a serving loop: an Instance's
step turns a shard failure into the error deltas of every request in flight, so the batch ends rather than raising.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from actors.engine.sequence import EngineSequence
from cluster.request import FinishReason, Request, SamplingParams, SpecStats, TokenDelta

_ids = itertools.count()  # request ids of offline batches, unique in this process


@dataclass
class Completion:
    """A finished request, as `generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stats: SpecStats
    error: str | None = None


class Offline(Protocol):
    """What `generate` drives: an Engine (actors/engine/core.py) or an Instance (actors/serving/instance.py)."""

    def check_request(self, request: Request) -> None:
        """Raise if the request can never be served; changes nothing."""
        ...

    def add_request(self, request: Request) -> EngineSequence:
        """Queue a request; its sequence (whose stats fill in as it runs)."""
        ...

    def step(self) -> list[TokenDelta]: ...

    def has_unfinished(self) -> bool: ...

    def flush(self) -> None:
        """Ship what the last step left pending (an Instance's frees, to its shards)."""
        ...


def generate(steppable: Offline, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
             ) -> list[Completion]:
    """Serve a batch of tokenized prompts to completion, or to the error that ends them; results in prompt order.
    All or nothing: a prompt that can never be served raises before any is queued. `params`: one for every prompt,
    or one each."""
    params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
    requests = [Request(f"gen-{next(_ids)}", tuple(p), sp) for p, sp in zip(prompts, params_list, strict=True)]
    for r in requests:  # a bad prompt must not leave the good ones queued
        steppable.check_request(r)
    done: dict[str, Completion] = {}
    for r in requests:
        seq = steppable.add_request(r)
        done[r.request_id] = Completion(r.request_id, list(r.prompt_token_ids), [], "", None, seq.stats)
    while any(c.finish_reason is None for c in done.values()) and steppable.has_unfinished():
        for delta in steppable.step():
            c = done.get(delta.request_id)
            if c is not None:
                c.token_ids.extend(delta.token_ids)
                c.text += delta.text
                c.finish_reason, c.error = delta.finish_reason, delta.error
    steppable.flush()
    return list(done.values())
