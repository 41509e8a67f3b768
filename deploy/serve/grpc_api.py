"""gRPC methods of the API replica (service specfleet.v1.Specfleet, deploy/rpc/specfleet.proto).

Ray Serve's gRPC proxy calls the ingress's methods by name (deploy/serve/app.py), which hand each call to a
`GrpcService` holding the replica's ApiContext (deploy/serve/api_context.py); errors are
status codes: UNAUTHENTICATED without a valid key, INVALID_ARGUMENT / NOT_FOUND for bad input,
RESOURCE_EXHAUSTED when too many requests are pending, UNAVAILABLE when no instance can serve. A chat request may
carry tools (deploy/serve/grpc_tools.py): its answer is shaped as the HTTP API's (content, reasoning, tool calls).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from pydantic import ValidationError

from actors.speculation.structured import parse_schema
from cluster.request import (DEFAULT_MAX_TOKENS, DEFAULT_TEMPERATURE, FinishReason, InvalidRequest, SpecStats,
                             StructuredOutput)
from deploy.serve.admission import Ticket
from deploy.serve.api_context import ApiContext
from deploy.serve.auth import Tenant
from deploy.serve.chat_output import ChatShape
from deploy.serve.frontend import Call
from deploy.serve.grpc_tools import chat_with_tools, chunk_fields, response_fields
from deploy.serve.openai_api import APIError
from deploy.serve.tools import template_tools
from deploy.rpc import specfleet_pb2 as pb

STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 401: grpc.StatusCode.UNAUTHENTICATED, 404: grpc.StatusCode.NOT_FOUND,
          408: grpc.StatusCode.DEADLINE_EXCEEDED, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
          429: grpc.StatusCode.RESOURCE_EXHAUSTED, 503: grpc.StatusCode.UNAVAILABLE}


def _spec(stats: SpecStats) -> pb.SpecDecodeStats:
    return pb.SpecDecodeStats(proposed_tokens=stats.proposed, accepted_tokens=stats.accepted, rounds=stats.rounds,
                              acceptance_rate=stats.acceptance_rate, mean_accepted_length=stats.mean_accepted_length,
                              accepted_per_position=stats.accepted_per_position)


def _usage(prompt: int, completion: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _opt(request: pb.GenerateRequest, name: str, default):
    """An optional field's value, or `default` when it is unset."""
    return getattr(request, name) if request.HasField(name) else default


def _structured(request: pb.GenerateRequest) -> StructuredOutput | None:
    """The request's structured output (its JSON schema parsed: a 400 naming `structured` if it is no JSON)."""
    kind = request.structured.WhichOneof("kind") if request.HasField("structured") else None
    s = request.structured
    try:
        if kind == "json_schema":
            return StructuredOutput(json_schema=parse_schema(s.json_schema))
        if kind == "json_object":
            return StructuredOutput(json_object=True) if s.json_object else None
        if kind == "regex":
            return StructuredOutput(regex=s.regex)
        if kind == "choice":
            return StructuredOutput(choice=tuple(s.choice.choices))
    except (InvalidRequest, ValidationError) as e:
        raise APIError(400, f"structured: {str(e)[:300]}", param="structured") from None
    return None


def _failure(error: str | None, rejected: bool) -> APIError:
    """A request that ended in an error: INVALID_ARGUMENT if the engine refused it, else UNAVAILABLE."""
    if rejected:
        return APIError(400, error or "the request was refused")
    return APIError(503, error or "the request failed")


class GrpcService:
    """The gRPC methods over one replica's ApiContext; the Serve ingress (deploy/serve/app.py) declares each method
    by name, as Serve's gRPC proxy calls it, and hands it here."""

    def __init__(self, api: ApiContext) -> None:
        self.api = api

    def _grpc_auth(self, grpc_context) -> Tenant:
        metadata = dict(grpc_context.invocation_metadata())
        tenant = self.api.api_keys.match(metadata.get("authorization"))
        if tenant is None:
            raise APIError(401, "missing or invalid API key: send metadata `authorization: Bearer <key>`")
        return tenant

    def _grpc_admin(self, grpc_context) -> None:
        """An admin key in the metadata (the operator's figures are not a tenant's), else 401 / UNAUTHENTICATED."""
        if not self.api.admin_keys.check(dict(grpc_context.invocation_metadata()).get("authorization")):
            raise APIError(401, "FleetStats needs an admin key: send metadata `authorization: Bearer <admin key>`")

    def _fail(self, grpc_context, e: APIError) -> None:
        grpc_context.set_code(STATUS.get(e.status, grpc.StatusCode.INTERNAL))
        grpc_context.set_details(e.message)

    async def _start(self, request: pb.GenerateRequest, tenant: Tenant) -> tuple[Call, ChatShape | None]:
        """The request through the edge (deploy/serve/edge.py), and its chat answer's shape (None: plain text).
        Serve's gRPC proxy already refused a message over serve.max_request_bytes (RAY_SERVE_GRPC_MAX_MESSAGE_SIZE,
        deploy/serve/serve_env.py); the check here covers a proxy started without it."""
        held = self.api.edge.precheck(tenant)  # one of the key's slots until admission (deploy/serve/edge.py)
        try:
            return await self._admit(request, tenant, held)
        finally:
            held.release()

    async def _admit(self, request: pb.GenerateRequest, tenant: Tenant,
                     held: Ticket) -> tuple[Call, ChatShape | None]:
        f = self.api.frontend
        limit = self.api.serve.max_request_bytes
        if request.ByteSize() > limit:
            raise APIError(413, f"the request exceeds this server's limit of {limit} bytes (serve.max_request_bytes)")
        f.check_model(request.model)
        which = request.WhichOneof("input")
        messages, plan = chat_with_tools(request)  # tools need chat input; their fields checked
        spec, spec_param = _structured(request), "structured"
        shape = None
        if which == "chat":  # tools' grammar, or a reasoning model's reasoning before a structured answer
            shape, spec, spec_param = f.formats.shape(plan, spec, spec_param, f.model_name)
        if which == "prompt":
            encode, param = (lambda: f.encode_prompt(request.prompt, tenant.name)), "prompt"
            default_max: int | None = DEFAULT_MAX_TOKENS
        elif which == "chat":
            if not request.chat.messages:
                raise APIError(400, "chat.messages is empty", param="chat")
            self.api.edge.check_messages(len(request.chat.messages))
            encode, param = (lambda: f.encode_chat(messages, tenant.name, template_tools(plan))), "chat"
            default_max = None
        elif which == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
            encode, param, default_max = (lambda: f.encode_prompt(ids)), "prompt_token_ids", DEFAULT_MAX_TOKENS
        else:
            raise APIError(400, "give one of prompt, chat or prompt_token_ids", param="input")
        temperature = request.temperature if request.HasField("temperature") else DEFAULT_TEMPERATURE
        top_p = request.top_p if request.HasField("top_p") else 1.0
        max_tokens = request.max_tokens if request.HasField("max_tokens") else default_max
        salt = request.cache_salt if request.HasField("cache_salt") else None
        if salt is not None and not 1 <= len(salt) <= 256:
            raise APIError(400, "cache_salt must have 1 to 256 characters", param="cache_salt", code="invalid_value")
        sampling = {
            "temperature": temperature, "top_p": top_p, "top_k": request.top_k, "stop": tuple(request.stop),
            "ignore_eos": request.ignore_eos, "min_tokens": request.min_tokens,
            "presence_penalty": _opt(request, "presence_penalty", 0.0),
            "frequency_penalty": _opt(request, "frequency_penalty", 0.0),
            "repetition_penalty": _opt(request, "repetition_penalty", 1.0),
            "logit_bias": dict(request.logit_bias), "stop_token_ids": tuple(request.stop_token_ids),
            "logprobs": _opt(request, "logprobs", None), "prompt_logprobs": _opt(request, "prompt_logprobs", None),
            "structured": spec}

        async def checked_encode() -> list[int]:
            await f.check_structured(spec, spec_param, tenant.name)
            return await encode()

        call = await self.api.edge.start(
            tenant, n=1, priority=request.priority, max_tokens=max_tokens, encode=checked_encode, held=held,
            prepare=lambda ids: f.prepare(ids, max_tokens=max_tokens, seed=request.seed if request.HasField("seed")
                                          else None, n=1, priority=request.priority, prompt_param=param,
                                          tenant=tenant.name, cache_salt=salt, **sampling))
        return call, shape

    def _grpc_logprobs(self, entries, token_ids) -> list[pb.TokenLogprob]:
        """TokenLogprob messages of these tokens (an entry None: the prompt's first token, no logprob)."""
        strings, out = self.api.frontend.token_strings, []
        for token_id, lp in zip(token_ids, entries):
            m = pb.TokenLogprob(token_id=token_id, token=strings.of(token_id))
            if lp is not None:
                m.logprob = lp.logprob
                m.top_logprobs.extend(pb.TopLogprob(token_id=t, token=strings.of(t), logprob=v) for t, v in lp.top)
            out.append(m)
        return out

    async def Generate(self, request: pb.GenerateRequest, grpc_context) -> pb.GenerateResponse:  # noqa: N802
        try:
            call, shape = await self._start(request, self._grpc_auth(grpc_context))
            [c] = await call.collect()
            if c.finish_reason == FinishReason.ERROR:
                raise _failure(c.error, c.rejected)
        except APIError as e:
            self._fail(grpc_context, e)
            return pb.GenerateResponse()
        reason, shaped = c.finish_reason.value, {}
        if shape is not None:
            message, called = shape.message(c.text, c.token_ids)
            reason, shaped = ("tool_calls" if called and reason == "stop" else reason), response_fields(message)
        return pb.GenerateResponse(id=call.prep.request_id, model=self.api.frontend.model_name, text=c.text,
                                   token_ids=c.token_ids, finish_reason=reason, **shaped,
                                   usage=_usage(len(call.prep.prompt_ids), len(c.token_ids)), spec_decode=_spec(c.stats),
                                   logprobs=self._grpc_logprobs(c.logprobs, c.token_ids),
                                   prompt_logprobs=self._grpc_logprobs(c.prompt_logprobs or (), call.prep.prompt_ids))

    async def GenerateStream(self, request: pb.GenerateRequest, grpc_context) -> AsyncIterator[pb.GenerateChunk]:  # noqa: N802
        try:
            call, shape = await self._start(request, self._grpc_auth(grpc_context))
        except APIError as e:  # a stream's status is only read from an exception raised after set_code (Serve 2.60)
            self._fail(grpc_context, e)
            raise
        rid, completion = call.prep.request_id, 0
        stream = shape.stream() if shape is not None else None
        try:
            async for _, item in call:
                d = item.delta
                completion += len(d.token_ids)
                if d.finish_reason == FinishReason.ERROR:
                    e = _failure(d.error, item.rejected)
                    self._fail(grpc_context, e)
                    raise e
                shaped = {}
                if stream is not None:
                    shaped = chunk_fields(stream.feed(d.text, d.token_ids) + (stream.finish() if d.finished else []))
                chunk = pb.GenerateChunk(id=rid, text=d.text, token_ids=d.token_ids, **shaped,
                                         logprobs=self._grpc_logprobs(d.logprobs or (), d.token_ids),
                                         prompt_logprobs=self._grpc_logprobs(d.prompt_logprobs or (), call.prep.prompt_ids))
                if d.finished:
                    reason = d.finish_reason.value
                    chunk.finish_reason = "tool_calls" if stream is not None and stream.called and reason == "stop" \
                        else reason
                    chunk.usage.CopyFrom(_usage(len(call.prep.prompt_ids), completion))
                    chunk.spec_decode.CopyFrom(_spec(item.stats or SpecStats()))
                yield chunk
        finally:  # a client that cancels: abort at once rather than when the generator is collected
            call.close()

    async def ListModels(self, request: pb.ListModelsRequest, grpc_context) -> pb.ListModelsResponse:  # noqa: N802
        try:
            self._grpc_auth(grpc_context)
        except APIError as e:
            self._fail(grpc_context, e)
            return pb.ListModelsResponse()
        models = await self.api.router.models()
        return pb.ListModelsResponse(models=[pb.Model(id=m, max_model_len=n) for m, n in sorted(models.items())])

    async def Health(self, request: pb.HealthRequest, grpc_context) -> pb.HealthResponse:  # noqa: N802
        instances = await self.api.instances_view.get()  # reused for a second (deploy/serve/cached.py)
        healthy = sum(i.accepting for i in instances)
        if not healthy:
            grpc_context.set_code(grpc.StatusCode.UNAVAILABLE)
            grpc_context.set_details("no healthy instance")
        return pb.HealthResponse(healthy=healthy > 0, healthy_instances=healthy)

    async def FleetStats(self, request: pb.FleetStatsRequest, grpc_context) -> pb.FleetStatsResponse:  # noqa: N802
        """The fleet's migration and failover figures: an admin key's, as `GET /admin/migrations`."""
        try:
            self._grpc_admin(grpc_context)
        except APIError as e:
            self._fail(grpc_context, e)
            return pb.FleetStatsResponse()
        instances, m = await asyncio.gather(self.api.router.instances(), self.api.router.migration_stats())
        return pb.FleetStatsResponse(healthy_instances=sum(i.accepting for i in instances), migrations=m.by_status,
                                     failovers=m.failovers, downtime_mean_s=m.downtime_mean_s,
                                     downtime_max_s=m.downtime_max_s)
