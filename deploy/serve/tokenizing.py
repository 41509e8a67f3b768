"""Tokenization off the event loop on a bounded pool: a tokenizer copy per thread, a bounded queue, fair among tenants.

A megabyte of prompt takes most of a second to tokenize. On one shared thread, a few such prompts queue every
tenant's requests behind them; on an unbounded queue, a flood of them holds memory and time without limit. Here:

- `workers` threads, each job with a tokenizer copy of its own (a fast tokenizer's state is not safe to share
  between threads: padding and truncation settings live in it);
- one tenant runs on at most `workers - 1` of them (all, with one worker), so a thread stays free for the others;
- at most `queue` jobs wait for a thread, served round-robin by tenant; one more is refused with 429 and
  Retry-After (deploy/serve/admission.py, `too_many`);
- the bookkeeping runs on the event loop; a thread's slot is given back when its job ends, even if the request
  that waited for it was cancelled meanwhile (the job still holds its tokenizer copy until then).

transformers' `encode` and `apply_chat_template` release the GIL while the Rust tokenizer runs, so these
threads do not stall the replica's event loop.

Before any of that, a prompt that cannot fit the context is refused by its length alone where that is sound
(`max_chars_per_token`): a byte-level BPE tokenizer without a normalizer covers every character of its input
with tokens of at most L characters each, so a text of more than context * L characters has more tokens than
the context holds.
"""

from __future__ import annotations

import asyncio
import copy
import json
import queue
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from deploy.serve.admission import too_many

T = TypeVar("T")


class TokenizerPool:
    """Run `fn(tokenizer, *args)` on a pool thread for a tenant; see the module docstring for the rules."""

    def __init__(self, tokenizer: Any, workers: int, queue_limit: int, retry_after_s: int) -> None:
        self.workers, self.queue_limit, self.retry_after_s = workers, queue_limit, retry_after_s
        self.share = max(1, workers - 1)  # threads one tenant may hold at once
        self._copies: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(workers):
            self._copies.put(tokenizer if i == 0 else copy.deepcopy(tokenizer))
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")
        self._running: dict[str, int] = {}
        self._waiting: dict[str, deque[asyncio.Future]] = {}  # tenant -> its jobs' gates, in arrival order
        self._queued = 0
        self._turn: deque[str] = deque()  # tenants in round-robin order

    @property
    def busy(self) -> int:
        return sum(self._running.values())

    @property
    def queued(self) -> int:
        return self._queued

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        if self._may_start(tenant):
            self._running[tenant] = self._running.get(tenant, 0) + 1
        else:
            await self._wait_turn(tenant, loop)
        job = self._executor.submit(self._call, fn, args)
        job.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finished, tenant))
        return await asyncio.wrap_future(job)

    def _may_start(self, tenant: str) -> bool:
        return self.busy < self.workers and self._running.get(tenant, 0) < self.share

    async def _wait_turn(self, tenant: str, loop: asyncio.AbstractEventLoop) -> None:
        if self._queued >= self.queue_limit:
            raise too_many(f"{self.busy} prompts are being tokenized and {self._queued} wait (serve.edge."
                           f"tokenizer_queue)", "tokenizer_queue_full", self.retry_after_s)
        gate = loop.create_future()
        self._waiting.setdefault(tenant, deque()).append(gate)
        if tenant not in self._turn:
            self._turn.append(tenant)
        self._queued += 1
        try:
            await gate
        except asyncio.CancelledError:
            if gate.done() and not gate.cancelled():  # a thread was given to us just now: hand it on
                self._finished(tenant)
            else:
                self._waiting[tenant].remove(gate)
                self._queued -= 1
            raise

    def _finished(self, tenant: str) -> None:
        """A job of `tenant` ended: give its thread to the next waiting tenant in turn that may take one."""
        self._running[tenant] -= 1
        if not self._running[tenant]:
            del self._running[tenant]
        for _ in range(len(self._turn)):
            if self.busy >= self.workers:
                return
            who = self._turn[0]
            self._turn.rotate(-1)
            gates = self._waiting.get(who)
            if not gates:
                self._turn.remove(who)
                self._waiting.pop(who, None)
                continue
            if self._running.get(who, 0) >= self.share:
                continue
            gate = gates.popleft()
            self._queued -= 1
            self._running[who] = self._running.get(who, 0) + 1
            gate.set_result(None)
            return

    def _call(self, fn: Callable[..., T], args: tuple) -> T:
        tokenizer = self._copies.get_nowait()  # never empty: at most `workers` jobs run
        try:
            return fn(tokenizer, *args)
        finally:
            self._copies.put(tokenizer)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of its input one token covers, when the tokenizer provably covers every character with
    tokens (a BPE model over byte-level pre-tokenization, no normalizer, no splitting that drops characters);
    None otherwise (a normalizer may shrink the text, so no bound by length is sound)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    if spec.get("normalizer") is not None or spec.get("model", {}).get("type") != "BPE":
        return None
    pre = spec.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    keeps = all(p.get("type") in ("ByteLevel", "Digits") or (p.get("type") == "Split" and p.get("behavior") != "Removed")
                for p in parts)
    if not keeps or not any(p.get("type") == "ByteLevel" for p in parts):
        return None
    vocab = backend.get_vocab(with_added_tokens=False)  # byte-level strings: one character per byte
    added = [t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values()]
    return max(max(map(len, vocab), default=1), max(map(len, added), default=1))
