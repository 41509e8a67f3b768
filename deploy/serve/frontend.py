"""What the HTTP and gRPC endpoints share: validate and tokenize, ask the router where, stream from the instance.

    frontend = Frontend(cfg, router)                  # in the API replica
    call = await frontend.start(frontend.prepare(...))  # routed: 404/429/503 are raised here, before any output
    async for index, item in call: ...                 # StreamItems of every choice, merged
    # leaving the loop early (client disconnect) aborts whatever is still running and frees its KV

Everything the engine would refuse is refused here first, with the field it concerns, so a stream that has
begun can only end in an error if an instance fails.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from ray.actor import ActorHandle
from ray.exceptions import RayError

from actors.model.loader import load_metadata
from actors.serving import StreamItem
from cluster.config import SpecfleetConfig
from cluster.registry import NoInstanceAvailable
from cluster.request import FinishReason, Request, SamplingParams, SpecStats, TokenDelta
from cluster.router import Overloaded
from deploy.serve.metrics import Metrics
from deploy.serve.openai_api import APIError


@dataclass(frozen=True)
class Prepared:
    """A validated request: its tokens and, per choice, its sampling parameters."""

    request_id: str
    prompt_ids: tuple[int, ...]
    params: tuple[SamplingParams, ...]  # one per choice (n)
    priority: int
    arrival: float


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

    def add(self, item: StreamItem) -> None:
        self.text += item.delta.text
        self.token_ids.extend(item.delta.token_ids)
        self.rejected |= item.rejected
        if item.delta.finished:
            self.finish_reason, self.error = item.delta.finish_reason, item.delta.error
            self.stats = item.stats or self.stats


class Frontend:
    """Tokenizer, limits and routing of one served model."""

    def __init__(self, cfg: SpecfleetConfig, router: ActorHandle, resolve=lambda s: s) -> None:
        m = cfg.engine.model
        self.cfg = cfg
        self.model_name = m.served_name
        self.meta = load_metadata(resolve(m.target), m.dtype)  # tokenizer, chat template, context length
        self.tokenizer = self.meta.tokenizer
        self.max_model_len = min(m.max_model_len or self.meta.max_model_len, self.meta.max_model_len)
        self.vocab_size = self.meta.config.vocab_size
        self.router = router
        self.metrics = Metrics(self.model_name)

    # ---- validation ---------------------------------------------------------------------------------
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"the model {model!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")
        return list(prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if self.tokenizer.chat_template is None:
            raise APIError(400, f"the model {self.model_name!r} has no chat template; use /v1/completions",
                           param="messages")
        try:
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                     return_dict=False)
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation is the client's error
            raise APIError(400, f"the chat template rejected the messages: {e}", param="messages") from None
        return list(ids)

    def prepare(self, prompt_ids: list[int], *, max_tokens: int | None, temperature: float, top_p: float,
                top_k: int, seed: int | None, stop: tuple[str, ...], n: int, priority: int, ignore_eos: bool,
                prompt_param: str = "prompt", prefix: str = "cmpl") -> Prepared:
        """Check lengths against the context and build each choice's sampling parameters."""
        arrival = time.monotonic()
        p = len(prompt_ids)
        if p == 0:
            raise APIError(400, "the prompt is empty", param=prompt_param)
        if p >= self.max_model_len:
            raise APIError(400, f"the prompt has {p} tokens; this model's context is {self.max_model_len} tokens",
                           param=prompt_param, code="context_length_exceeded")
        room = self.max_model_len - p
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise APIError(400, f"max_tokens ({max_tokens}) + the prompt ({p} tokens) exceed this model's context "
                           f"of {self.max_model_len} tokens", param="max_tokens", code="context_length_exceeded")
        params = tuple(
            SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k,
                           seed=None if seed is None else seed + i, max_tokens=max_tokens, stop=stop,
                           ignore_eos=ignore_eos)
            for i in range(n))
        return Prepared(f"{prefix}-{uuid.uuid4().hex}", tuple(prompt_ids), params, priority, arrival)

    # ---- dispatch -----------------------------------------------------------------------------------
    async def start(self, prep: Prepared) -> "Call":
        """Route every choice (raising APIError 429/503 before any output) and start their streams."""
        ids = [prep.request_id if len(prep.params) == 1 else f"{prep.request_id}-{i}" for i in range(len(prep.params))]
        routed: list[tuple[str, ActorHandle]] = []
        try:
            for rid in ids:
                routed.append(await self.router.route.remote(rid, prep.priority, self.model_name,
                                                            self.cfg.serve.max_pending_requests))
        except Overloaded as e:
            self._release(ids[:len(routed)], routed, "aborted")
            retry = str(self.cfg.serve.retry_after_s)
            raise APIError(429, f"the server is busy: {e}; retry after {retry} s", type_="rate_limit_error",
                           code="too_many_pending_requests", headers={"Retry-After": retry}) from None
        except NoInstanceAvailable as e:
            self._release(ids[:len(routed)], routed, "aborted")
            raise APIError(503, f"no instance can take the request: {e}", type_="service_unavailable",
                           code="no_instance") from None
        return Call(self, prep, ids, routed)

    def _release(self, ids: list[str], routed: list[tuple[str, ActorHandle]], status: str,
                 abort: bool = False) -> None:
        """Tell the router these sub-requests ended (and the instances to abort them); fire and forget."""
        for rid, (_, handle) in zip(ids, routed):
            if abort:
                handle.abort.remote(rid)
            self.router.finish.remote(rid, status)


_ROUTER_STATUS = {FinishReason.STOP: "finished", FinishReason.LENGTH: "finished", FinishReason.ABORT: "aborted",
                  FinishReason.ERROR: "failed"}


class Call:
    """A started request: iterate it for (choice index, StreamItem); `aclose` (or leaving early) aborts the rest."""

    def __init__(self, frontend: Frontend, prep: Prepared, ids: list[str], routed: list[tuple[str, ActorHandle]]):
        self.f, self.prep, self.ids, self.routed = frontend, prep, ids, routed
        self._open = set(range(len(ids)))
        self._tasks: list[asyncio.Task] = []

    async def _one(self, index: int, out: asyncio.Queue) -> None:
        rid, (_, handle) = self.ids[index], self.routed[index]
        request = Request(rid, self.prep.prompt_ids, self.prep.params[index], self.prep.priority, time.time())
        try:
            gen = handle.generate.options(num_returns="streaming").remote(request)
            async for ref in gen:
                item: StreamItem = await ref
                await out.put((index, item))
                if item.delta.finished:
                    return
            raise RuntimeError("the stream ended without a final item")
        except (RayError, RuntimeError) as e:  # the instance died or failed mid-stream
            await out.put((index, StreamItem(TokenDelta(rid, (), "", FinishReason.ERROR,
                                                        error=f"the instance failed: {type(e).__name__}: {e}"))))

    async def __aiter__(self) -> AsyncIterator[tuple[int, StreamItem]]:
        out: asyncio.Queue = asyncio.Queue()
        self._tasks = [asyncio.get_running_loop().create_task(self._one(i, out)) for i in range(len(self.ids))]
        timer = _Timer(self.f.metrics, self.prep.arrival)
        try:
            while self._open:
                index, item = await out.get()
                timer.observe(index, item)
                if item.delta.finished:
                    self._open.discard(index)
                    self._finished(index, item)
                yield index, item
        finally:
            self.close()

    def close(self) -> None:
        """Abort whatever still runs and free its KV (idempotent). Transports call it when their client goes
        away: an abandoned async generator is only finalized whenever the garbage collector gets to it."""
        for t in self._tasks:
            t.cancel()
        if self._open:
            still = sorted(self._open)
            self.f._release([self.ids[i] for i in still], [self.routed[i] for i in still], "aborted", abort=True)
            self._open.clear()

    def _finished(self, index: int, item: StreamItem) -> None:
        reason = item.delta.finish_reason
        self.f.router.finish.remote(self.ids[index], _ROUTER_STATUS[reason])
        self.f.metrics.finished(reason.value, len(self.prep.prompt_ids) if index == 0 else 0, item.stats)

    async def collect(self) -> list[Choice]:
        choices = [Choice(i) for i in range(len(self.ids))]
        async for index, item in self:
            choices[index].add(item)
        return choices


class _Timer:
    """Feeds the latency histograms from one request's items."""

    def __init__(self, metrics: Metrics, arrival: float) -> None:
        self.m, self.arrival = metrics, arrival
        self.first: float | None = None
        self.last: dict[int, float] = {}

    def observe(self, index: int, item: StreamItem) -> None:
        now, model = time.monotonic(), self.m.model
        if item.queue_s is not None:
            self.m.queue.labels(model).observe(item.queue_s)
        if item.delta.token_ids:
            self.m.generation_tokens.labels(model).inc(len(item.delta.token_ids))
            if self.first is None:
                self.first = now
                self.m.ttft.labels(model).observe(now - self.arrival)
            if index in self.last:
                self.m.itl.labels(model).observe(now - self.last[index])
            self.last[index] = now
        if item.delta.finished:
            self.m.e2e.labels(model).observe(now - self.arrival)
