"""Tool calling over gRPC: a GenerateRequest's chat, tools and tool choice as the HTTP API checks them, and a shaped
answer (deploy/serve/chat_output.py) as GenerateResponse / GenerateChunk fields.

The request goes through the same models and checks as a chat completion (deploy/serve/openai_api.py's ChatMessage,
deploy/serve/tools.py's plan and history check), so a bad tool field is INVALID_ARGUMENT naming it as the HTTP 400
would (`tools[0].parameters`, `tool_choice.function`, `chat.messages[1].tool_call_id`).
"""

from __future__ import annotations

import json

from pydantic import ValidationError

from deploy.rpc import specfleet_pb2 as pb
from deploy.serve.openai_api import APIError, ChatMessage
from deploy.serve.tools import NamedToolChoice, Tool, ToolError, ToolPlan, check_history, plan


def _param(param: str) -> str:
    """A chat field's name as the gRPC request calls it."""
    if param.startswith("messages"):
        return "chat." + param
    if param.startswith("tools["):
        return param.replace(".function.", ".")
    return param.replace("tool_choice.function.name", "tool_choice.function")


def _tool(i: int, t: pb.FunctionTool) -> Tool:
    try:
        parameters = json.loads(t.parameters) if t.parameters else None
    except ValueError as e:
        raise APIError(400, f"tools[{i}].parameters: not JSON: {str(e)[:200]}", param=f"tools[{i}].parameters",
                       code="invalid_value") from None
    try:
        return Tool.model_validate({"type": "function", "function": {
            "name": t.name, "description": t.description or None, "parameters": parameters}})
    except ValidationError as e:
        raise APIError(400, f"tools[{i}]: {e.errors()[0]['msg']}", param=f"tools[{i}]", code="invalid_value") from None


def _choice(request: pb.GenerateRequest) -> str | NamedToolChoice | None:
    kind = request.tool_choice.WhichOneof("choice") if request.HasField("tool_choice") else None
    if kind == "function":
        return NamedToolChoice.model_validate({"type": "function", "function": {"name": request.tool_choice.function}})
    if kind == "mode":
        if request.tool_choice.mode not in ("none", "auto", "required"):
            raise APIError(400, "tool_choice.mode: one of none, auto, required", param="tool_choice.mode",
                           code="invalid_value")
        return request.tool_choice.mode
    return None


def _message(i: int, m: pb.ChatMessage) -> ChatMessage:
    body: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        body["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                              for c in m.tool_calls]
    for name in ("tool_call_id", "reasoning_content"):
        if m.HasField(name):
            body[name] = getattr(m, name)
    try:
        return ChatMessage.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(x) for x in err["loc"][:1])
        raise APIError(400, f"chat.messages[{i}].{where}: {err['msg']}", param=f"chat.messages[{i}].{where}",
                       code="invalid_value") from None


def chat_with_tools(request: pb.GenerateRequest) -> tuple[list[dict], ToolPlan | None]:
    """The chat's messages as the chat template takes them, and the tools' plan; a 400 naming the field at fault."""
    if not request.HasField("chat") and (request.tools or request.HasField("tool_choice")):
        raise APIError(400, "tools need chat input", param="tools", code="invalid_value")
    messages = [_message(i, m) for i, m in enumerate(request.chat.messages)]
    try:
        check_history(messages)
        parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else None
        plan_ = plan([_tool(i, t) for i, t in enumerate(request.tools)] or None, _choice(request), parallel)
        return [m.template_dict(i) for i, m in enumerate(messages)], plan_
    except ToolError as e:
        param = _param(e.param)
        raise APIError(400, f"{param}: {str(e).split(': ', 1)[-1]}", param=param, code="invalid_value") from None


def tool_call(index: int, call: dict) -> pb.ToolCall:
    """A whole call (chat_output's `tool_call` shape) as the proto's."""
    return pb.ToolCall(index=index, id=call["id"], name=call["function"]["name"],
                       arguments=call["function"]["arguments"])


def response_fields(message: dict) -> dict:
    """GenerateResponse's shaped fields of an assistant message (chat_output.ChatShape.message's)."""
    out: dict = {"content": message.get("content") or ""}
    if message.get("reasoning_content") is not None:
        out["reasoning_content"] = message["reasoning_content"]
    out["tool_calls"] = [tool_call(i, c) for i, c in enumerate(message.get("tool_calls") or ())]
    return out


def chunk_fields(deltas: list[dict]) -> dict:
    """GenerateChunk's shaped fields of one step's deltas (chat_output.ChatStream's), fragments of one call joined."""
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: list[pb.ToolCall] = []
    for d in deltas:
        for c in d.get("tool_calls", ()):
            fn = c["function"]
            if "id" not in c and calls and calls[-1].index == c["index"]:
                calls[-1].arguments += fn.get("arguments", "")
            else:
                calls.append(pb.ToolCall(index=c["index"], id=c.get("id", ""), name=fn.get("name", ""),
                                         arguments=fn.get("arguments", "")))
    out: dict = {"tool_calls": calls}
    if content:
        out["content"] = content
    if reasoning:
        out["reasoning_content"] = reasoning
    return out
