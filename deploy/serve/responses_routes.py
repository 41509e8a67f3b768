"""`POST /v1/responses`: the Responses body checked, run as its chat request, answered as output items or events.

Mixed into the Serve ingress class (deploy/serve/app.py) beside HttpRoutes, whose edge, auth and call handling it
uses; the translation is deploy/serve/responses_api.py's.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from cluster.request import FinishReason
from deploy.serve.chat_output import ChatShape, merge
from deploy.serve.frontend import Call
from deploy.serve.http_api import ClosingStreamingResponse, _body
from deploy.serve.openai_api import APIError, ChatCompletionRequest, from_validation_error
from deploy.serve.responses_api import (EventStream, ResponsesRequest, chat_param, output_items, response_body, sse,
                                        usage)
from deploy.serve.tools import template_tools


def _renamed(e: APIError) -> APIError:
    """A chat field's error as the Responses body names the field."""
    return APIError(e.status, e.message.replace(e.param or "\0", chat_param(e.param) or ""), e.type,
                    chat_param(e.param), e.code, e.headers)


class ResponsesRoutes:
    """The Responses route's body (needs HttpRoutes' `_auth`, `_start_body` and the ingress's frontend and edge)."""

    async def _responses(self, request: Request) -> Response:
        tenant = self._auth(request)
        self.edge.precheck(tenant)
        body: ResponsesRequest = await _body(request, ResponsesRequest, self.cfg.serve)
        body.check()
        f = self.frontend
        f.check_model(body.model)
        try:
            try:
                chat = ChatCompletionRequest.model_validate(body.to_chat())
            except ValidationError as e:
                raise from_validation_error(e) from None
            self.edge.check_messages(len(chat.messages))
            plan = chat.tool_plan()
            messages = chat.template_messages()
            shape, spec, spec_param = f.formats.shape(plan, *chat.structured(), f.model_name)
        except APIError as e:
            raise _renamed(e) from None
        shape = shape or ChatShape(None, None)
        call = await self._start_body(tenant, chat, chat.token_limit,
                                      lambda: f.encode_chat(messages, tenant.name, template_tools(plan)),
                                      structured=(spec, spec_param), prompt_param="input", prefix="resp")
        rid = f"resp_{uuid.uuid4().hex}"
        try:
            if body.stream:
                return ClosingStreamingResponse(self._response_events(call, body, shape, rid), call,
                                                media_type="text/event-stream")
            return await self._response(call, body, shape, rid)
        except BaseException:
            call.close()
            raise

    async def _response(self, call: Call, body: ResponsesRequest, shape: ChatShape, rid: str) -> Response:
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

    async def _response_events(self, call: Call, body: ResponsesRequest, shape: ChatShape, rid: str
                               ) -> AsyncIterator[str]:
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
