"""The OpenAI API as vLLM serves it: request bodies (pydantic), response and stream-chunk bodies, error bodies.

Fields are type-checked strictly (`"max_tokens": "12"` is a 400, not a conversion) and every integer is bounded,
so a wrong one becomes a 400 that names it (`param`). A field the server does not implement is a 400 that names
it too (`code: unsupported_parameter`), never silently dropped: the OpenAI fields that would change the output
(`best_of`, `min_p`, the legacy `functions`...) are refused unless they carry their neutral value, and any
other unknown field is refused outright. Chat bodies take OpenAI's function tools (deploy/serve/tools.py); the
completions route refuses them. `user` is accepted and ignored, as it only labels the caller. The
sampling fields' ranges are `SamplingParams`' (cluster/request.py), checked when the frontend builds it; the
structured-output fields (`response_format`, vLLM's `guided_json` / `guided_regex` / `guided_choice`) become one
`StructuredOutput`. Per-request speculation stats ride in an extension field, `spec_decode`; logprobs are built
in deploy/serve/logprobs.py.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator,
                      model_validator)
from pydantic.json_schema import SkipJsonSchema

from cluster.request import (DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, MAX_CHOICE_CHARS, MAX_CHOICES, MAX_LOGIT_BIAS,
                             MAX_LOGPROBS, MAX_SEED, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS, MAX_STOPS, InvalidRequest,
                             SpecStats, StructuredOutput, parse_json_schema)
from deploy.serve.tools import (MAX_TOOLS, ToolCall, ToolChoice, ToolError, ToolPlan, Tools, check_history, plan,
                                template_call)

INT32_MAX = 2**31 - 1
# OpenAI / vLLM fields this server does not implement, each with the values that ask for nothing (accepted)
UNSUPPORTED: dict[str, tuple] = {
    "prompt_logprobs": (None, 0), "tools": (None, []), "tool_choice": (None, "none", "auto"),
    "parallel_tool_calls": (None,), "functions": (None, []), "function_call": (None, "none", "auto"),
    "min_p": (None, 0), "best_of": (None, 1), "suffix": (None, ""), "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True), "guided_grammar": (None,), "use_beam_search": (None, False),
}
TOOLS = ("tools", "tool_choice", "parallel_tool_calls")  # chat only (the completions route refuses them)
LEGACY_TOOLS = ("functions", "function_call")


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
    err = e.errors(include_url=False)[0]
    param = ".".join(str(p) for p in err["loc"] if not _union_member(p)) or None
    if param in LEGACY_TOOLS:
        return APIError(400, f"{param}: the legacy functions API is not supported; send `tools` (docs/serving.md)",
                        param=param, code="unsupported_parameter")
    if param in TOOLS and err["type"] == "value_error" and "not supported" in err["msg"]:
        return APIError(400, f"{param}: tool calling is served by /v1/chat/completions", param=param,
                        code="unsupported_parameter")
    if err["type"] == "extra_forbidden" or (param in UNSUPPORTED and param not in TOOLS):
        return APIError(400, f"{param}: not supported by this server", param=param, code="unsupported_parameter")
    if err["type"].startswith("json_"):
        return APIError(400, f"the body is not valid JSON: {err['msg'][:200]}", code="invalid_json")
    if err["type"] == "model_type" and not err["loc"]:
        return APIError(400, "the body must be a JSON object", code="invalid_json")
    msg = err["msg"][:300]  # an error may quote the input (a huge integer, say): never echo all of it
    return APIError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


def _union_member(loc: int | str) -> bool:
    """Whether a location step names the member of a union that was tried (`constrained-str`, `list[TextPart]`,
    `str`), not a field: pydantic puts those in error locations."""
    return isinstance(loc, str) and (not loc.isidentifier() or loc in ("str", "int", "float", "bool", "list", "none"))


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage so far in every chunk (guidellm asks for it)


StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]
Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Unsupported = SkipJsonSchema[Any]  # accepted only with its neutral value (UNSUPPORTED); left out of the schema


class JsonSchemaFormat(_Body):
    """`response_format.json_schema`: OpenAI's named schema (`strict` is accepted: output always matches)."""

    model_config = ConfigDict(populate_by_name=True)
    name: str = Field(max_length=256)
    description: str | None = Field(default=None, max_length=4096)
    schema_: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> "ResponseFormat":
        if (self.json_schema is None) == (self.type == "json_schema"):
            raise ValueError("give `json_schema` exactly when `type` is \"json_schema\"")
        return self


class _Sampling(_Body):
    """Fields the completion and chat bodies share."""

    model: str = Field(max_length=256)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    top_k: int = Field(default=0, ge=-1, le=INT32_MAX)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    priority: Int32 = 0  # higher is served first (vLLM's field; vLLM sorts the other way, see docs/serving.md)
    ignore_eos: bool = False
    user: str | None = Field(default=None, max_length=256)  # OpenAI's end-user label: accepted, not used
    # prefix caching (docs/prefix_caching.md): requests share cached KV blocks only with requests of the same salt
    # (vLLM's field); a tenant that must not share its prompts' cache with others sets its own
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # logits processors (ranges: SamplingParams'); logit_bias maps token ids, as JSON strings, to a bias
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=2.0)
    logit_bias: Annotated[dict[Annotated[str, Field(max_length=12)], Annotated[float, Field(ge=-100, le=100)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    min_tokens: int = Field(default=0, ge=0, le=INT32_MAX)
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    # structured outputs: at most one of these (OpenAI's response_format, vLLM's guided_*)
    response_format: ResponseFormat | None = None
    guided_json: dict | Annotated[str, Field(max_length=1 << 20)] | None = None
    guided_regex: str | None = Field(default=None, max_length=10_000)
    guided_choice: Annotated[list[Annotated[str, Field(max_length=MAX_CHOICE_CHARS)]],
                             Field(min_length=1, max_length=MAX_CHOICES)] | None = None
    # not implemented: declared so that asking for them is a 400 naming the field (UNSUPPORTED)
    prompt_logprobs: Unsupported = None
    functions: Unsupported = None
    function_call: Unsupported = None
    min_p: Unsupported = None
    best_of: Unsupported = None
    include_stop_str_in_output: Unsupported = None
    skip_special_tokens: Unsupported = None
    guided_grammar: Unsupported = None
    use_beam_search: Unsupported = None

    @field_validator(*(name for name in UNSUPPORTED if name != "suffix" and name not in TOOLS), mode="before")
    @classmethod
    def _unsupported(cls, v: object, info: ValidationInfo) -> object:
        if not any(v == neutral and isinstance(v, bool) == isinstance(neutral, bool)  # False is no 0 here
                   for neutral in UNSUPPORTED[info.field_name]):
            raise ValueError("not supported by this server")
        return None

    @property
    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling_args(self) -> dict:
        """The keyword arguments of Frontend.prepare that the body gives (not max_tokens, logprobs, structured)."""
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "seed": self.seed,
                "stop": self.stop_list, "n": self.n, "priority": self.priority, "ignore_eos": self.ignore_eos,
                "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                "repetition_penalty": self.repetition_penalty, "logit_bias": self.bias(),
                "min_tokens": self.min_tokens, "stop_token_ids": tuple(self.stop_token_ids or ()),
                "cache_salt": self.cache_salt}

    def bias(self) -> dict[int, float]:
        """logit_bias with its keys as token ids (their range is checked against the vocabulary in `prepare`)."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            if not (key.isascii() and key.isdigit()):
                raise APIError(400, f"logit_bias: keys must be token ids (non-negative integers), got {key[:20]!r}",
                               param="logit_bias", code="invalid_value")
            out[int(key)] = value
        return out

    def structured(self) -> tuple[StructuredOutput | None, str | None]:
        """The structured output asked for, and the field that asked (None, None: none)."""
        given = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            given.append(("response_format", StructuredOutput(json_object=True)))
        elif rf is not None and rf.type == "json_schema":
            given.append(("response_format", StructuredOutput(json_schema=rf.json_schema.schema_)))
        if self.guided_json is not None:
            given.append(("guided_json", StructuredOutput(json_schema=_schema(self.guided_json))))
        if self.guided_regex is not None:
            given.append(("guided_regex", StructuredOutput(regex=self.guided_regex)))
        if self.guided_choice is not None:
            given.append(("guided_choice", StructuredOutput(choice=tuple(self.guided_choice))))
        if len(given) > 1:
            raise APIError(400, f"give one structured output, not {' and '.join(p for p, _ in given)}",
                           param=given[1][0], code="invalid_value")
        return (given[0][1], given[0][0]) if given else (None, None)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


def _schema(v: dict | str) -> dict:
    """guided_json's schema, given as an object or as JSON text (vLLM takes both)."""
    if isinstance(v, dict):
        return v
    try:
        return parse_json_schema(v, "guided_json")  # bounded in depth: no RecursionError
    except InvalidRequest as e:
        raise APIError(400, str(e), param=e.param, code=e.code) from None


class CompletionRequest(_Sampling):
    prompt: str | list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(min_length=1)
    # OpenAI's default for completions; 0 only scores the prompt (echo with logprobs)
    max_tokens: int | None = Field(default=DEFAULT_MAX_TOKENS, ge=0, le=INT32_MAX)
    echo: bool = False
    logprobs: TopLogprobs | None = None  # the top alternatives per token (0: the chosen token's own only)
    suffix: Unsupported = None
    tools: Unsupported = None
    tool_choice: Unsupported = None
    parallel_tool_calls: Unsupported = None

    @property
    def logprobs_count(self) -> int | None:
        return self.logprobs

    @property
    def prompt_logprobs_count(self) -> int | None:
        """echo with logprobs returns the prompt's logprobs too (how evaluation harnesses score a prompt)."""
        return self.logprobs if self.echo else None

    @field_validator("suffix", *TOOLS, mode="before")
    @classmethod
    def _no_suffix(cls, v: object, info: ValidationInfo) -> object:
        return _Sampling._unsupported(v, info)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: object) -> object:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], (str, list)):
            return v[0]  # a batch of one
        if isinstance(v, list) and v and not all(isinstance(t, int) for t in v):
            raise ValueError("give one prompt: a string or a list of token ids (batches of prompts: send n requests)")
        return v


class TextPart(_Body):
    """A content part: only text parts are supported (an image part is a 400 naming it)."""

    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = Field(default=None, max_length=256)
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None  # an assistant's calls
    tool_call_id: str | None = Field(default=None, max_length=256)  # the call a tool message answers
    reasoning_content: str | None = None  # an assistant's reasoning, as this server returned it
    refusal: None = None  # OpenAI's client sends it back with an assistant message

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def template_dict(self, index: int) -> dict:
        """The message as the chat template takes it (calls' arguments as objects: deploy/serve/tools.py)."""
        out: dict = {"role": self.role, "content": self.text()}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [template_call(c, f"messages[{index}].tool_calls[{j}]")
                                 for j, c in enumerate(self.tool_calls)]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.reasoning_content is not None:
            out["reasoning_content"] = self.reasoning_content
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None  # needs logprobs: true
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def tool_plan(self) -> ToolPlan | None:
        """The tools' plan (deploy/serve/tools.py), the history checked against it: a 400 naming the field."""
        try:
            check_history(self.messages)
            return plan(self.tools, self.tool_choice, self.parallel_tool_calls)
        except ToolError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None

    def template_messages(self) -> list[dict]:
        try:
            return [m.template_dict(i) for i, m in enumerate(self.messages)]
        except ToolError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_value") from None

    @field_validator("top_logprobs")
    @classmethod
    def _top_with_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs `logprobs: true`")
        return v

    @property
    def logprobs_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def prompt_logprobs_count(self) -> None:
        return None

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


def choice(index: int, text: str, finish_reason: str | None, chat: bool, stats: SpecStats | None = None,
           logprobs: dict | None = None, message: dict | None = None) -> dict:
    body: dict = {"index": index, "finish_reason": finish_reason}
    if chat:
        body.update(message=message or {"role": "assistant", "content": text}, logprobs=logprobs)
    else:
        body.update(text=text, logprobs=logprobs)
    if stats is not None:
        body["spec_decode"] = spec_decode(stats)
    return body


def chunk_body(rid: str, model: str, created: int, index: int, text: str | None, finish_reason: str | None,
               chat: bool, first: bool = False, logprobs: dict | None = None, delta: dict | None = None) -> dict:
    if chat and delta is not None:  # a shaped delta (deploy/serve/chat_output.py): reasoning or tool calls
        c = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    elif chat:
        delta = {"role": "assistant", "content": text or ""} if first else ({"content": text} if text else {})
        c = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    else:
        c = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [c]}


def usage_chunk(rid: str, model: str, created: int, usage_: dict, stats: SpecStats, chat: bool) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage_, "spec_decode": spec_decode(stats)}


def model_list(models: dict[str, int]) -> dict:
    return {"object": "list", "data": [
        {"id": name, "object": "model", "created": 0, "owned_by": "specfleet", "max_model_len": n}
        for name, n in sorted(models.items())]}
