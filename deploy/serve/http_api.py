"""The OpenAI API's HTTP routes (/v1/models, /v1/completions, /v1/chat/completions) on an APIRouter.

Each handler receives the replica's ApiContext as a FastAPI dependency (`api: Api`, deploy/serve/api_context.py);
the app that includes this router is built per replica (deploy/serve/http_app.py). /health, /metrics and /admin are
deploy/serve/admin_routes.py's, /v1/responses deploy/serve/responses_routes.py's.

Bodies are read within `serve.edge.body_timeout_s` (408 after) and `serve.max_request_bytes` (413), then parsed by
hand (json, then the pydantic models of deploy/serve/openai_api.py) so that every malformed request gets an
OpenAI-style error body with the field it concerns, never FastAPI's default 422 or a 500. Work starts only once
the request has passed the edge (deploy/serve/edge.py). Streams are server-sent events ending with `data: [DONE]`.
The OpenAPI schema (`/openapi.json`) describes the bodies these routes take, for clients and for fuzzing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.requests import ClientDisconnect

from cluster.config import ServeConfig
from cluster.request import FinishReason, SpecStats
from deploy.serve import logprobs
from deploy.serve.admission import Ticket
from deploy.serve.api_context import Api, ApiContext
from deploy.serve.auth import Tenant
from deploy.serve.chat_output import ChatShape, ChatStream, merge
from deploy.serve.frontend import Call, Frontend
from deploy.serve.logprobs import TokenStrings
from deploy.serve.openai_api import (APIError, ChatCompletionRequest, CompletionRequest, choice, chunk_body,
                                     completion_body, from_validation_error, model_list, usage, usage_chunk)
from deploy.serve.tools import template_tools

log = logging.getLogger(__name__)
routes = APIRouter()  # the OpenAI API's routes, each given the replica's ApiContext (api_context.py)


async def _read(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refused with 413 once it is known to exceed `limit` bytes (declared, or as it arrives), and with
    408 if it has not all arrived within `timeout_s` (a client that trickles a body holds a connection and a
    slot of the replica's concurrency for as long as it likes otherwise)."""
    too_large = APIError(413, f"the body exceeds this server's limit of {limit} bytes (serve.max_request_bytes)",
                         code="request_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    raw = bytearray()

    async def arrive() -> None:
        async for chunk in request.stream():
            raw.extend(chunk)
            if len(raw) > limit:
                raise too_large

    try:
        await asyncio.wait_for(arrive(), timeout_s)
    except asyncio.TimeoutError:
        raise APIError(408, f"the body did not arrive within {timeout_s:g} s (serve.edge.body_timeout_s)",
                       code="request_timeout") from None
    except ClientDisconnect:  # the client left before its body arrived: nginx's 499, not a server error (was a 500)
        raise APIError(499, "the client closed the connection before its body arrived",
                       code="client_closed_request") from None
    return bytes(raw)


async def parse_body(request: Request, model: type, cfg: ServeConfig) -> object:
    """The body parsed once, by pydantic's JSON parser, strictly against JSON's own types ("12" is no integer); bad
    JSON or UTF-8, an integer too long, nesting too deep are 400s like any other error (from_validation_error)."""
    raw = await _read(request, cfg.max_request_bytes, cfg.edge.body_timeout_s)
    try:
        return model.model_validate_json(raw, strict=True)
    except ValidationError as e:
        raise from_validation_error(e) from None


SEND_TIMEOUT_S = 20.0  # a stream chunk not taken by the proxy for this long: the client is gone


class ClosingStreamingResponse(StreamingResponse):
    """A stream that watches for the client's disconnect and closes its call and body generator however it ends.

    Starlette (for ASGI 2.4 servers, as Serve's replica declares) only notices a disconnect when a send fails,
    and Serve's sends go to a queue that never fails; and an abandoned generator is only finalized when the
    garbage collector gets to it. So the request would run on. Here `http.disconnect` from `receive`
    (which Serve delivers) stops the stream, and the call is closed at once. Under load the proxy has also
    been seen to stop taking chunks with neither a disconnect nor a cancellation: a send blocked for
    SEND_TIMEOUT_S counts as a disconnect too.

    The call is closed first thing in `finally`, before any await: Serve may cancel this task more than once
    (the generator close and the actor task's cancellation), and a second cancellation during the awaits
    below used to skip closing a body generator that was suspended at a send, leaving the request running at
    the router for as long as the garbage collector took (issue 12). A body generator that never started
    would never have closed at all.
    """

    def __init__(self, content, call: Call, **kwargs) -> None:
        super().__init__(content, **kwargs)
        self.call = call

    async def __call__(self, scope, receive, send) -> None:
        async def disconnected() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        async def bounded_send(message) -> None:  # a send that cannot finish: nobody reads the stream any more
            await asyncio.wait_for(send(message), SEND_TIMEOUT_S)

        stream = asyncio.ensure_future(self.stream_response(bounded_send))
        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.call.close()
            for task in (stream, watcher):
                task.cancel()
            await asyncio.gather(stream, watcher, return_exceptions=True)
            await self.body_iterator.aclose()
        error = None if stream.cancelled() else stream.exception()
        if isinstance(error, TimeoutError) and not watcher.done():  # no [DONE] can reach a client that reads nothing
            log.warning("request %s: the client read nothing for %g s; its stream is cut", self.call.prep.request_id,
                        SEND_TIMEOUT_S)
            self.call.f.metrics.failed("client_stopped_reading")
        elif error is not None and not watcher.done():
            raise error


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n"


@routes.get("/v1/models")
async def models(request: Request, api: Api) -> Response:
    api.authorize(request.headers.get("authorization"))
    return JSONResponse(model_list(await api.router.models()))


@routes.post("/v1/completions")
async def completions(request: Request, api: Api) -> Response:
    tenant = api.authorize(request.headers.get("authorization"))
    held = api.edge.precheck(tenant)  # the body's read holds one of the key's slots (deploy/serve/edge.py)
    f = api.frontend
    try:
        declared = request.headers.get("content-length", "")
        if not (declared.isdigit() and int(declared) > api.serve.max_request_bytes):  # a 413 (_read)
            f.check_completion_body(declared)
        body: CompletionRequest = await parse_body(request, CompletionRequest, api.serve)
        f.check_model(body.model)
        call = await start_body(api, tenant, body, body.max_tokens, lambda: f.encode_prompt(body.prompt, tenant.name),
                                held=held)
    finally:
        held.release()  # passed to the request's admission, or the request ended before it
    prefix = ""
    if body.echo:
        prefix = body.prompt if isinstance(body.prompt, str) else f.tokenizer.decode(call.prep.prompt_ids)
    return await _respond(f, call, body, chat=False, prefix=prefix)


@routes.post("/v1/chat/completions")
async def chat_completions(request: Request, api: Api) -> Response:
    tenant = api.authorize(request.headers.get("authorization"))
    held = api.edge.precheck(tenant)
    f = api.frontend
    try:
        body: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest, api.serve)
        f.check_model(body.model)
        api.edge.check_messages(len(body.messages))
        plan = body.tool_plan()  # tools, tool_choice and the history's calls checked (deploy/serve/tools.py)
        messages = body.template_messages()
        shape, spec, spec_param = f.formats.shape(plan, *body.structured(), f.model_name)
        call = await start_body(api, tenant, body, body.token_limit,
                                lambda: f.encode_chat(messages, tenant.name, template_tools(plan)),
                                structured=(spec, spec_param), held=held, prompt_param="messages", prefix="chatcmpl")
    finally:
        held.release()
    return await _respond(f, call, body, chat=True, shape=shape)


async def start_body(api: ApiContext, tenant: Tenant, body, max_tokens: int | None, encode, structured=None,
                     held: Ticket | None = None, **naming) -> Call:
    """The body's request through the edge: its structured output (`structured`: the grammar and the field that
    asked, when not the body's own) is checked with the prompt's tokenization; `held`: the key's slot taken before
    the body was read (admission's precheck), handed to the request's ticket."""
    f = api.frontend
    spec, spec_param = structured if structured is not None else body.structured()
    sampling = {**body.sampling_args(), "logprobs": body.logprobs_count,
                "prompt_logprobs": body.prompt_logprobs_count, "structured": spec}

    async def checked_encode() -> list[int]:
        await f.check_structured(spec, spec_param, tenant.name)
        return await encode()

    return await api.edge.start(
        tenant, n=body.n, priority=body.priority, max_tokens=max_tokens, encode=checked_encode, held=held,
        prepare=lambda ids: f.prepare(ids, max_tokens=max_tokens, **sampling, tenant=tenant.name, **naming))


async def _respond(f: Frontend, call: Call, body, chat: bool, prefix: str = "", shape: ChatShape | None = None
                   ) -> Response:
    """The response of a started call; whatever goes wrong before the response owns the call closes it."""
    try:
        if body.stream:
            return ClosingStreamingResponse(_stream(f, call, body, chat, prefix, shape), call,
                                            media_type="text/event-stream")
        return await _complete(f, call, body, chat, prefix, shape)
    except BaseException:
        call.close()
        raise


def _logprobs(strings: TokenStrings, body, chat: bool, prompt_ids, prompt: tuple | None, generated, offset: int = 0):
    """The `logprobs` of a choice (or of a chunk's tokens), and the text offset after them (completions)."""
    if body.logprobs_count is None:
        return None, offset
    if chat:
        return logprobs.chat(generated, strings), offset
    scored = list(zip(prompt_ids, prompt)) if prompt is not None else []
    return logprobs.completion(scored + [(lp.token_id, lp) for lp in generated], strings, offset)


async def _complete(f: Frontend, call: Call, body, chat: bool, prefix: str, shape: ChatShape | None = None
                    ) -> Response:
    rid, model, p = call.prep.request_id, f.model_name, len(call.prep.prompt_ids)
    choices = await call.collect()
    failed = [c for c in choices if c.finish_reason == FinishReason.ERROR]
    if failed:  # all or nothing: a 200 whose choices silently miss some would read as a whole answer
        first = failed[0]
        if first.rejected:  # the engine refused it: the client's error
            raise APIError(400, first.error or "the request was refused")
        f.metrics.failed("partial_failure" if len(failed) < len(choices) else "failure")
        raise APIError(503, f"{len(failed)} of {len(choices)} choices failed: {first.error or 'the request failed'}",
                       type_="service_unavailable", code="instance_failed")
    total = SpecStats()
    for c in choices:
        total.merge(c.stats)
    out = []
    for c in choices:
        reason, message = c.finish_reason.value if c.finish_reason else None, None
        if shape is not None:  # reasoning and tool calls (deploy/serve/chat_output.py)
            message, called = shape.message(c.text, c.token_ids)
            reason = "tool_calls" if called and reason == "stop" else reason
        out.append(choice(c.index, prefix + c.text, reason, chat, c.stats,
                          _logprobs(f.token_strings, body, chat, call.prep.prompt_ids, c.prompt_logprobs,
                                    c.logprobs)[0], message=message))
    return JSONResponse(completion_body(rid, model, out, usage(p, sum(len(c.token_ids) for c in choices)), total, chat))


async def _stream(f: Frontend, call: Call, body, chat: bool, prefix: str, shape: ChatShape | None = None
                  ) -> AsyncIterator[str]:
    try:
        async for event in _events(f, call, body, chat, prefix, shape):
            yield event
    finally:
        call.close()


async def _events(f: Frontend, call: Call, body, chat: bool, prefix: str, shape: ChatShape | None = None
                  ) -> AsyncIterator[str]:
    """Chunks as the tokens come; each carries its tokens' logprobs if asked. The echoed prompt comes first, before
    any token, or (scoring the prompt) with the prompt's logprobs, which arrive with the first delta. A shaped chat
    answer's deltas (reasoning, tool calls) come as chat_output.ChatStream makes them; with
    `continuous_usage_stats` every chunk carries the usage so far (vLLM's)."""
    rid, model, created = call.prep.request_id, f.model_name, int(time.time())
    prompt_ids, strings = call.prep.prompt_ids, f.token_strings
    started: set[int] = set()
    offsets = [0] * len(call.ids)  # completions' text_offset so far, per choice
    completion_tokens, total = 0, SpecStats()
    scoring = prefix and body.prompt_logprobs_count is not None
    streams = [shape.stream() for _ in call.ids] if shape is not None else None
    with_usage = (lambda c: {**c, "usage": usage(len(prompt_ids), completion_tokens)}) if body.continuous_usage \
        else (lambda c: c)
    for index in range(len(call.ids)):  # the role (chat) or the echoed prompt first, so clients see the start
        if chat or (prefix and not scoring):
            started.add(index)
            yield _sse(with_usage(chunk_body(rid, model, created, index, prefix, None, chat, first=True)))
    async for index, item in call:
        d = item.delta
        completion_tokens += len(d.token_ids)
        if d.finished and item.stats is not None:
            total.merge(item.stats)
        if d.error:
            err = APIError(503, d.error, type_="service_unavailable", code="instance_failed")
            f.metrics.failed("stream_error")
            yield _sse(err.body())
        if scoring and index not in started:
            lp, offsets[index] = _logprobs(strings, body, chat, prompt_ids, d.prompt_logprobs or None, (),
                                           offsets[index])
            started.add(index)
            yield _sse(with_usage(chunk_body(rid, model, created, index, prefix, None, chat, logprobs=lp)))
        if streams is not None:
            lp = _logprobs(strings, body, chat, prompt_ids, None, d.logprobs or (), 0)[0] if d.logprobs else None
            for delta, reason, lp in _shaped(streams[index], d, lp):
                yield _sse(with_usage(chunk_body(rid, model, created, index, None, reason, chat, logprobs=lp,
                                                 delta=delta)))
        elif d.text or d.finished or d.logprobs:
            lp, offsets[index] = _logprobs(strings, body, chat, prompt_ids, None, d.logprobs or (), offsets[index])
            reason = d.finish_reason.value if d.finished else None
            yield _sse(with_usage(chunk_body(rid, model, created, index, d.text, reason, chat,
                                             first=chat and index not in started, logprobs=lp)))
            started.add(index)
    if body.include_usage:
        yield _sse(usage_chunk(rid, model, created, usage(len(prompt_ids), completion_tokens), total, chat))
    yield _sse("[DONE]")


def _shaped(stream: ChatStream, d, logprobs: dict | None) -> list[tuple[dict, str | None, dict | None]]:
    """A delta's shaped chunks as (delta, finish_reason, logprobs): the tokens' logprobs ride on the first; the
    last item of a choice ends with its finish reason (`tool_calls` when it called)."""
    deltas = merge(stream.feed(d.text, d.token_ids))
    if d.finished:
        deltas += merge(stream.finish())
    if not deltas and (d.finished or logprobs):
        deltas = [{}]
    out = [(delta, None, logprobs if i == 0 else None) for i, delta in enumerate(deltas)]
    if d.finished:
        reason = d.finish_reason.value
        reason = "tool_calls" if stream.called and reason == "stop" else reason
        out[-1] = (out[-1][0], reason, out[-1][2])
    return out
