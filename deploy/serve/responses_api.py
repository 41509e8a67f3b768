"""The OpenAI Responses API (`POST /v1/responses`), stateless, served through the Chat Completions path.

A Responses body becomes a chat body (`to_chat`): `instructions` a system message; `input` a string (one user
message) or items: messages (`input_text` / `output_text` parts), `function_call` items (an assistant's calls) and
`function_call_output` items (tool messages, by `call_id`); `reasoning` items are accepted and left out of the
prompt. Function tools (`{"type": "function", "name", "parameters"}`, flat as the Responses API writes them),
`tool_choice`, `parallel_tool_calls`, `max_output_tokens`, `temperature`, `top_p`, vLLM's `stop` and `ignore_eos`
(which guidellm sends) and `text.format` (text, a JSON schema) map onto their chat fields. Nothing is stored: `previous_response_id` is a 400 (send the whole input), and
`store` is accepted but changes nothing (a response cannot be fetched again). The answer comes back as output items
(`reasoning`, `message` with `output_text`, `function_call`) and, streamed, as the typed events
`response.created`, `response.in_progress`, `response.output_item.added`, `response.content_part.added`,
`response.output_text.delta`, `response.reasoning_text.delta`, `response.function_call_arguments.delta`, their
`.done` events, and `response.completed` (or `response.incomplete`) with the whole response and its usage.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from deploy.serve.openai_api import INT32_MAX, MAX_STOPS, APIError, StopString

Text = Annotated[str, Field(max_length=1 << 22)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class _Lenient(BaseModel):
    """Items as clients send them back: the ids and statuses the server gave are accepted and not needed."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)


class ContentPart(_Lenient):
    type: Literal["input_text", "output_text", "text"]
    text: Text


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[ContentPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(max_length=64)
    arguments: Text


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: Text


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]


def _item_type(v: object) -> str:
    """An input item's kind: its `type`, `message` when it has none (the Responses API's short message form)."""
    return (v.get("type") if isinstance(v, dict) else getattr(v, "type", None)) or "message"


InputItem = Annotated[Annotated[MessageItem, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
                      | Annotated[ReasoningItem, Tag("reasoning")], Discriminator(_item_type)]


class FunctionTool(_Body):
    type: Literal["function"]
    name: str = Field(max_length=64)
    description: str | None = Field(default=None, max_length=16_384)
    parameters: dict | None = None
    strict: bool | None = None


class NamedFunction(_Body):
    type: Literal["function"]
    name: str = Field(max_length=64)


class TextFormat(_Body):
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = Field(default=None, max_length=256)
    schema_: dict | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextOptions(_Body):
    format: TextFormat | None = None


class ResponsesRequest(_Body):
    model: str = Field(max_length=256)
    input: Text | Annotated[list[InputItem], Field(min_length=1, max_length=4096)]
    instructions: Text | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float | None = None
    top_p: float | None = None
    # vLLM's extensions that load tools send (guidellm 0.8: `"stop": null, "ignore_eos": true` for fixed lengths)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    ignore_eos: bool | None = None
    stream: bool = False
    store: bool | None = None  # accepted: nothing is stored
    previous_response_id: str | None = None  # refused (nothing is stored): see `check`
    text: TextOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    metadata: dict[str, str] | None = None  # echoed back
    truncation: Literal["disabled"] | None = None
    include: Annotated[list[str], Field(max_length=0)] | None = None
    reasoning: None = None

    def check(self) -> None:
        if self.previous_response_id is not None:
            raise APIError(400, "previous_response_id: this server stores no responses; send the whole conversation "
                                "as `input`", param="previous_response_id", code="unsupported_parameter")

    def to_chat(self) -> dict[str, Any]:
        """The chat body that asks for the same thing."""
        messages: list[dict] = []
        if self.instructions is not None:
            messages.append({"role": "system", "content": self.instructions})
        items = [MessageItem(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, MessageItem):
                messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                    last["tool_calls"].append(call)
                elif last is not None and last["role"] == "assistant":
                    last["tool_calls"] = [call]
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        body: dict[str, Any] = {"model": self.model, "messages": messages, "stream": self.stream}
        if self.tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice if isinstance(self.tool_choice, str) else {
                "type": "function", "function": {"name": self.tool_choice.name}}
        for ours, theirs in (("parallel_tool_calls", "parallel_tool_calls"), ("max_output_tokens", "max_tokens"),
                             ("temperature", "temperature"), ("top_p", "top_p"), ("user", "user"),
                             ("stop", "stop"), ("ignore_eos", "ignore_eos")):
            if getattr(self, ours) is not None:
                body[theirs] = getattr(self, ours)
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name or "output", "schema": fmt.schema_ or {}, "strict": fmt.strict}}
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body


def chat_param(param: str | None) -> str | None:
    """A chat field's name as the Responses body calls it."""
    if param is None:
        return None
    for chat, ours in (("messages", "input"), ("max_tokens", "max_output_tokens"), ("response_format", "text.format")):
        if param.startswith(chat):
            return ours + param[len(chat):]
    return param.replace(".function.", ".") if param.startswith("tools[") else param


def usage(prompt: int, completion: int) -> dict:
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}


def response_body(rid: str, body: ResponsesRequest, created: int, status: str, output: list[dict],
                  usage_: dict | None, incomplete: str | None = None) -> dict:
    return {"id": rid, "object": "response", "created_at": created, "status": status, "model": body.model,
            "output": output, "usage": usage_, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.instructions, "metadata": body.metadata or {},
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or ()],
            "tool_choice": (body.tool_choice or "auto") if isinstance(body.tool_choice, str) or body.tool_choice is None
            else body.tool_choice.model_dump(), "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
            "previous_response_id": None, "store": False, "truncation": "disabled",
            "text": {"format": {"type": "text"}}}


def output_items(message: dict) -> list[dict]:
    """A chat message (chat_output.ChatShape's) as Responses output items."""
    items = []
    if message.get("reasoning_content"):
        items.append({"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [],
                      "content": [{"type": "reasoning_text", "text": message["reasoning_content"]}]})
    if message.get("content"):
        items.append(_message_item(f"msg_{uuid.uuid4().hex}", message["content"], "completed"))
    for call in message.get("tool_calls") or ():
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def _message_item(item_id: str, text: str, status: str) -> dict:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}] if status == "completed" else []}


class EventStream:
    """Chat deltas (chat_output.ChatStream's) in, the Responses API's typed events out, each numbered."""

    def __init__(self, rid: str, body: ResponsesRequest) -> None:
        self.rid, self.body, self.created = rid, body, int(time.time())
        self.seq = 0
        self.items: list[dict] = []  # output items, as they complete
        self._open: dict | None = None  # the item being written: {"kind", "id", "index", "text", ...}
        self._calls: dict[int, dict] = {}  # chat call index -> its open item

    def _event(self, type_: str, **fields) -> dict:
        self.seq += 1
        return {"type": type_, "sequence_number": self.seq - 1, **fields}

    def start(self) -> list[dict]:
        shell = response_body(self.rid, self.body, self.created, "in_progress", [], None)
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def delta(self, d: dict) -> list[dict]:
        out: list[dict] = []
        if d.get("reasoning_content"):
            out += self._text("reasoning", d["reasoning_content"])
        if d.get("content"):
            out += self._text("message", d["content"])
        for call in d.get("tool_calls") or ():
            if call["index"] not in self._calls:
                out += self._close()
                item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                        "name": call["function"]["name"], "arguments": "", "status": "in_progress"}
                self._open = {"kind": "call", "item": item, "index": len(self.items)}
                self._calls[call["index"]] = self._open
                out.append(self._event("response.output_item.added", output_index=len(self.items), item=dict(item)))
            fragment = call["function"].get("arguments") or ""
            if fragment:
                state = self._calls[call["index"]]
                state["item"]["arguments"] += fragment
                out.append(self._event("response.function_call_arguments.delta", item_id=state["item"]["id"],
                                       output_index=state["index"], delta=fragment))
        return out

    def _text(self, kind: str, text: str) -> list[dict]:
        out: list[dict] = []
        if self._open is None or self._open["kind"] != kind:
            out += self._close()
            item_id = f"{'rs' if kind == 'reasoning' else 'msg'}_{uuid.uuid4().hex}"
            self._open = {"kind": kind, "id": item_id, "index": len(self.items), "text": ""}
            if kind == "message":
                out.append(self._event("response.output_item.added", output_index=len(self.items),
                                       item=_message_item(item_id, "", "in_progress")))
                out.append(self._event("response.content_part.added", item_id=item_id, output_index=len(self.items),
                                       content_index=0, part={"type": "output_text", "text": "", "annotations": []}))
            else:
                out.append(self._event("response.output_item.added", output_index=len(self.items), item={
                    "type": "reasoning", "id": item_id, "summary": [], "content": []}))
        self._open["text"] += text
        kind_event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        out.append(self._event(kind_event, item_id=self._open["id"], output_index=self._open["index"],
                               content_index=0, delta=text))
        return out

    def _close(self) -> list[dict]:
        """The open item's done events."""
        o, self._open = self._open, None
        if o is None:
            return []
        if o["kind"] == "message":
            item = _message_item(o["id"], o["text"], "completed")
            events = [self._event("response.output_text.done", item_id=o["id"], output_index=o["index"],
                                  content_index=0, text=o["text"]),
                      self._event("response.content_part.done", item_id=o["id"], output_index=o["index"],
                                  content_index=0, part=item["content"][0])]
        elif o["kind"] == "reasoning":
            item = {"type": "reasoning", "id": o["id"], "summary": [],
                    "content": [{"type": "reasoning_text", "text": o["text"]}]}
            events = [self._event("response.reasoning_text.done", item_id=o["id"], output_index=o["index"],
                                  content_index=0, text=o["text"])]
        else:
            item = {**o["item"], "status": "completed"}
            events = [self._event("response.function_call_arguments.done", item_id=item["id"],
                                  output_index=o["index"], arguments=item["arguments"])]
        self.items.append(item)
        return events + [self._event("response.output_item.done", output_index=o["index"], item=item)]

    def finish(self, finish_reason: str | None, usage_: dict) -> list[dict]:
        out = self._close()
        incomplete = "max_output_tokens" if finish_reason == "length" else None
        status = "incomplete" if incomplete else "completed"
        final = response_body(self.rid, self.body, self.created, status, self.items, usage_, incomplete)
        return out + [self._event(f"response.{status}", response=final)]


def sse(event: dict) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"
