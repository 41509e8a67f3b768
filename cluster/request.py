"""The request model: typed messages that cross every boundary (sampling parameters, requests, deltas).

This is the one place where a request's parameters are checked: `SamplingParams` holds the bounds of every
sampling field and `check_prompt` the prompt's limits against a model's context and vocabulary. The HTTP and
gRPC layers (deploy/serve/) and the engine (actors/engine/core.py) all call these, so they cannot disagree.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


MAX_SEED = 2**63 - 1  # seeds are non-negative 63-bit integers (what torch's Generator.manual_seed takes)
MAX_STOPS = 16
# a stop string's longest length: output is held back by that much while it streams, and each new token's text
# is searched over that much of what came before it (actors/engine/output.py)
MAX_STOP_CHARS = 256
MAX_LOGPROBS = 20  # top logprobs per token (OpenAI's limit)
MAX_LOGIT_BIAS = 300  # tokens a logit_bias may list (OpenAI's limit)
MAX_STOP_TOKEN_IDS = 64
MAX_CHOICES = 1_000  # a choice output's strings
MAX_CHOICE_CHARS = 1_000  # each one's length
# how deep a JSON schema may nest (objects and arrays): real schemas nest a few levels; deeper ones reach the
# recursion limits of Python's json, pydantic's serializer and the grammar compiler, each a 500 if not refused here
MAX_SCHEMA_DEPTH = 64
# what a request that does not say samples with (OpenAI's defaults; the HTTP and gRPC surfaces take them from here)
DEFAULT_TEMPERATURE = 1.0
DEFAULT_MAX_TOKENS = 16  # a completion's (a chat's default is the room left in the context)


class InvalidRequest(ValueError):
    """A request that can never be served as given; `param` names the field at fault (OpenAI's `param`)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


def json_depth(value: object, limit: int = MAX_SCHEMA_DEPTH) -> int:
    """How deep `value` nests (a scalar 0, `{}` 1), counted without recursion; stops counting past `limit`."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict | list | tuple):
            deepest = max(deepest, depth)
            if depth > limit:
                return depth
            stack.extend((c, depth + 1) for c in (v.values() if isinstance(v, dict) else v))
    return deepest


def parse_json_schema(text: str, param: str) -> dict:
    """A JSON schema given as text (vLLM's guided_json string, gRPC's json_schema): parsed without Python's
    recursion (pydantic-core's parser), an object nested at most MAX_SCHEMA_DEPTH deep; InvalidRequest naming
    `param` otherwise."""
    try:
        schema = pydantic_core.from_json(text)
    except ValueError as e:
        if "recursion limit" in str(e):
            raise InvalidRequest(f"{param}: the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param=param,
                                 code="invalid_value") from None
        raise InvalidRequest(f"{param}: not valid JSON: {str(e)[:200]}", param=param, code="invalid_value") from None
    if not isinstance(schema, dict):
        raise InvalidRequest(f"{param}: a JSON schema is an object", param=param, code="invalid_value")
    return schema


class StructuredOutput(BaseModel):
    """What a request's output must match (exactly one field set): a JSON schema, any JSON object, a regular
    expression, one of a list of strings (vLLM's guided_json / json_object / guided_regex / guided_choice), or a
    grammar in llguidance's Lark syntax (built by the server for tool calls and reasoning: deploy/serve/tools.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    json_schema: dict | None = None
    json_object: bool = False
    regex: str | None = Field(default=None, max_length=10_000)
    choice: tuple[Annotated[str, Field(max_length=MAX_CHOICE_CHARS)], ...] | None = Field(
        default=None, min_length=1, max_length=MAX_CHOICES)
    lark: str | None = Field(default=None, max_length=4 << 20)

    @field_validator("json_schema")
    @classmethod
    def _shallow(cls, v: dict | None) -> dict | None:
        if v is not None and json_depth(v) > MAX_SCHEMA_DEPTH:
            raise ValueError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        return v

    @model_validator(mode="after")
    def _exactly_one(self) -> "StructuredOutput":
        given = sum((self.json_schema is not None, self.json_object, self.regex is not None, self.choice is not None,
                     self.lark is not None))
        if given != 1:
            raise ValueError("a structured output takes exactly one of json_schema, json_object, regex, choice, lark")
        return self


class SamplingParams(BaseModel):
    """How one request samples and when it stops (the OpenAI / vLLM fields), with the one set of bounds.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1.0 switch those filters off. A seed makes
    the same request give the same output. max_tokens counts generated tokens.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    temperature: float = Field(default=DEFAULT_TEMPERATURE, ge=0.0, le=2.0)  # OpenAI's range
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    max_tokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=0)  # 0 only to score a prompt (with prompt_logprobs)
    stop: tuple[str, ...] = Field(default=(), max_length=MAX_STOPS)
    stop_token_ids: tuple[int, ...] = Field(default=(), max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    # logits processors, applied to the target's logits at every scored position and to the draft's while it
    # proposes (actors/speculation/processors.py): OpenAI's presence and frequency penalties, HF's repetition penalty,
    # a bias per token id, and the least tokens generated before EOS or a stop token id may end the request
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    logit_bias: dict[int, float] = Field(default_factory=dict, max_length=MAX_LOGIT_BIAS)
    min_tokens: int = Field(default=0, ge=0)
    # log-probabilities: of each generated token and its `logprobs` most likely alternatives (0: the token's
    # only); of each prompt token and its `prompt_logprobs` alternatives (the first prompt token has none)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    structured: StructuredOutput | None = None  # what the output must match (actors/speculation/structured.py)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: object) -> object:
        if isinstance(v, str):
            return (v,)
        return tuple(v) if isinstance(v, list) else v

    @field_validator("stop_token_ids", mode="before")
    @classmethod
    def _ids_list(cls, v: object) -> object:
        return tuple(v) if isinstance(v, list) else v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in v):
            raise ValueError(f"stop strings must be at most {MAX_STOP_CHARS} characters")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[int, float]) -> dict[int, float]:
        if any(not -100.0 <= b <= 100.0 for b in v.values()):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if any(t < 0 for t in v):
            raise ValueError("logit_bias keys must be token ids (non-negative)")
        return v

    @model_validator(mode="after")
    def _scoring_only_without_tokens(self) -> "SamplingParams":
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise ValueError("max_tokens must be at least 1 (0 only scores a prompt, with prompt_logprobs)")
        if self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def context_length(model_max: int, configured: int | None, cache_tokens: int | None = None) -> int:
    """The context a served model gets: the config's `model.max_model_len` where it sets one, never more than the
    model's own (`model_max`) nor than its KV cache holds (`cache_tokens`: usable blocks * block_size, where a
    request alone in the cache can still run to its end). The engine and the API surfaces check prompts against
    the same number, so a request that could never fit is a 400 before anything streams."""
    return min(configured or model_max, model_max, model_max if cache_tokens is None else cache_tokens)


def check_prompt(prompt_ids: Sequence[int], max_tokens: int | None, max_model_len: int, vocab_size: int) -> int:
    """Check a tokenized prompt against a model's context and vocabulary; returns max_tokens (None: the rest of
    the context). Raises InvalidRequest naming `prompt` or `max_tokens`."""
    n = len(prompt_ids)
    if n == 0:
        raise InvalidRequest("the prompt is empty", param="prompt")
    if any(not 0 <= t < vocab_size for t in prompt_ids):
        raise InvalidRequest(f"prompt token ids must be in [0, {vocab_size})", param="prompt")
    if n >= max_model_len:
        raise InvalidRequest(f"the prompt has {n} tokens; this model's context is {max_model_len} tokens",
                             param="prompt", code="context_length_exceeded")
    if max_tokens is None:
        return max_model_len - n
    if n + max_tokens > max_model_len:
        raise InvalidRequest(f"max_tokens ({max_tokens}) + the prompt ({n} tokens) exceed this model's context of "
                             f"{max_model_len} tokens", param="max_tokens", code="context_length_exceeded")
    return max_tokens


class FinishReason(str, enum.Enum):
    """Why a request ended; the first two are OpenAI's `finish_reason` values."""

    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens reached, or the model's context is full
    ABORT = "abort"  # cancelled by the client or an operator
    ERROR = "error"  # the request could not be served (see TokenDelta.error)


class RequestStatus(str, enum.Enum):
    """A request's state in the router's table and in an instance's answer to `request_states`."""

    RUNNING = "running"  # routed to an instance (at the instance: queued or running), not finished
    FINISHED = "finished"  # ended normally (stop or length)
    ABORTED = "aborted"  # cancelled by the client, an operator, or a drain
    FAILED = "failed"  # ended with an error (e.g. its instance lost a shard)

    @classmethod
    def of(cls, reason: FinishReason) -> "RequestStatus":
        """How a request that ended for `reason` is recorded."""
        return {FinishReason.STOP: cls.FINISHED, FinishReason.LENGTH: cls.FINISHED, FinishReason.ABORT: cls.ABORTED,
                FinishReason.ERROR: cls.FAILED}[reason]


@dataclass(frozen=True)
class Resume:
    """Where a request picks up on another instance (live migration, failover): the tokens it generated so far,
    how many characters of their text its client already has, and its sampler's state (None: a fresh one)."""

    token_ids: tuple[int, ...]
    text_chars: int
    generator_state: bytes | None = None  # torch.Generator.get_state(), as bytes
    stats: SpecStats | None = None


@dataclass(frozen=True)
class Request:
    """A tokenized request as the engine receives it; `resume` continues one that began elsewhere."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    priority: int = 0  # higher is served first
    arrival_time: float = 0.0
    resume: Resume | None = None
    tenant: str = ""  # who sent it (an API key's tenant name): what it may share with others is scoped by it
    # a tenant's own prefix cache: requests share cached KV blocks only with requests of the same salt (None: all)
    cache_salt: str | None = None


@dataclass
class SpecStats:
    """Speculation counters of one request (or summed over many)."""

    proposed: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens the target accepted
    rounds: int = 0  # verification rounds with drafts (each emits accepted + 1 tokens)
    accepted_per_position: list[int] = field(default_factory=list)  # [j] = accepted at draft position j
    k_history: list[int] = field(default_factory=list)  # k chosen at each step that emitted tokens, 0 included

    def record(self, proposed: int, accepted: int) -> None:
        self.proposed += proposed
        self.accepted += accepted
        self.rounds += 1
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position.extend([0] * (proposed - len(self.accepted_per_position)))
        for j in range(accepted):
            self.accepted_per_position[j] += 1

    def merge(self, other: "SpecStats") -> None:
        self.proposed += other.proposed
        self.accepted += other.accepted
        self.rounds += other.rounds
        n = max(len(self.accepted_per_position), len(other.accepted_per_position))
        a = self.accepted_per_position + [0] * (n - len(self.accepted_per_position))
        b = other.accepted_per_position + [0] * (n - len(other.accepted_per_position))
        self.accepted_per_position = [x + y for x, y in zip(a, b)]
        self.k_history = self.k_history + other.k_history

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification round (accepted drafts + the target's own token)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def mean_k(self) -> float:
        return sum(self.k_history) / len(self.k_history) if self.k_history else 0.0

    def as_dict(self) -> dict:
        return {
            "proposed": self.proposed,
            "accepted": self.accepted,
            "rounds": self.rounds,
            "acceptance_rate": round(self.acceptance_rate, 4),
            "mean_accepted_length": round(self.mean_accepted_length, 4),
            "accepted_per_position": list(self.accepted_per_position),
            "mean_k": round(self.mean_k, 4),
            "k_history": list(self.k_history),
        }


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target's processed distribution, and the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass(frozen=True)
class TokenDelta:
    """What one engine step emitted for one request: new tokens, new text, and the end if it ended."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    error: str | None = None
    # the error is the instance's (it lost a shard, its loop failed), not the request's: the request may resume
    # on another instance from its tokens (failover)
    instance_failure: bool = False
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per token of token_ids, if the request asked
    # the prompt's, on the request's first delta, if it asked: one per prompt token (None for the first)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StreamItem:
    """One message of a request's stream from its instance: a delta, and on the last one the request's stats and
    timings (actors/serving/loop.py sends them, the API replicas read them)."""

    delta: TokenDelta
    stats: SpecStats | None = None  # set on the final item
    queue_s: float | None = None  # from submission to first being scheduled; set on the first item that has it
    rejected: bool = False  # the engine refused the request (delta.error says why); nothing was generated
    # the request moved to another instance (live migration): (instance id, its actor handle) to follow; the
    # stream ends here without a finish, and the destination's `resume_stream` carries on from the next token
    migrated_to: tuple[str, object] | None = None
