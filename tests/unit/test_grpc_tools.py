"""Tool calling's gRPC fields (deploy/serve/grpc_tools.py): a request's chat and tools checked as the HTTP API checks
them, errors naming the gRPC field, and a shaped answer's deltas as chunk fields."""

from __future__ import annotations

import json

import pytest

from deploy.rpc import codegen

codegen.ensure()

from deploy.rpc import specfleet_pb2 as pb  # noqa: E402
from deploy.serve.chat_output import ChatShape  # noqa: E402
from deploy.serve.grpc_tools import chat_with_tools, chunk_fields, response_fields  # noqa: E402
from deploy.serve.openai_api import APIError  # noqa: E402
from deploy.serve.tool_parsers import HermesParser  # noqa: E402

PARAMS = json.dumps({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TOOL = pb.FunctionTool(name="get_weather", description="Weather now.", parameters=PARAMS)


def chat(*messages: pb.ChatMessage, **kw) -> pb.GenerateRequest:
    return pb.GenerateRequest(model="m", chat=pb.ChatMessages(messages=list(messages)), **kw)


def test_chat_and_tools_become_template_messages_and_a_plan() -> None:
    call = pb.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')
    request = chat(pb.ChatMessage(role="user", content="Weather?"),
                   pb.ChatMessage(role="assistant", tool_calls=[call]),
                   pb.ChatMessage(role="tool", tool_call_id="call_1", content="sunny"), tools=[TOOL],
                   tool_choice=pb.ToolChoice(function="get_weather"), parallel_tool_calls=True)
    messages, plan = chat_with_tools(request)
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}  # as templates take them
    assert messages[2] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert plan.mode == "named" and not plan.parallel and [t.function.name for t in plan.callable_] == ["get_weather"]
    assert chat_with_tools(chat(pb.ChatMessage(role="user", content="hi")))[1] is None  # no tools: plain chat


@pytest.mark.parametrize("request_,param", [
    (chat(pb.ChatMessage(role="user", content="x"), tools=[TOOL], tool_choice=pb.ToolChoice(function="nope")),
     "tool_choice.function"),
    (chat(pb.ChatMessage(role="user", content="x"), tools=[pb.FunctionTool(name="f", parameters="{not json")]),
     "tools[0].parameters"),
    (chat(pb.ChatMessage(role="user", content="x"),
          tools=[pb.FunctionTool(name="f", parameters='{"type": "no-such-type"}')]), "tools[0].parameters"),
    (chat(pb.ChatMessage(role="user", content="x"), pb.ChatMessage(role="tool", tool_call_id="c9", content="r"),
          tools=[TOOL]), "chat.messages[1].tool_call_id"),
    (chat(pb.ChatMessage(role="robot", content="x")), "chat.messages[0].role"),
    (chat(pb.ChatMessage(role="user", content="x"), tools=[TOOL], tool_choice=pb.ToolChoice(mode="sometimes")),
     "tool_choice.mode"),
    (pb.GenerateRequest(model="m", prompt="hi", tools=[TOOL]), "tools"),
])
def test_bad_tool_fields_name_the_grpc_field(request_: pb.GenerateRequest, param: str) -> None:
    with pytest.raises(APIError) as e:
        chat_with_tools(request_)
    assert e.value.status == 400 and e.value.param == param and e.value.message.startswith(param)


def test_a_shaped_answer_as_response_and_chunk_fields() -> None:
    shape = ChatShape(HermesParser(), None)
    text = 'Looking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    message, called = shape.message(text)
    whole = pb.GenerateResponse(**response_fields(message))
    assert called and whole.content == "Looking." and [(c.index, c.name) for c in whole.tool_calls] == [
        (0, "get_weather")]
    stream, chunks = shape.stream(), []
    for at in range(0, len(text), 9):
        chunks.append(pb.GenerateChunk(**chunk_fields(stream.feed(text[at:at + 9]))))
    chunks.append(pb.GenerateChunk(**chunk_fields(stream.finish())))
    fragments = [c for chunk in chunks for c in chunk.tool_calls]
    assert fragments[0].id.startswith("call_") and fragments[0].name == "get_weather"
    assert all(not f.id and not f.name for f in fragments[1:])
    assert "".join(f.arguments for f in fragments) == whole.tool_calls[0].arguments
    assert "".join(c.content for c in chunks) == "Looking."
