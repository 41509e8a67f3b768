"""The OpenAI API as vLLM serves it: request bodies (pydantic), response and stream-chunk bodies, error bodies.

Unknown fields are ignored, as vLLM does; fields we know are type-checked strictly (`"max_tokens": "12"` is a
400, not a conversion), and a wrong one becomes a 400 that names it (`param`). The bounds of the sampling
fields are not repeated here: they are `SamplingParams`' (cluster/request.py), checked when the frontend
builds it. Per-request speculation stats ride in an extension field, `spec_decode`.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cluster.request import SpecStats


class APIError(Exception):
    """An error a client caused or must wait out, with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers or {}

    def __reduce__(self):  # picklable across Ray (gRPC errors travel from the replica to the proxy)
        return (APIError, (self.status, self.message, self.type, self.param, self.code, self.headers))

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def from_validation_error(e: ValidationError) -> APIError:
    """The first problem of a request body, as a 400 naming the field."""
    err = e.errors()[0]
    param = ".".join(str(p) for p in err["loc"]) or None
    return APIError(400, f"{param}: {err['msg']}" if param else err["msg"], param=param, code="invalid_value")


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields the completion and chat bodies share."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: int = 0  # higher is served first (vLLM's field; vLLM sorts the other way, see docs/serving.md)
    ignore_eos: bool = False

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling_args(self) -> dict:
        """The keyword arguments of Frontend.prepare that the body gives as they are (not max_tokens)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "stop": self.stop_list, "n": self.n, "priority": self.priority, "ignore_eos": self.ignore_eos}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    prompt: str | list[int] = Field(min_length=1)
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: object) -> object:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            return v[0]  # a batch of one
        if isinstance(v, list) and v and not all(isinstance(t, int) for t in v):
            raise ValueError("give one prompt: a string or a list of token ids (batches of prompts: send n requests)")
        return v


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):  # content parts: only text parts are supported
            parts = []
            for p in self.content:
                if p.get("type") != "text" or not isinstance(p.get("text"), str):
                    raise ValueError("only text content parts are supported")
                parts.append(p["text"])
            return "".join(parts)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses --------------------------------------------------------------------------------------
def spec_decode(stats: SpecStats) -> dict:
    """The `spec_decode` extension: what the draft proposed and the target accepted for this request."""
    return {"proposed_tokens": stats.proposed, "accepted_tokens": stats.accepted, "rounds": stats.rounds,
            "acceptance_rate": round(stats.acceptance_rate, 4),
            "mean_accepted_length": round(stats.mean_accepted_length, 4),
            "accepted_per_position": list(stats.accepted_per_position)}


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, choices: list[dict], usage_: dict, stats: SpecStats, chat: bool) -> dict:
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": choices, "usage": usage_, "spec_decode": spec_decode(stats)}


def choice(index: int, text: str, finish_reason: str | None, chat: bool, stats: SpecStats | None = None) -> dict:
    body: dict = {"index": index, "finish_reason": finish_reason}
    if chat:
        body["message"] = {"role": "assistant", "content": text}
    else:
        body.update(text=text, logprobs=None)
    if stats is not None:
        body["spec_decode"] = spec_decode(stats)
    return body


def chunk_body(rid: str, model: str, created: int, index: int, text: str | None, finish_reason: str | None,
               chat: bool, first: bool = False) -> dict:
    if chat:
        delta: dict = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        c = {"index": index, "delta": delta, "finish_reason": finish_reason}
    else:
        c = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [c]}


def usage_chunk(rid: str, model: str, created: int, usage_: dict, stats: SpecStats, chat: bool) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage_, "spec_decode": spec_decode(stats)}


def model_list(models: dict[str, int]) -> dict:
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "specfleet", "max_model_len": n}
        for name, n in sorted(models.items())]}
