"""What the HTTP and gRPC endpoints share: validate and tokenize, ask the router where, stream from the instance.

    frontend = Frontend(frontend_config(cfg), router)  # in the API replica (its own sub-config, frontend_config.py)
    call = await frontend.start(frontend.prepare(...))  # routed: 404/429/503 are raised here, before any output
    async for index, item in call: ...                 # StreamItems of every choice (what waited: merged)
    # leaving the loop early (client disconnect) aborts whatever is still running and frees its KV

Everything the engine would refuse is refused here first, with the field it concerns, so a stream that has
begun can only end in an error if an instance fails.

Every routed request is released exactly once, however its client leaves: `Call.close` (synchronous, so no
cancellation can skip it) hands the abort at the instance and the `finish` at the router to supervised tasks
that await them and log a failure. A route whose caller is cancelled while it is under way is released when
it completes. What still escapes (a process that dies) the router's reconciliation closes (cluster/router.py).

The router is reached through a RouterClient (cluster/router_client.py): every call has a deadline, and a router
that died is found again by name, so a router restart pauses routing without failing requests; streams never
pass through it. Each choice's stream runs in a supervised task: whatever it raises ends that choice with an
error item, never a client left waiting.

Every Ray call (route, generate, finish, abort) is submitted outside the request's context. When a client disconnects,
Serve cancels the replica's request with `ray.cancel`, which is recursive: every Ray call submitted from the
request's context is a child of it and is cancelled too. That is how releases were lost (issue 12): the
`finish` and `abort` sent while the request was being torn down (or just after its last token) were cancelled
with it, so the router kept the request running while its instance had ended it. Ray tells parents from the
caller's contextvars, so a call made in a fresh `contextvars.Context()` belongs to no request. (A cancelled
`generate` also surfaced as a TaskCancelledError, so a client's disconnect was recorded as a failure.)
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from pydantic import ValidationError
from ray.actor import ActorHandle
from ray.exceptions import RayError

from actors.model.loader import load_metadata
from actors.model.tokenize import encode_chat, encode_text
from actors.speculation.structured import check as check_structured
from cluster.coalesce import coalesce_choices, waiting
from cluster.prefix import block_hashes, request_root
from cluster.registry import NoInstanceAvailable
from cluster.request import (FinishReason, InvalidRequest, Request, RequestStatus, Resume, SamplingParams,
                             SpecStats, StreamItem, StructuredOutput, TokenDelta, TokenLogprob, check_prompt,
                             context_length)
from cluster.disagg import PromptShape
from cluster.first_token import FirstTokenRecord
from cluster.router import Overloaded
from cluster.router_client import RouterClient
from deploy.serve.chat_output import ChatFormats
from deploy.serve.frontend_config import FrontendConfig
from deploy.serve.logprobs import TokenStrings
from deploy.serve.metrics import Metrics, RequestTimer
from deploy.serve.openai_api import APIError, from_validation_error
from deploy.serve.tokenizing import TokenizerPool, max_chars_per_token

log = logging.getLogger(__name__)


class InstanceFailed(RuntimeError):
    """The instance ended a stream with its own failure (a lost shard, a failed loop), not the request's."""


RELEASE_TIMEOUT_S = 30.0  # for an abort at an instance or a call to the router on a request's way out


@dataclass(frozen=True)
class Prepared:
    """A validated request: its tokens and, per choice, its sampling parameters."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: tuple[SamplingParams, ...]  # one per choice (n)
    priority: int
    arrival: float
    tenant: str = ""  # the API key's tenant (Request.tenant)
    cache_salt: str | None = None  # its own prefix cache (Request.cache_salt): shares blocks only with the same salt


@dataclass
class Choice:
    """One choice's accumulated output (non-streaming responses, gRPC)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    stats: SpecStats = field(default_factory=SpecStats)
    rejected: bool = False  # the engine refused the request (see StreamItem.rejected)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, if the request asked
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None

    def add(self, item: StreamItem) -> None:
        self.text += item.delta.text
        self.token_ids.extend(item.delta.token_ids)
        self.logprobs.extend(item.delta.logprobs or ())
        if self.prompt_logprobs is None:  # the first (a request resumed elsewhere may score its prompt again)
            self.prompt_logprobs = item.delta.prompt_logprobs
        self.rejected |= item.rejected
        if item.delta.finished:
            self.finish_reason, self.error = item.delta.finish_reason, item.delta.error
            self.stats = item.stats or self.stats


class Frontend:
    """Tokenizer, limits and routing of one served model."""

    def __init__(self, cfg: FrontendConfig, router: RouterClient | ActorHandle, resolve=lambda s: s) -> None:
        m = cfg.model
        self.cfg = cfg  # its own part of the config, assembled by the app (deploy/serve/frontend_config.py)
        self.model_name = m.served_name
        self.meta = load_metadata(resolve(m.target), m.dtype)  # tokenizer, chat template, context length
        self.tokenizer = self.meta.tokenizer
        self.token_strings = TokenStrings(self.tokenizer)  # what logprobs name each token by
        self.max_model_len = context_length(self.meta.max_model_len, m.max_model_len,
                                            cfg.cache_tokens)  # as the engine caps it
        self.vocab_size = self.meta.config.vocab_size
        # a bare handle (tests, benchmarks with their own router) gets deadlines but is never replaced
        self.router = router if isinstance(router, RouterClient) else RouterClient(router, reconnect_s=cfg.reconnect_s)
        self.metrics = Metrics(self.model_name)
        # recent first tokens and requests waiting for one: the autoscaler's TTFT (deploy/serve/ttft_reporter.py)
        self.first_tokens = FirstTokenRecord()
        self._releases: set[asyncio.Task] = set()  # supervised release calls under way
        # tokenization is CPU work: off the event loop, on a bounded pool fair among tenants (deploy/serve/tokenizing.py)
        self.tokenizing = TokenizerPool(self.tokenizer, cfg.tokenizer_workers, cfg.tokenizer_queue, cfg.retry_after_s)
        chars = max_chars_per_token(self.tokenizer)  # a text longer than the context * this cannot fit
        self.max_prompt_chars = None if chars is None else self.max_model_len * chars
        # a completion body larger than this holds a prompt that cannot fit, as text (6 bytes per character at
        # most, escaped) or as token ids (11 bytes each at most), besides its other fields (a few KB, bounded)
        self.max_completion_body = (None if chars is None
                                    else max(6 * self.max_prompt_chars, 11 * self.max_model_len) + (16 << 10))
        # cache-aware dispatch (and a router that places requests on prefill/decode pairs, docs/disaggregation.md)
        # is told the names of a prompt's full KV blocks (cluster/prefix.py), the names the instances give them
        self.block_size = cfg.block_size if cfg.route_by_blocks else None
        # how the model writes tool calls and reasoning (deploy/serve/chat_output.py), found once
        self.formats = ChatFormats.of(self.tokenizer, m.tool_parser, m.reasoning_parser)

    # ---- validation ---------------------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    async def encode_prompt(self, prompt: str | list[int], tenant: str = "") -> list[int]:
        """A prompt's token ids (a string is tokenized on the tokenizer pool; ids are checked in `prepare`)."""
        if isinstance(prompt, str):
            self._check_chars(len(prompt), "prompt")
            return await self.tokenizing.run(tenant, encode_text, prompt)
        return list(prompt)

    async def encode_chat(self, messages: list[dict], tenant: str = "", tools: list[dict] | None = None) -> list[int]:
        """The chat template applied (with the function tools it shows the model) and tokenized on the tokenizer
        pool."""
        if self.tokenizer.chat_template is None:
            raise APIError(400, f"the model {self.model_name!r} has no chat template; use /v1/completions",
                           param="messages")
        self._check_chars(sum(len(m["content"].strip()) for m in messages), "messages")
        return await self.tokenizing.run(tenant, _encode_chat, messages, tools)

    def check_completion_body(self, content_length: str) -> None:
        """Refuse, before reading it, a completion body whose declared size means a prompt that cannot fit."""
        if self.max_completion_body is not None and content_length.isdigit() \
                and int(content_length) > self.max_completion_body:
            raise APIError(400, f"a completion body of {content_length} bytes holds a prompt longer than this model's "
                                f"context of {self.max_model_len} tokens can hold", param="prompt",
                           code="context_length_exceeded")

    def _check_chars(self, chars: int, param: str) -> None:
        """Refuse, without tokenizing it, a text too long to fit the context whatever its tokens (see
        deploy/serve/tokenizing.py, max_chars_per_token)."""
        if self.max_prompt_chars is not None and chars > self.max_prompt_chars:
            raise APIError(400, f"the {param} has {chars} characters, more than this model's context of "
                                f"{self.max_model_len} tokens can hold with this tokenizer ({self.max_prompt_chars})",
                           param=param, code="context_length_exceeded")

    async def check_structured(self, spec: StructuredOutput | None, param: str | None, tenant: str = "") -> None:
        """Compile-check a structured output's schema or regex (on the tokenizer pool: a schema can be large), so
        that an invalid one is a 400 naming its field before the request is routed."""
        if spec is not None:
            try:
                await self.tokenizing.run(tenant, _check_structured, spec, param)
            except InvalidRequest as e:
                raise APIError(400, str(e), param=e.param, code="invalid_value") from None

    def prepare(self, prompt_ids: list[int], *, max_tokens: int | None, seed: int | None, n: int, priority: int,
                prompt_param: str = "prompt", prefix: str = "cmpl", tenant: str = "", cache_salt: str | None = None,
                **sampling) -> Prepared:
        """Check the prompt and build each choice's sampling parameters (`sampling`: SamplingParams' other fields),
        with the checks of cluster/request.py (the engine's own), so that what the engine would refuse is a 400
        naming the field here; token ids (logit_bias, stop_token_ids) are checked against the vocabulary."""
        arrival = time.monotonic()
        for field_ in ("logit_bias", "stop_token_ids"):
            if any(t >= self.vocab_size for t in sampling.get(field_) or ()):
                raise APIError(400, f"{field_}: token ids must be in [0, {self.vocab_size})", param=field_,
                               code="invalid_value")
        if sampling.get("structured") is not None and sampling.get("min_tokens"):
            raise APIError(400, "min_tokens cannot be combined with a structured output (the grammar decides where "
                                "the output may end)", param="min_tokens", code="invalid_value")
        if max_tokens == 0 and sampling.get("prompt_logprobs") is None:
            raise APIError(400, "max_tokens must be at least 1 (0 only scores a prompt: with echo and logprobs)",
                           param="max_tokens", code="invalid_value")
        try:
            max_tokens = check_prompt(prompt_ids, max_tokens, self.max_model_len, self.vocab_size)
            params = tuple(SamplingParams(seed=None if seed is None else seed + i, max_tokens=max_tokens, **sampling)
                           for i in range(n))
        except InvalidRequest as e:
            raise APIError(400, str(e), param=prompt_param if e.param == "prompt" else e.param,
                           code=e.code or "invalid_value") from None
        except ValidationError as e:
            raise from_validation_error(e) from None
        return Prepared(f"{prefix}-{uuid.uuid4().hex}", tuple(prompt_ids), params, priority, arrival, tenant,
                        cache_salt)

    def block_names(self, prep: Prepared, tokens: Sequence[int] = ()) -> tuple[int, ...]:
        """The names of the full KV blocks of the request's prompt (and `tokens` generated after it), for a
        cache-aware router; none when the router does not route by them."""
        if self.block_size is None:
            return ()
        root = request_root(self.cfg.prefix_identity, prep.tenant, prep.cache_salt, self.cfg.share_across_tenants)
        return tuple(block_hashes(prep.prompt_ids + tuple(tokens), self.block_size, root))

    # ---- dispatch -----------------------------------------------------------------------------------
    async def start(self, prep: Prepared) -> "Call":
        """Route every choice (raising APIError 429/503 before any output) and start their streams."""
        ids = [prep.request_id if len(prep.params) == 1 else f"{prep.request_id}-{i}" for i in range(len(prep.params))]
        routed: list[tuple[str, ActorHandle]] = []
        blocks = self.block_names(prep)
        shape = PromptShape(len(prep.prompt_ids), self.cfg.block_size) if self.cfg.disaggregated else None
        self.first_tokens.begin(prep.request_id, prep.arrival)  # it waits for its first token from its arrival
        try:
            for rid in ids:
                routed.append(await self._route(rid, prep.priority, blocks, shape))
        except Overloaded as e:
            self.first_tokens.end(prep.request_id)
            self.release(ids[:len(routed)], routed, RequestStatus.ABORTED)
            retry = str(self.cfg.retry_after_s)
            raise APIError(429, f"the server is busy: {_cause(e)}; retry after {retry} s", type_="rate_limit_error",
                           code="too_many_pending_requests", headers={"Retry-After": retry}) from None
        except NoInstanceAvailable as e:
            self.first_tokens.end(prep.request_id)
            self.release(ids[:len(routed)], routed, RequestStatus.ABORTED)
            raise APIError(503, f"no instance can take the request: {_cause(e)}", type_="service_unavailable",
                           code="no_instance") from None
        except BaseException:  # cancelled (the client left) or the router failed: nothing may stay routed
            self.first_tokens.end(prep.request_id)
            self.release(ids[:len(routed)], routed, RequestStatus.ABORTED)
            raise
        return Call(self, prep, ids, routed)

    async def _route(self, rid: str, priority: int, blocks: tuple[int, ...] = (),
                     shape: PromptShape | None = None) -> tuple[str, ActorHandle]:
        """One `router.route`; if the caller is cancelled while it is under way, its result is released later."""
        limit = self.cfg.max_pending_requests
        wait_s = self.cfg.failover.max_wait_s  # the router may wait up to that for an instance to come up
        routing = asyncio.get_running_loop().create_task(
            self.router.route(rid, priority, self.model_name, limit, blocks, shape,
                              timeout_s=wait_s + RELEASE_TIMEOUT_S),
            context=contextvars.Context())  # no child of the request: see above
        try:
            return await asyncio.shield(routing)
        except asyncio.CancelledError:
            self._supervise(self._release_when_routed(rid, routing), rid)
            raise

    async def _release_when_routed(self, rid: str, routing: asyncio.Future) -> None:
        try:
            routed = await routing
        except Exception:  # noqa: BLE001 - it was not routed (busy, no instance): nothing to release
            return
        await self._release_one(rid, routed[1], RequestStatus.ABORTED, abort=False)

    def release(self, ids: list[str], routed: list[tuple[str, ActorHandle]], status: RequestStatus,
                abort: bool = False) -> None:
        """Tell the router these sub-requests ended (and, with `abort`, their instances to stop them). Synchronous:
        the calls run in supervised tasks that await them and log a failure."""
        for rid, (_, handle) in zip(ids, routed):
            self._supervise(self._release_one(rid, handle, status, abort), rid)

    async def _release_one(self, rid: str, handle: ActorHandle, status: RequestStatus, abort: bool) -> None:
        if abort:  # idempotent at the instance: False if it already ended there
            try:
                await asyncio.wait_for(asyncio.wrap_future(handle.abort.remote(rid).future()), RELEASE_TIMEOUT_S)
            except (RayError, asyncio.TimeoutError) as e:
                log.warning("aborting request %s at its instance failed (%s: %s)", rid, type(e).__name__, e)
        try:  # idempotent at the router: a request that already ended keeps its status
            await self.router.finish(rid, status, timeout_s=RELEASE_TIMEOUT_S)
        except (RayError, asyncio.TimeoutError) as e:
            log.error("telling the router that request %s ended (%s) failed (%s: %s); its next poll closes it",
                      rid, status.value, type(e).__name__, e)

    async def failover(self, rid: str, failed: tuple[str, ActorHandle], priority: int,
                       blocks: tuple[int, ...] = ()) -> tuple[str, ActorHandle]:
        """Where a request whose instance failed resumes (the router records it there; `blocks`: the names of its
        tokens' full KV blocks, for a cache-aware router); the router may wait for an instance to join
        (learned from the starts it saw, at most `router.failover.max_wait_s`), so the deadline leaves it that long."""
        instance_id, handle = failed
        wait_s = self.cfg.failover.max_wait_s
        return await self.router.failover(rid, instance_id, handle, priority, self.model_name, blocks,
                                          timeout_s=wait_s + RELEASE_TIMEOUT_S)

    def _supervise(self, coro, rid: str) -> None:
        """Run a release in its own task, in a fresh context: its Ray calls are no children of the request."""
        task = asyncio.get_running_loop().create_task(coro, name=f"release-{rid}", context=contextvars.Context())
        self._releases.add(task)
        task.add_done_callback(self._released)

    def _released(self, task: asyncio.Task) -> None:
        self._releases.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("releasing %s failed", task.get_name(), exc_info=task.exception())


def public_error(request_id: str, what: str = "the request failed on the server") -> str:
    """What a client is told of a failure that is not its own: a fixed text and the request id. The detail (Ray's
    error text: node addresses, actor ids, tracebacks) goes to the replica's log under the same id."""
    return f"{what} (request id {request_id}; the cause is in the server's log)"


def _cause(e: BaseException) -> str:
    """An error's own message: one raised in an actor arrives as Ray's RayTaskError, traceback included, which a
    client must not see."""
    return str(getattr(e, "cause", None) or e)


def _check_structured(_tokenizer, spec: StructuredOutput, param: str) -> None:
    check_structured(spec, param)


def _encode_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    try:
        return encode_chat(tokenizer, messages, tools)
    except Exception as e:  # noqa: BLE001 - a template that rejects the conversation is the client's error
        raise APIError(400, f"the chat template rejected the messages: {str(e)[:300]}", param="messages") from None


class Call:
    """A started request: iterate it for (choice index, StreamItem); `aclose` (or leaving early) aborts the rest."""

    def __init__(self, frontend: Frontend, prep: Prepared, ids: list[str], routed: list[tuple[str, ActorHandle]]):
        self.f, self.prep, self.ids, self.routed = frontend, prep, ids, routed
        self._open = set(range(len(ids)))  # choices not yet released
        self._ended: set[int] = set()  # choices whose last item was handed out
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self._on_close: list[Callable[[], None]] = []  # e.g. the admission ticket's release (deploy/serve/edge.py)

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call `callback` once, when the call closes (at once if it already has)."""
        if self._closed:
            callback()
        else:
            self._on_close.append(callback)

    async def _one(self, index: int, out: asyncio.Queue) -> None:
        """One choice's task, supervised: whatever `_stream` raises ends the choice with an error item (it used to
        end the task silently and leave the client waiting, and the request pending, for good)."""
        try:
            await self._stream(index, out)
        except Exception:  # noqa: BLE001 - the choice ends with the error, logged with its cause
            log.exception("the stream of %s failed", self.ids[index])
            if index not in self._ended:
                await self._put(out, index, TokenDelta(self.ids[index], (), "", FinishReason.ERROR,
                                                       error=public_error(self.ids[index])))

    async def _stream(self, index: int, out: asyncio.Queue) -> None:
        """Stream one choice from its instance; follow it when it migrates, resume it elsewhere when its instance
        fails (failover: the prompt plus the tokens streamed so far, KV recomputed there; the router may wait for a
        replacement when none is left)."""
        rid = self.ids[index]
        request = Request(rid, self.prep.prompt_ids, self.prep.params[index], self.prep.priority, time.time(),
                          tenant=self.prep.tenant, cache_salt=self.prep.cache_salt)
        tokens: list[int] = []
        chars = failovers = 0
        max_failovers = self.f.cfg.failover.max_attempts
        submit = lambda h: h.generate.options(num_returns="streaming").remote(request)  # noqa: E731
        while True:
            instance_id, handle = self.routed[index]
            try:
                # outside the request's context: a recursive ray.cancel would otherwise end this stream with a
                # TaskCancelledError that reads as an instance failure; close() aborts it at the instance instead
                gen = contextvars.Context().run(submit, handle)
                async for ref in gen:
                    item: StreamItem = await ref
                    if item.migrated_to is not None:  # live migration: the rest comes from the destination
                        self.routed[index] = item.migrated_to
                        submit = lambda h: h.resume_stream.options(num_returns="streaming").remote(rid)  # noqa: E731
                        break
                    if item.delta.finished and item.delta.instance_failure:
                        raise InstanceFailed(item.delta.error or "the instance failed")
                    if item.delta.error and not item.rejected:  # the server's failure: its detail stays here
                        log.error("request %s failed on instance %s: %s", rid, instance_id, item.delta.error)
                        item = dataclasses.replace(item, delta=dataclasses.replace(item.delta,
                                                                                   error=public_error(rid)))
                    tokens.extend(item.delta.token_ids)
                    chars += len(item.delta.text)
                    if item.delta.finished:
                        self._ended.add(index)
                    await out.put((index, item))
                    if item.delta.finished:
                        return
                else:
                    raise RuntimeError("the stream ended without a final item")
                continue  # followed a migration: not a failure
            except (RayError, RuntimeError) as e:  # the instance died or failed mid-stream
                log.warning("request %s: instance %s failed (%s: %s)", rid, instance_id, type(e).__name__, e)
            if failovers == max_failovers:
                log.error("request %s: gave up after %d failovers", rid, failovers)
                await self._put(out, index, TokenDelta(rid, (), "", FinishReason.ERROR, error=public_error(
                    rid, f"the instance serving the request failed; gave up after {failovers} failovers")))
                return
            failovers += 1
            try:
                self.routed[index] = await self.f.failover(rid, (instance_id, handle), self.prep.priority,
                                                           self.f.block_names(self.prep, tokens))
            except (NoInstanceAvailable, RayError, KeyError, asyncio.TimeoutError) as e:
                log.error("request %s: no instance to resume on (%s: %s)", rid, type(e).__name__, e)
                await self._put(out, index, TokenDelta(rid, (), "", FinishReason.ERROR, error=public_error(
                    rid, "the instance serving the request failed and no other could resume it")))
                return
            resumed = dataclasses.replace(request, resume=Resume(tuple(tokens), chars))
            submit = lambda h, r=resumed: h.generate.options(num_returns="streaming").remote(r)  # noqa: E731

    async def _put(self, out: asyncio.Queue, index: int, delta: TokenDelta) -> None:
        """A choice's last item, made here (an error)."""
        self._ended.add(index)
        await out.put((index, StreamItem(delta)))

    async def __aiter__(self) -> AsyncIterator[tuple[int, StreamItem]]:
        if self._closed:
            return
        out: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.get_running_loop().create_task(self._one(i, out)) for i in range(len(self.ids))]
        timer = RequestTimer(self.f.metrics, self.prep.arrival, self.f.first_tokens, self.prep.request_id)
        try:
            while self._open:
                for index, item in coalesce_choices([await out.get(), *waiting(out)]):
                    timer.observe(index, item)
                    if item.delta.finished:
                        self._open.discard(index)
                        self._finished(index, item)
                    yield index, item
        finally:
            self.close()

    def close(self) -> None:
        """Abort whatever still runs and free its KV (idempotent, synchronous). Transports call it when their
        client goes away, before any await: an abandoned async generator is only finalized whenever the garbage
        collector gets to it, and one that never started is never finalized at all."""
        self._closed = True
        self.f.first_tokens.end(self.prep.request_id)  # no first token now (or it had one): it waits no more
        for t in self._tasks:
            t.cancel()
        if self._open:
            still = sorted(self._open)
            self.f.release([self.ids[i] for i in still], [self.routed[i] for i in still], RequestStatus.ABORTED,
                           abort=True)
            self._open.clear()
        callbacks, self._on_close = self._on_close, []
        for callback in callbacks:
            callback()

    def _finished(self, index: int, item: StreamItem) -> None:
        reason = item.delta.finish_reason
        self.f.release([self.ids[index]], [self.routed[index]], RequestStatus.of(reason))
        self.f.metrics.finished(reason.value, len(self.prep.prompt_ids) if index == 0 else 0, item.stats)

    async def collect(self) -> list[Choice]:
        choices = [Choice(i) for i in range(len(self.ids))]
        try:
            async for index, item in self:
                choices[index].add(item)
        finally:
            self.close()
        return choices
