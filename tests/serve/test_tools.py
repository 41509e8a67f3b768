"""Tool calling and reasoning over real Ray Serve with the official client, speculation on (a draft model, k=3).

The served model is tests/fixtures/agent_model.py's: a tiny hermes-style chat model fitted so that its greedy answers
are a short agent script (call the weather tool; after the tool's result, think, then answer; call it twice in
parallel; say hello). Every answer here is the engine's own greedy decoding under the request's grammar; that the
script comes back token for token with a draft model proposing is speculation staying lossless on tool calls.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import grpc
import httpx
import jsonschema
import openai
import pytest
from transformers import AutoTokenizer

from tests.fixtures.agent_model import (AFTER_RESULT, ASK_BOTH, ASK_CHAT, ASK_WEATHER, CALL_WEATHER, SCRIPT, TOOLS,
                                        WEATHER, build_agent_model, encode)
from tests.fixtures.tiny_models import DRAFT_NOISE, perturbed_copy
from tests.serve.conftest import API_KEY, ServedApp, ports_of, served_in_place_of
from tests.unit.test_tool_calls import FUNCTION_SCHEMAS
from deploy.rpc import codegen

codegen.ensure()

from deploy.rpc import specfleet_pb2 as pb  # noqa: E402
from deploy.rpc import specfleet_pb2_grpc as pb_grpc  # noqa: E402

MODEL = "tiny-agent"


@pytest.fixture(scope="module")
def agent_app(served_app, ray_cluster, tmp_path_factory) -> Iterator[ServedApp]:
    """`specfleet serve` of the agent model with a draft (k=3), one instance; parsers detected from the template.
    Serve's proxies listen on the ports of the cluster's first app (the session's `served_app`), so this app takes
    its place on them for the module (a later test that needs the session's app serves it again)."""
    root = tmp_path_factory.mktemp("agent-models")
    target = build_agent_model(root / "target")
    draft = perturbed_copy(target, root / "draft", DRAFT_NOISE)
    http_port, grpc_port = ports_of(served_app)
    config = {
        "engine": {"model": {"target": str(target), "draft": str(draft), "name": MODEL},
                   "speculation": {"policy": "fixed", "k": 3},
                   "scheduler": {"max_batch_size": 8},
                   "cache": {"block_size": 4, "num_blocks": 2048}},
        "fleet": {"instances": 1, "instance_num_cpus": 0.5},
        "router": {"stats_interval_s": 0.2},
        "serve": {"http_port": http_port, "grpc_port": grpc_port, "auth": {"api_keys": [API_KEY]}},
    }
    with served_in_place_of(served_app, ray_cluster, config, tmp_path_factory.mktemp("agent-serve"), target) as app:
        yield app


@pytest.fixture(scope="module")
def client(agent_app: ServedApp) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{agent_app.url}/v1", api_key=API_KEY, timeout=120, max_retries=0)


def chat(client: openai.OpenAI, messages: list[dict], **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=120, **kw)


def streamed(client: openai.OpenAI, messages: list[dict], **kw) -> list:
    return [c for c in chat(client, messages, stream=True, **kw)]


def calls_of(chunks: list) -> tuple[list[dict], list[str]]:
    """The calls a stream's deltas add up to, and the order of what came (role, reasoning, content, call ...)."""
    calls: dict[int, dict] = {}
    order: list[str] = []
    for c in chunks:
        if not c.choices:
            continue
        d = c.choices[0].delta
        if d.role:
            order.append("role")
        if getattr(d, "reasoning_content", None):
            order.append("reasoning")
        if d.content:
            order.append("content")
        for t in d.tool_calls or ():
            if t.index not in calls:  # its first fragment names it, with its id, and no arguments yet
                assert t.id and t.type == "function" and t.function.name and not t.function.arguments
                calls[t.index] = {"id": t.id, "name": t.function.name, "arguments": ""}
                order.append(f"call{t.index}")
            else:
                assert t.id is None and t.function.name is None
                calls[t.index]["arguments"] += t.function.arguments
                order.append(f"args{t.index}")
    return [calls[i] for i in sorted(calls)], order


def test_auto_returns_the_scripted_call_whole_and_streamed(client) -> None:
    done = chat(client, ASK_WEATHER, tools=TOOLS)
    c = done.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    [call] = c.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}  # the script, decoded with a draft proposing
    chunks = streamed(client, ASK_WEATHER, tools=TOOLS, tool_choice="auto")
    calls, order = calls_of(chunks)
    assert [(x["name"], x["arguments"]) for x in calls] == [("get_weather", call.function.arguments)]
    assert order[:2] == ["role", "call0"] and set(order[2:]) == {"args0"} and len(order) > 3  # fragments
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_a_round_trip_call_result_answer_with_reasoning_split(client, agent_app: ServedApp) -> None:
    first = chat(client, ASK_WEATHER, tools=TOOLS).choices[0].message
    history = ASK_WEATHER + [first.model_dump(exclude_none=True),  # the client's own message object, sent back
                             {"role": "tool", "tool_call_id": first.tool_calls[0].id,
                              "content": AFTER_RESULT[-1]["content"]}]
    done = chat(client, history, tools=TOOLS)
    msg, want = done.choices[0].message, SCRIPT[1][2]
    assert done.choices[0].finish_reason == "stop" and not msg.tool_calls
    assert (msg.reasoning_content, msg.content) == ("Sunny, 21.", "It is sunny in Paris.")
    assert want == f"<think>{msg.reasoning_content}</think>\n\n{msg.content}"
    # the history went through the model's chat template with the tools (the prompt the script was fitted on)
    tokenizer = AutoTokenizer.from_pretrained(agent_app.target)
    history_ids = encode(tokenizer, ASK_WEATHER + [{"role": "assistant", "content": None, "tool_calls": [
        {**CALL_WEATHER, "id": first.tool_calls[0].id}]}, {**AFTER_RESULT[-1], "tool_call_id": first.tool_calls[0].id}],
        TOOLS)
    assert done.usage.prompt_tokens == len(history_ids)
    chunks = streamed(client, history, tools=TOOLS)
    _, order = calls_of(chunks)
    assert order[0] == "role" and order.index("content") > max(i for i, k in enumerate(order) if k == "reasoning")
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == msg.reasoning_content
    assert "".join(d.content or "" for d in deltas) == msg.content


def test_parallel_calls_and_parallel_tool_calls_false(client) -> None:
    both = chat(client, ASK_BOTH, tools=TOOLS).choices[0]
    assert both.finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in both.message.tool_calls] == [{"city": "Rome"}, {"city": "Oslo"}]
    assert len({c.id for c in both.message.tool_calls}) == 2
    calls, order = calls_of(streamed(client, ASK_BOTH, tools=TOOLS))
    assert [x["arguments"] for x in calls] == [c.function.arguments for c in both.message.tool_calls]
    assert order.index("call1") > max(i for i, k in enumerate(order) if k == "args0")  # one call after the other
    one = chat(client, ASK_BOTH, tools=TOOLS, parallel_tool_calls=False).choices[0]
    assert [json.loads(c.function.arguments) for c in one.message.tool_calls] == [{"city": "Rome"}]


def test_none_auto_required_and_named_on_a_turn_the_model_answers_in_text(client) -> None:
    text = SCRIPT[3][2]
    for choice in ("none", "auto"):
        c = chat(client, ASK_CHAT, tools=TOOLS, tool_choice=choice).choices[0]
        assert (c.finish_reason, c.message.content, c.message.tool_calls) == ("stop", text, None)
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        c = chat(client, ASK_CHAT, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False).choices[0]
        assert c.finish_reason == "tool_calls" and [t.function.name for t in c.message.tool_calls] == ["get_weather"]
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), WEATHER["function"]["parameters"])


def test_required_arguments_validate_against_20_schemas(client, agent_app: ServedApp) -> None:
    # the fitted model, shown tools it never saw, would reason first (the grammar lets it) at length: these requests
    # ask it not to, by a logit bias on `<think>`
    think = AutoTokenizer.from_pretrained(agent_app.target).convert_tokens_to_ids("<think>")
    for i, schema in enumerate(FUNCTION_SCHEMAS):
        tools = [{"type": "function", "function": {"name": f"fn_{i}", "parameters": schema}}]
        c = chat(client, ASK_CHAT, tools=tools, tool_choice="required", parallel_tool_calls=False,
                 logit_bias={str(think): -100}).choices[0]
        assert c.finish_reason == "tool_calls", c.message
        [call] = c.message.tool_calls
        assert call.function.name == f"fn_{i}"
        jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "no-such-type"}}}}}]}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
    ({"tools": TOOLS, "messages": ASK_WEATHER + [{"role": "tool", "tool_call_id": "call_x", "content": "r"}]},
     "messages[1].tool_call_id"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}, "tool_choice": "required"}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_fields_are_400s_naming_the_field(agent_app: ServedApp, body: dict, param: str) -> None:
    with httpx.Client(base_url=agent_app.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as h:
        r = h.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK_WEATHER, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_peer_tool_fields_continuous_usage_content_parts_max_completion_tokens(client) -> None:
    """What guidellm sends: usage in every chunk, content as text parts, max_completion_tokens, ignore_eos."""
    parts = [{"role": "user", "content": [{"type": "text", "text": "Say "}, {"type": "text", "text": "hello."}]}]
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=parts, tools=TOOLS, tool_choice="none", temperature=0, max_completion_tokens=30, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"ignore_eos": True}))
    with_choices = [c for c in chunks if c.choices]
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in with_choices]
    assert counts == sorted(counts) and chunks[-1].usage.completion_tokens == 30  # ignore_eos: past the script's end
    assert "".join(c.choices[0].delta.content or "" for c in with_choices).startswith(SCRIPT[3][2])
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


# ---- the Responses API (stateless), through the same app --------------------------------------------------------
FLAT_TOOLS = [{"type": "function", **WEATHER["function"]}]  # the Responses API writes tools flat


def test_responses_api_call_then_answer_whole(client) -> None:
    first = client.responses.create(model=MODEL, input=ASK_WEATHER[0]["content"], tools=FLAT_TOOLS, temperature=0,
                                    max_output_tokens=120)
    assert first.status == "completed" and [o.type for o in first.output] == ["function_call"]
    call = first.output[0]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert first.usage.output_tokens > 0 and first.usage.total_tokens == first.usage.input_tokens + first.usage.output_tokens
    history = [{"role": "user", "content": ASK_WEATHER[0]["content"]}, call.model_dump(exclude_none=True),
               {"type": "function_call_output", "call_id": call.call_id, "output": AFTER_RESULT[-1]["content"]}]
    answer = client.responses.create(model=MODEL, input=history, tools=FLAT_TOOLS, temperature=0,
                                     max_output_tokens=120)
    assert [o.type for o in answer.output] == ["reasoning", "message"]
    assert answer.output[0].content[0].text == "Sunny, 21."
    assert answer.output_text == "It is sunny in Paris."


def test_responses_api_streams_typed_events_in_order(client) -> None:
    events = list(client.responses.create(model=MODEL, input=ASK_BOTH[0]["content"], tools=FLAT_TOOLS, temperature=0,
                                          max_output_tokens=120, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    per_call = [k for k in kinds if k.startswith("response.output_item") or k.endswith("arguments.done")]
    assert per_call == ["response.output_item.added", "response.function_call_arguments.done",
                        "response.output_item.done"] * 2
    final = events[-1].response
    assert [json.loads(o.arguments) for o in final.output] == [{"city": "Rome"}, {"city": "Oslo"}]
    for i, item in enumerate(final.output):
        fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                     and e.output_index == i]
        assert len(fragments) > 1 and "".join(fragments) == item.arguments
    assert final.usage.output_tokens > 0


def test_responses_api_text_streams_and_previous_response_id_is_refused(client, agent_app: ServedApp) -> None:
    events = list(client.responses.create(model=MODEL, input=ASK_CHAT[0]["content"], tools=FLAT_TOOLS,
                                          temperature=0, stream=True))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == SCRIPT[3][2] == events[-1].response.output_text
    with httpx.Client(base_url=agent_app.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60) as h:
        r = h.post("/v1/responses", json={"model": MODEL, "input": "hi", "previous_response_id": "resp_1"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "previous_response_id"
        r = h.post("/v1/responses", json={"model": MODEL, "input": [
            {"type": "function_call_output", "call_id": "nope", "output": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].tool_call_id", r.text


# ---- a real client as users run it: the OpenAI Agents SDK, through both of its model APIs -----------------------
@pytest.mark.parametrize("api", ["chat_completions", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_openai_agents_sdk_runs_an_agent_with_a_function_tool(agent_app: ServedApp, api: str, stream: bool) -> None:
    """The Agents SDK's runner (its Chat Completions model, or its Responses model) asks, the scripted model calls
    the weather tool, the SDK runs the tool and sends its result back, the model answers: the agent's final output is
    the script's answer, and the tool got arguments that validate against its schema."""
    import asyncio

    import agents

    agents.set_tracing_disabled(True)  # the SDK would export traces to OpenAI's servers
    called: list[str] = []

    async def get_weather(ctx, arguments: str) -> str:
        called.append(arguments)
        return AFTER_RESULT[-1]["content"]

    tool = agents.FunctionTool(name="get_weather", description=WEATHER["function"]["description"],
                               params_json_schema=WEATHER["function"]["parameters"], on_invoke_tool=get_weather)

    async def run() -> agents.RunResult | agents.RunResultStreaming:
        async with openai.AsyncOpenAI(base_url=f"{agent_app.url}/v1", api_key=API_KEY, timeout=120,
                                      max_retries=0) as client:
            return await run_with(client)

    async def run_with(client: openai.AsyncOpenAI) -> agents.RunResult | agents.RunResultStreaming:
        model = (agents.OpenAIChatCompletionsModel(MODEL, client) if api == "chat_completions"
                 else agents.OpenAIResponsesModel(MODEL, client))
        agent = agents.Agent(name="weather", model=model, tools=[tool],
                             model_settings=agents.ModelSettings(temperature=0, max_tokens=120))
        if not stream:
            return await agents.Runner.run(agent, ASK_WEATHER[0]["content"], max_turns=3)
        result = agents.Runner.run_streamed(agent, ASK_WEATHER[0]["content"], max_turns=3)
        kinds = {e.type async for e in result.stream_events()}
        assert "raw_response_event" in kinds  # the model's own events came through as they streamed
        return result

    result = asyncio.run(run())
    assert result.final_output == "It is sunny in Paris."  # the model's answer to the tool's result
    assert len(called) == 1
    jsonschema.validate(json.loads(called[0]), WEATHER["function"]["parameters"])
    assert json.loads(called[0]) == {"city": "Paris"}
    assert len(result.raw_responses) == 2  # one model call for the tool call, one for the answer


# ---- guidellm 0.8's requests, as its OpenAI backend writes them (guidellm/backends/openai/request_handlers.py) ------
# guidellm itself is not installed in the test environment (docs/serving.md says why); these are its bodies verbatim
GUIDELLM_STREAM = {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}


def sse_data(h: httpx.Client, path: str, body: dict) -> list[dict]:
    with h.stream("POST", path, json=body) as r:
        r.read()
        assert r.status_code == 200, r.text
    lines = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    if path != "/v1/responses":
        assert lines[-1] == "[DONE]"
        lines = lines[:-1]
    return [json.loads(line) for line in lines]


def test_guidellm_request_shapes_fixed_length_text_on_every_endpoint(agent_app: ServedApp) -> None:
    """guidellm's synthetic-data runs: a fixed output length (`ignore_eos`, `stop: null`), streamed with usage in
    every chunk; its startup checks first (GET /health, GET /v1/models)."""
    n = 24
    with agent_app.client() as h:
        assert h.get("/health").status_code == 200
        assert [m["id"] for m in h.get("/v1/models").json()["data"]] == [MODEL]
        completions = sse_data(h, "/v1/completions", {"model": MODEL, **GUIDELLM_STREAM, "max_tokens": n,
                                                      "stop": None, "ignore_eos": True, "prompt": "Say hello."})
        chat_ = sse_data(h, "/v1/chat/completions", {
            "model": MODEL, **GUIDELLM_STREAM, "max_completion_tokens": n, "stop": None, "ignore_eos": True,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "Say hello."}]}]})
        for chunks in (completions, chat_):
            assert all(c["usage"] is not None for c in chunks)  # continuous_usage_stats
            assert chunks[-1]["usage"]["completion_tokens"] == n
        events = sse_data(h, "/v1/responses", {
            "model": MODEL, "stream": True, "max_output_tokens": n, "stop": None, "ignore_eos": True,
            "instructions": "Be brief.", "input": [{"role": "user", "content": [{"type": "input_text",
                                                                                   "text": "Say hello."}]}]})
    # cut at max_output_tokens: the terminal event is `response.incomplete` (guidellm reads usage from either)
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["usage"]["output_tokens"] == n


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_guidellm_request_shapes_tool_call_turn_then_injected_result(agent_app: ServedApp, path: str) -> None:
    """guidellm's tool-calling runs: a turn with the dataset's tools and `tool_choice: required` (its token limits
    and `ignore_eos` dropped), then the injection turn: the history as guidellm rebuilds it with its synthetic tool
    result, `{"status": "ok"}`, and no tools."""
    chat_path = path == "/v1/chat/completions"
    ask = ([{"role": "user", "content": [{"type": "text", "text": ASK_WEATHER[0]["content"]}]}] if chat_path else
           [{"role": "user", "content": [{"type": "input_text", "text": ASK_WEATHER[0]["content"]}]}])
    tools = TOOLS if chat_path else FLAT_TOOLS
    field_ = "messages" if chat_path else "input"
    stream = GUIDELLM_STREAM if chat_path else {"stream": True}
    with agent_app.client() as h:
        first = sse_data(h, path, {"model": MODEL, **stream, field_: ask, "tools": tools, "tool_choice": "required"})
        if chat_path:
            calls, _ = calls_of([openai.types.chat.ChatCompletionChunk.model_validate(c) for c in first])
            [call] = calls
            history = ask + [{"role": "assistant", "content": "", "tool_calls": [
                {"id": call["id"], "type": "function", "function": {"name": call["name"],
                                                                    "arguments": call["arguments"]}}]},
                {"role": "tool", "tool_call_id": call["id"], "content": '{"status": "ok"}'}]
        else:
            [item] = first[-1]["response"]["output"]
            call = {"id": item["call_id"], "name": item["name"], "arguments": item["arguments"]}
            history = ask + [{"type": "function_call", "call_id": item["call_id"], "name": item["name"],
                              "arguments": item["arguments"]},
                             {"type": "function_call_output", "call_id": item["call_id"], "output": '{"status": "ok"}'}]
        assert call["name"] == "get_weather"
        jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])
        limit = "max_completion_tokens" if chat_path else "max_output_tokens"
        second = sse_data(h, path, {"model": MODEL, **stream, field_: history, limit: 16, "stop": None,
                                    "ignore_eos": True})
    if chat_path:
        assert second[-1]["usage"]["completion_tokens"] == 16
        assert all(c["usage"] is not None for c in second)
    else:
        assert second[-1]["type"] == "response.incomplete"
        assert second[-1]["response"]["usage"]["output_tokens"] == 16


# ---- over gRPC: the same tools, calls and reasoning in the proto's fields ------------------------------------------
GRPC_TOOLS = [pb.FunctionTool(name="get_weather", description=WEATHER["function"]["description"],
                              parameters=json.dumps(WEATHER["function"]["parameters"]))]


def grpc_chat(messages: list[dict]) -> pb.ChatMessages:
    out = []
    for m in messages:
        calls = [pb.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
                 for c in m.get("tool_calls") or ()]
        out.append(pb.ChatMessage(role=m["role"], content=m.get("content") or "", tool_calls=calls,
                                  tool_call_id=m.get("tool_call_id")))
    return pb.ChatMessages(messages=out)


def test_grpc_tool_call_round_trip_whole_and_streamed(agent_app: ServedApp) -> None:
    auth = (("authorization", f"Bearer {API_KEY}"),)
    with grpc.insecure_channel(agent_app.grpc_target) as channel:
        stub = pb_grpc.SpecfleetStub(channel)
        ask = pb.GenerateRequest(model=MODEL, chat=grpc_chat(ASK_WEATHER), tools=GRPC_TOOLS, max_tokens=120,
                                 temperature=0)
        reply = stub.Generate(ask, metadata=auth, timeout=120)
        assert reply.finish_reason == "tool_calls" and reply.content == "" and reply.text == SCRIPT[0][2]
        [call] = reply.tool_calls
        assert call.id.startswith("call_") and call.name == "get_weather" and json.loads(call.arguments) == {
            "city": "Paris"}
        chunks = list(stub.GenerateStream(ask, metadata=auth, timeout=120))
        fragments = [t for c in chunks for t in c.tool_calls]
        assert fragments[0].name == "get_weather" and fragments[0].id and not fragments[0].arguments
        assert all(not f.id and not f.name for f in fragments[1:]) and len(fragments) > 2
        assert "".join(f.arguments for f in fragments) == call.arguments
        assert chunks[-1].finish_reason == "tool_calls"
        # the call and the tool's result back in the history: the model reasons, then answers
        history = ASK_WEATHER + [{"role": "assistant", "content": "", "tool_calls": [
            {"id": call.id, "function": {"name": call.name, "arguments": call.arguments}}]},
            {"role": "tool", "tool_call_id": call.id, "content": AFTER_RESULT[-1]["content"]}]
        answer = stub.Generate(pb.GenerateRequest(model=MODEL, chat=grpc_chat(history), tools=GRPC_TOOLS,
                                                  max_tokens=120, temperature=0), metadata=auth, timeout=120)
        assert answer.finish_reason == "stop" and not answer.tool_calls
        assert (answer.reasoning_content, answer.content) == ("Sunny, 21.", "It is sunny in Paris.")
        named = stub.Generate(pb.GenerateRequest(model=MODEL, chat=grpc_chat(ASK_CHAT), tools=GRPC_TOOLS,
                                                 tool_choice=pb.ToolChoice(function="get_weather"), max_tokens=120,
                                                 temperature=0),
                              metadata=auth, timeout=120)
        assert [c.name for c in named.tool_calls] == ["get_weather"]
        jsonschema.validate(json.loads(named.tool_calls[0].arguments), WEATHER["function"]["parameters"])
        for bad, param in ((pb.GenerateRequest(model=MODEL, chat=grpc_chat(ASK_WEATHER), tools=GRPC_TOOLS,
                                               tool_choice=pb.ToolChoice(function="nope")), "tool_choice.function"),
                           (pb.GenerateRequest(model=MODEL, chat=grpc_chat(ASK_WEATHER), tools=[
                               pb.FunctionTool(name="f", parameters='{"type": "no-such-type"}')]),
                            "tools[0].parameters"),
                           (pb.GenerateRequest(model=MODEL, prompt="hi", tools=GRPC_TOOLS), "tools")):
            with pytest.raises(grpc.RpcError) as err:
                stub.Generate(bad, metadata=auth, timeout=60)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and err.value.details().startswith(param)
