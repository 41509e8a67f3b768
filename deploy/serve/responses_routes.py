"""`POST /v1/responses`: the Responses body checked, run as its chat request, answered as output items or events.

A route on its own APIRouter, given the replica's ApiContext as a dependency (deploy/serve/api_context.py); it uses
the OpenAI routes' body reading and start through the edge (deploy/serve/http_api.py); the translation is
deploy/serve/responses_api.py's.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from cluster.request import FinishReason
from deploy.serve.chat_output import ChatShape, merge
from deploy.serve.frontend import Call
from deploy.serve.api_context import Api
from deploy.serve.http_api import ClosingStreamingResponse, parse_body, start_body
from deploy.serve.openai_api import APIError, ChatCompletionRequest, from_validation_error
from deploy.serve.responses_api import (EventStream, ResponsesRequest, chat_param, output_items, response_body, sse,
                                        usage)
from deploy.serve.tools import template_tools


def _renamed(e: APIError) -> APIError:
    """A chat field's error as the Responses body names the field."""
    return APIError(e.status, e.message.replace(e.param or "\0", chat_param(e.param) or ""), e.type,
                    chat_param(e.param), e.code, e.headers)


routes = APIRouter()


@routes.post("/v1/responses")
async def responses(request: Request, api: Api) -> Response:
    tenant = api.authorize(request.headers.get("authorization"))
    held = api.edge.precheck(tenant)  # the body's read holds one of the key's slots (deploy/serve/edge.py)
    try:
        body: ResponsesRequest = await parse_body(request, ResponsesRequest, api.serve)
        body.check()
        f = api.frontend
        f.check_model(body.model)
        try:
            try:
                chat = ChatCompletionRequest.model_validate(body.to_chat())
            except ValidationError as e:
                raise from_validation_error(e) from None
            api.edge.check_messages(len(chat.messages))
            plan = chat.tool_plan()
            messages = chat.template_messages()
            shape, spec, spec_param = f.formats.shape(plan, *chat.structured(), f.model_name)
        except APIError as e:
            raise _renamed(e) from None
        call = await start_body(api, tenant, chat, chat.token_limit,
                                lambda: f.encode_chat(messages, tenant.name, template_tools(plan)),
                                structured=(spec, spec_param), held=held, prompt_param="input", prefix="resp")
    finally:
        held.release()  # passed to the request's admission, or the request ended before it (it used to be kept)
    shape = shape or ChatShape(None, None)
    rid = f"resp_{uuid.uuid4().hex}"
    try:
        if body.stream:
            return ClosingStreamingResponse(_response_events(call, body, shape, rid), call,
                                            media_type="text/event-stream")
        return await _response(call, body, shape, rid)
    except BaseException:
        call.close()
        raise


async def _response(call: Call, body: ResponsesRequest, shape: ChatShape, rid: str) -> Response:
    [c] = await call.collect()
    if c.finish_reason == FinishReason.ERROR:
        if c.rejected:
            raise APIError(400, c.error or "the request was refused")
        raise APIError(503, c.error or "the request failed", type_="service_unavailable")
    message, _ = shape.message(c.text, c.token_ids)
    length = c.finish_reason == FinishReason.LENGTH
    return JSONResponse(response_body(
        rid, body, int(call.prep.arrival), "incomplete" if length else "completed", output_items(message),
        usage(len(call.prep.prompt_ids), len(c.token_ids)), "max_output_tokens" if length else None))


async def _response_events(call: Call, body: ResponsesRequest, shape: ChatShape, rid: str) -> AsyncIterator[str]:
    events, stream, tokens = EventStream(rid, body), shape.stream(), 0
    try:
        for event in events.start():
            yield sse(event)
        async for _, item in call:
            d = item.delta
            tokens += len(d.token_ids)
            deltas = merge(stream.feed(d.text, d.token_ids))
            if d.finished:
                deltas += merge(stream.finish())
            for delta in deltas:
                for event in events.delta(delta):
                    yield sse(event)
            if d.error:
                yield sse({"type": "error", "sequence_number": events.seq, "code": "instance_failed",
                           "message": d.error, "param": None})
                return
            if d.finished:
                for event in events.finish(d.finish_reason.value, usage(len(call.prep.prompt_ids), tokens)):
                    yield sse(event)
    finally:
        call.close()
