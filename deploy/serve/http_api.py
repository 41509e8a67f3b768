"""HTTP routes of the API replica: the OpenAI API under /v1, /health, /metrics and the operator's /admin.

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

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.autoscale import AutoscaleStatus
from cluster.config import ServeConfig
from cluster.request import FinishReason, RequestStatus, SpecStats
from deploy.serve.admission import Ticket
from deploy.serve.auth import Tenant
from deploy.serve.chat_output import ChatShape, ChatStream, merge
from deploy.serve.tools import template_tools
from deploy.serve.frontend import Call
from cluster.registry import NoInstanceAvailable
from deploy.serve import audit, logprobs, openapi
from deploy.serve.metrics import CONTENT_TYPE
from deploy.serve.openai_api import (APIError, ChatCompletionRequest, CompletionRequest, choice, chunk_body,
                               completion_body, from_validation_error, model_list, usage, usage_chunk)

log = logging.getLogger(__name__)
ADMIN_TIMEOUT_S = 600.0  # a migration or a migrating drain, which move requests one after another
AUTOSCALER_TIMEOUT_S = 5.0  # the autoscaler replica answers its status from memory
http_app = FastAPI(title="specfleet", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
openapi.install(http_app)


@http_app.exception_handler(APIError)
async def _api_error(_: Request, e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


@http_app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, e: StarletteHTTPException) -> JSONResponse:
    err = APIError(e.status_code, str(e.detail), type_="invalid_request_error" if e.status_code < 500 else "server_error")
    return JSONResponse(err.body(), status_code=e.status_code)


@http_app.exception_handler(Exception)
async def _unexpected(_: Request, e: Exception) -> JSONResponse:
    log.exception("unexpected error in a request")
    err = APIError(500, f"internal error: {type(e).__name__}", type_="server_error")
    return JSONResponse(err.body(), status_code=500)


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
    return bytes(raw)


async def _body(request: Request, model: type, cfg: ServeConfig) -> object:
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


class HttpRoutes:
    """Route bodies, mixed into the Serve ingress class (deploy/serve/app.py), which declares the routes and sets cfg,
    frontend, router, api_keys and admin_keys."""

    def _auth(self, request: Request, admin: bool = False) -> Tenant:
        keys = self.admin_keys if admin else self.api_keys
        tenant = keys.match(request.headers.get("authorization"))
        if tenant is None:
            what = "admin key" if admin else "API key"
            raise APIError(401, f"missing or invalid {what}: send `Authorization: Bearer <key>`",
                           type_="authentication_error", code="invalid_api_key")
        return tenant

    def _audit(self, request: Request, admin: Tenant, action: str, target: str, outcome: str) -> None:
        """An admin action in the audit log (deploy/serve/audit.py), with the admin key's id."""
        audit.record(action, target, admin, request.client.host if request.client else None, outcome)
        self._changed()

    def _changed(self) -> None:
        """The fleet changed through this replica: its cached views (/health, /metrics) are read anew."""
        self.instances_view.invalidate()
        self.fleet_view.invalidate()

    # ---- OpenAI ---------------------------------------------------------------------------------------
    async def _models(self, request: Request) -> JSONResponse:
        self._auth(request)
        return JSONResponse(model_list(await self.router.models()))

    async def _completions(self, request: Request) -> Response:
        tenant = self._auth(request)
        held = self.edge.precheck(tenant)  # the body's read holds one of the key's slots (deploy/serve/edge.py)
        try:
            declared = request.headers.get("content-length", "")
            if not (declared.isdigit() and int(declared) > self.cfg.serve.max_request_bytes):  # a 413 (_read)
                self.frontend.check_completion_body(declared)
            body: CompletionRequest = await _body(request, CompletionRequest, self.cfg.serve)
            f = self.frontend
            f.check_model(body.model)
            call = await self._start_body(tenant, body, body.max_tokens,
                                          lambda: f.encode_prompt(body.prompt, tenant.name), held=held)
        finally:
            held.release()  # passed to the request's admission, or the request ended before it
        prefix = ""
        if body.echo:
            prefix = body.prompt if isinstance(body.prompt, str) else f.tokenizer.decode(call.prep.prompt_ids)
        return await self._respond(call, body, chat=False, prefix=prefix)

    async def _chat_completions(self, request: Request) -> Response:
        tenant = self._auth(request)
        held = self.edge.precheck(tenant)
        try:
            body: ChatCompletionRequest = await _body(request, ChatCompletionRequest, self.cfg.serve)
            f = self.frontend
            f.check_model(body.model)
            self.edge.check_messages(len(body.messages))
            plan = body.tool_plan()  # tools, tool_choice and the history's calls checked (deploy/serve/tools.py)
            messages = body.template_messages()
            shape, spec, spec_param = f.formats.shape(plan, *body.structured(), f.model_name)
            call = await self._start_body(tenant, body, body.token_limit,
                                          lambda: f.encode_chat(messages, tenant.name, template_tools(plan)),
                                          structured=(spec, spec_param), held=held, prompt_param="messages",
                                          prefix="chatcmpl")
        finally:
            held.release()
        return await self._respond(call, body, chat=True, shape=shape)

    async def _start_body(self, tenant: Tenant, body, max_tokens: int | None, encode, structured=None,
                          held: Ticket | None = None, **naming) -> Call:
        """The body's request through the edge: its structured output (`structured`: the grammar and the field
        that asked, when not the body's own) is checked with the prompt's tokenization; `held`: the key's slot taken
        before the body was read (admission's precheck), handed to the request's ticket."""
        f = self.frontend
        spec, spec_param = structured if structured is not None else body.structured()
        sampling = {**body.sampling_args(), "logprobs": body.logprobs_count,
                    "prompt_logprobs": body.prompt_logprobs_count, "structured": spec}

        async def checked_encode() -> list[int]:
            await f.check_structured(spec, spec_param, tenant.name)
            return await encode()

        return await self.edge.start(
            tenant, n=body.n, priority=body.priority, max_tokens=max_tokens, encode=checked_encode, held=held,
            prepare=lambda ids: f.prepare(ids, max_tokens=max_tokens, **sampling, tenant=tenant.name, **naming))

    async def _respond(self, call: Call, body, chat: bool, prefix: str = "", shape: ChatShape | None = None) -> Response:
        """The response of a started call; whatever goes wrong before the response owns the call closes it."""
        try:
            if body.stream:
                return ClosingStreamingResponse(self._stream(call, body, chat, prefix, shape), call,
                                                media_type="text/event-stream")
            return await self._complete(call, body, chat, prefix, shape)
        except BaseException:
            call.close()
            raise

    def _logprobs(self, body, chat: bool, prompt_ids, prompt: tuple | None, generated, offset: int = 0):
        """The `logprobs` of a choice (or of a chunk's tokens), and the text offset after them (completions)."""
        strings = self.frontend.token_strings
        if body.logprobs_count is None:
            return None, offset
        if chat:
            return logprobs.chat(generated, strings), offset
        scored = list(zip(prompt_ids, prompt)) if prompt is not None else []
        return logprobs.completion(scored + [(lp.token_id, lp) for lp in generated], strings, offset)

    async def _complete(self, call: Call, body, chat: bool, prefix: str, shape: ChatShape | None = None) -> Response:
        rid, model, p = call.prep.request_id, self.frontend.model_name, len(call.prep.prompt_ids)
        choices = await call.collect()
        failed = [c for c in choices if c.finish_reason == FinishReason.ERROR]
        if failed:  # all or nothing: a 200 whose choices silently miss some would read as a whole answer
            first = failed[0]
            if first.rejected:  # the engine refused it: the client's error
                raise APIError(400, first.error or "the request was refused")
            self.frontend.metrics.failed("partial_failure" if len(failed) < len(choices) else "failure")
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
                              self._logprobs(body, chat, call.prep.prompt_ids, c.prompt_logprobs, c.logprobs)[0],
                              message=message))
        return JSONResponse(completion_body(rid, model, out, usage(p, sum(len(c.token_ids) for c in choices)),
                                            total, chat))

    async def _stream(self, call: Call, body, chat: bool, prefix: str, shape: ChatShape | None = None
                      ) -> AsyncIterator[str]:
        try:
            async for event in self._events(call, body, chat, prefix, shape):
                yield event
        finally:
            call.close()

    async def _events(self, call: Call, body, chat: bool, prefix: str, shape: ChatShape | None = None
                      ) -> AsyncIterator[str]:
        """Chunks as the tokens come; each carries its tokens' logprobs if asked. The echoed prompt comes first,
        before any token, or (scoring the prompt) with the prompt's logprobs, which arrive with the first delta. A
        shaped chat answer's deltas (reasoning, tool calls) come as chat_output.ChatStream makes them; with
        `continuous_usage_stats` every chunk carries the usage so far (vLLM's)."""
        rid, model, created = call.prep.request_id, self.frontend.model_name, int(time.time())
        prompt_ids = call.prep.prompt_ids
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
                self.frontend.metrics.failed("stream_error")
                yield _sse(err.body())
            if scoring and index not in started:
                lp, offsets[index] = self._logprobs(body, chat, prompt_ids, d.prompt_logprobs or None, (),
                                                    offsets[index])
                started.add(index)
                yield _sse(with_usage(chunk_body(rid, model, created, index, prefix, None, chat, logprobs=lp)))
            if streams is not None:
                lp = self._logprobs(body, chat, prompt_ids, None, d.logprobs or (), 0)[0] if d.logprobs else None
                for delta, reason, lp in _shaped(streams[index], d, lp):
                    yield _sse(with_usage(chunk_body(rid, model, created, index, None, reason, chat, logprobs=lp,
                                                     delta=delta)))
            elif d.text or d.finished or d.logprobs:
                lp, offsets[index] = self._logprobs(body, chat, prompt_ids, None, d.logprobs or (), offsets[index])
                reason = d.finish_reason.value if d.finished else None
                yield _sse(with_usage(chunk_body(rid, model, created, index, d.text, reason, chat,
                                                 first=chat and index not in started, logprobs=lp)))
                started.add(index)
        if body.include_usage:
            yield _sse(usage_chunk(rid, model, created, usage(len(prompt_ids), completion_tokens), total, chat))
        yield _sse("[DONE]")

    # ---- health and metrics ---------------------------------------------------------------------------
    async def _health(self) -> JSONResponse:
        instances = await self.instances_view.get()  # reused for a second (deploy/serve/cached.py)
        healthy = sum(i.accepting for i in instances)
        return JSONResponse({"status": "ok" if healthy else "unavailable", "healthy_instances": healthy},
                            status_code=200 if healthy else 503)

    async def _metrics(self) -> Response:
        instances, migrations, routing = await self.fleet_view.get()  # reused for a second
        self.frontend.metrics.set_instances(instances)
        self.frontend.metrics.migration_figures = migrations
        self.frontend.metrics.routing_figures = routing
        self.frontend.metrics.autoscale_figures = await self._autoscale_status()
        return Response(self.frontend.metrics.render(), media_type=CONTENT_TYPE)

    async def _autoscale_status(self) -> AutoscaleStatus | None:
        """The autoscaler's status (deploy/serve/autoscaler.py); None for a fixed fleet, or while it does not answer
        (logged: the rest of /metrics still answers)."""
        if self.autoscaler is None:
            return None
        try:
            return await asyncio.wait_for(self.autoscaler.status.remote(), AUTOSCALER_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - figures of one part missing must not fail the whole scrape
            log.warning("the autoscaler did not answer (%s: %s)", type(e).__name__, e)
            return None

    # ---- admin ----------------------------------------------------------------------------------------
    async def _admin_instances(self, request: Request) -> JSONResponse:
        self._auth(request, admin=True)
        rows, removed = await asyncio.gather(self.router.instances(), self.router.removed_instances())
        return JSONResponse({"instances": [r.model_dump(mode="json") for r in rows],
                             "removed": [r.model_dump(mode="json") for r in removed]})

    async def _admin_autoscaler(self, request: Request) -> JSONResponse:
        """The autoscaler's bounds, last decision and recent scale steps (cluster/autoscale.py, AutoscaleStatus)."""
        self._auth(request, admin=True)
        if self.autoscaler is None:
            return JSONResponse({"enabled": False})
        status = await asyncio.wait_for(self.autoscaler.status.remote(), AUTOSCALER_TIMEOUT_S)
        return JSONResponse({"enabled": True, **dataclasses.asdict(status)})

    async def _admin_migrations(self, request: Request) -> JSONResponse:
        """The router's migration and failover figures (cluster/stats.py, MigrationStats)."""
        self._auth(request, admin=True)
        figures, wait = await asyncio.gather(self.router.migration_stats(), self.router.failover_wait())
        return JSONResponse({**figures.as_dict(), "downtime_mean_s": figures.downtime_mean_s,
                             "failover_wait": dataclasses.asdict(wait)})

    async def _admin_dispatch(self, request: Request) -> JSONResponse:
        """The router's dispatch policy, its decisions by reason and its prefix index (cluster/stats.py,
        RoutingStats)."""
        self._auth(request, admin=True)
        return JSONResponse((await self.router.routing_stats()).as_dict())

    async def _admin_requests(self, request: Request) -> JSONResponse:
        self._auth(request, admin=True)
        status = request.query_params.get("status")
        if status not in (None, "running", "finished", "aborted", "failed"):
            raise APIError(400, f"unknown status {status!r}", param="status")
        rows = await self.router.requests(RequestStatus(status) if status else None)
        return JSONResponse({"requests": [row.model_dump(mode="json") for row in rows]})

    async def _admin_abort(self, request_id: str, request: Request) -> JSONResponse:
        admin = self._auth(request, admin=True)
        found = await self.router.abort(request_id)
        self._audit(request, admin, "abort", request_id, "ok" if found else "not found")
        if not found:
            raise APIError(404, f"no running request {request_id!r} (unknown, or it has just ended)", param="request_id",
                           code="request_not_found")
        return JSONResponse({"request_id": request_id, "aborted": True})

    async def _admin_drain(self, instance_id: str, request: Request) -> JSONResponse:
        """Stop dispatching to an instance; `migrate=true` moves its running requests to the others (live
        migration), `abort=true` aborts them, neither leaves them to finish there."""
        admin = self._auth(request, admin=True)
        flag = lambda name: request.query_params.get(name, "false").lower() in ("1", "true", "yes")  # noqa: E731
        abort, migrate = flag("abort"), flag("migrate")
        if abort and migrate:
            raise APIError(400, "choose migrate or abort, not both", param="migrate")
        self._audit(request, admin, "drain", instance_id, "asked: " + ("migrate" if migrate else
                                                                        "abort" if abort else "finish there"))
        try:
            if migrate:
                moved = await self.router.drain_migrate(instance_id, timeout_s=ADMIN_TIMEOUT_S)
                return JSONResponse(moved.model_dump(mode="json"))
            running = await self.router.drain(instance_id, abort)
        except ValueError as e:
            raise APIError(404, _reason(e), param="instance_id", code="instance_not_found") from None
        finally:
            self._changed()
        return JSONResponse({"instance_id": instance_id, "draining": True, "running": running, "aborted": abort})

    async def _admin_migrate(self, request_id: str, request: Request) -> JSONResponse:
        """Live-migrate a running request (`to`: the destination instance; default: where dispatch would send it)."""
        admin = self._auth(request, admin=True)
        try:
            to = request.query_params.get("to")
            self._audit(request, admin, "migrate", request_id, f"asked: to {to or 'dispatch'}")
            result = await self.router.migrate(request_id, to, timeout_s=ADMIN_TIMEOUT_S)
        except ValueError as e:
            raise APIError(404, _reason(e), param="request_id", code="request_not_found") from None
        except NoInstanceAvailable as e:
            raise APIError(409, f"no instance can take it: {_reason(e)}", param="to", code="no_destination") from None
        return JSONResponse({**dataclasses.asdict(result), "status": result.status.value})

    async def _admin_undrain(self, instance_id: str, request: Request) -> JSONResponse:
        self._audit(request, self._auth(request, admin=True), "undrain", instance_id, "asked")
        try:
            await self.router.undrain(instance_id)
        except ValueError as e:
            raise APIError(404, _reason(e), param="instance_id", code="instance_not_found") from None
        finally:
            self._changed()
        return JSONResponse({"instance_id": instance_id, "draining": False})


    async def _admin_routing(self, instance_id: str, request: Request) -> Response:
        """An expert-parallel instance's online routing statistics since the last call: a statistics file."""
        self._auth(request, admin=True)
        try:
            data = await self.router.expert_routing(instance_id)
        except ValueError as e:
            raise APIError(404, _reason(e), param="instance_id", code="instance_not_found") from None
        except LookupError as e:
            raise APIError(409, _reason(e), param="instance_id", code="not_expert_parallel") from None
        return Response(data, media_type="application/octet-stream")


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


def _reason(e: BaseException) -> str:
    """An error's own message: a router call's error arrives wrapped in Ray's RayTaskError, traceback and all."""
    return str(getattr(e, "cause", None) or e)
