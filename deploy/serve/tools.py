"""Chat Completions tool calling: the request's tools and tool choice, checked; the history for the chat template; the
grammar a call decodes under.

OpenAI's function tools (`tools`, `tool_choice`, `parallel_tool_calls`) become one `ToolPlan`:
- `none`: the tools are shown to the template, the output is text;
- `auto`: the model writes text or calls in its own format (deploy/serve/tool_parsers.py), under a grammar that
  lets it write any text that does not open a call, and holds a call, once opened, to its tool's schema;
- `required` and a named function: the output is calls (the named one: exactly one call of it), under the grammar.
The grammar is Lark for llguidance (actors/speculation/structured.py), so speculation stays lossless as for any
structured output. A reasoning model's grammar lets its reasoning come first (deploy/serve/reasoning.py).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

import jsonschema
from pydantic import BaseModel, ConfigDict, Field

from cluster.request import StructuredOutput
from deploy.serve.reasoning import Reasoner
from deploy.serve.tool_parsers import JSON_LAYOUT, ToolParser

MAX_TOOLS = 128


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class FunctionDef(_Body):
    """A function tool: its name, what it does, and its parameters' JSON schema (none: no parameters)."""

    name: str = Field(pattern=r"^[a-zA-Z0-9_.\-]{1,64}$")
    description: str | None = Field(default=None, max_length=16_384)
    parameters: dict | None = None
    strict: bool | None = None  # accepted: arguments always match the schema


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Body):
    name: str = Field(max_length=64)


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(_Body):
    name: str = Field(max_length=64)
    arguments: Annotated[str, Field(max_length=1 << 20)] | dict  # JSON text as OpenAI sends it (an object: LangChain)


class ToolCall(_Body):
    """A call in an assistant message of the history."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


Tools = Annotated[list[Tool], Field(max_length=MAX_TOOLS)]


class ToolError(ValueError):
    """A tool field the client got wrong: the message and the field (a 400 naming it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def parameters_of(tool: Tool) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object", "properties": {}}


def check_tools(tools: list[Tool]) -> None:
    """Each tool's parameters are a valid JSON schema (by its own `$schema`'s metaschema, default 2020-12) of an
    object, and the names are distinct."""
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        param = f"tools[{i}].function.parameters"
        schema = parameters_of(tool)
        try:
            jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator).check_schema(schema)
        except jsonschema.SchemaError as e:
            raise ToolError(f"{param}: not a valid JSON schema: {e.message[:300]}", param) from None
        except RecursionError:
            raise ToolError(f"{param}: the schema is nested too deeply", param) from None
        except (TypeError, ValueError) as e:  # e.g. a `$schema` that is no string
            raise ToolError(f"{param}: not a valid JSON schema: {str(e)[:300]}", param) from None
        if schema.get("type", "object") != "object":
            raise ToolError(f"{param}: a function's parameters are an object schema (\"type\": \"object\")", param)
        if tool.function.name in seen:
            raise ToolError(f"tools[{i}].function.name: {tool.function.name!r} is given twice",
                            f"tools[{i}].function.name")
        seen.add(tool.function.name)


class ToolPlan(BaseModel):
    """What a request's tools ask of the output: the mode, the tools a call may use, parallel calls."""

    model_config = ConfigDict(frozen=True)

    mode: Literal["none", "auto", "required", "named"]
    tools: tuple[Tool, ...]  # all the request's tools (shown to the template)
    callable_: tuple[Tool, ...]  # those a call may name
    parallel: bool


def plan(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolPlan | None:
    """The request's ToolPlan (None: no tools), its fields checked (a ToolError names the one at fault)."""
    if not tools:
        if choice not in (None, "none", "auto"):
            raise ToolError("tool_choice: needs `tools`", "tool_choice")
        return None
    check_tools(tools)
    if isinstance(choice, NamedToolChoice):
        named = [t for t in tools if t.function.name == choice.function.name]
        if not named:
            raise ToolError(f"tool_choice.function.name: {choice.function.name!r} is not one of the tools",
                            "tool_choice.function.name")
        return ToolPlan(mode="named", tools=tuple(tools), callable_=tuple(named), parallel=False)
    mode = choice or "auto"  # OpenAI's default when tools are given
    return ToolPlan(mode=mode, tools=tuple(tools), callable_=tuple(tools), parallel=parallel is not False)


def grammar(plan_: ToolPlan, parser: ToolParser, special: dict[str, int], reasoner: Reasoner | None = None,
            inside_reasoning: bool = False) -> StructuredOutput | None:
    """The Lark grammar the output decodes under (None for `none`): calls in the parser's format, each call's JSON
    held to its tool's schema; in auto mode, or text that opens no call; after the reasoning of a reasoning model."""
    if plan_.mode == "none":
        return None
    schemas = [parser.call_schema(t.function.name, parameters_of(t)) for t in plan_.callable_]
    rules = [parser.calls_rule(schemas, plan_.parallel, special)]
    if plan_.mode == "auto":
        rules += [parser.auto_body(special), parser.text_rule()]
    else:
        rules.append("body: calls")
    return StructuredOutput(lark=with_start(rules, reasoner, inside_reasoning, special))


def with_start(rules: list[str], reasoner: Reasoner | None, inside: bool, special: dict[str, int]) -> str:
    """A grammar whose `body` rule is given: `start` is the body, after the reasoning of a reasoning model."""
    start = reasoner.lark_prefix(inside, special) if reasoner is not None else "start: body"
    return "\n".join([start, *rules]) + "\n"


def after_reasoning(spec: StructuredOutput, reasoner: Reasoner, inside: bool, special: dict[str, int]) -> StructuredOutput:
    """A structured output (JSON schema or JSON object) that applies after the reasoning; a regex or a choice is
    left as it is (the model answers without reasoning)."""
    if spec.json_schema is None and not spec.json_object:
        return spec
    schema = {"type": "object"} if spec.json_object else spec.json_schema
    body = f"body: %json {json.dumps({**schema, 'x-guidance': JSON_LAYOUT})}"
    return StructuredOutput(lark=with_start([body], reasoner, inside, special))


def template_tools(plan_: ToolPlan | None) -> list[dict] | None:
    """The tools as chat templates take them (OpenAI's shape)."""
    if plan_ is None:
        return None
    return [{"type": "function", "function": {"name": t.function.name, "description": t.function.description or "",
                                              "parameters": parameters_of(t)}} for t in plan_.tools]


def template_call(call: ToolCall, param: str) -> dict:
    """A history call as templates take it: its arguments as an object (templates write them with `tojson`)."""
    if isinstance(call.function.arguments, dict):
        return {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                                  "arguments": call.function.arguments}}
    try:
        arguments = json.loads(call.function.arguments) if call.function.arguments.strip() else {}
    except ValueError as e:
        raise ToolError(f"{param}.function.arguments: not valid JSON: {str(e)[:200]}",
                        f"{param}.function.arguments") from None
    return {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": arguments}}


def check_history(messages: list) -> None:
    """Every `tool` message answers a call of an earlier assistant message (its `tool_call_id`)."""
    ids: set[str] = set()
    for i, m in enumerate(messages):
        if m.role == "assistant":
            ids.update(c.id for c in m.tool_calls or ())
        elif m.role == "tool":
            if m.tool_call_id is None:
                raise ToolError(f"messages[{i}].tool_call_id: a tool message needs the id of the call it answers",
                                f"messages[{i}].tool_call_id")
            if m.tool_call_id not in ids:
                raise ToolError(f"messages[{i}].tool_call_id: {m.tool_call_id[:80]!r} answers no call of an earlier "
                                "assistant message", f"messages[{i}].tool_call_id")
        if m.role != "assistant" and m.tool_calls:
            raise ToolError(f"messages[{i}].tool_calls: only assistant messages carry calls",
                            f"messages[{i}].tool_calls")
