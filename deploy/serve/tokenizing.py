"""Tokenization off the event loop on a bounded pool: a tokenizer copy per thread, a bounded queue, fair among tenants.

A megabyte of prompt takes most of a second to tokenize. On one shared thread, a few such prompts queue every
tenant's requests behind them; on an unbounded queue, a flood of them holds memory and time without limit. Here:

- `workers` threads, each job with a tokenizer copy of its own (a fast tokenizer's state is not safe to share
  between threads: padding and truncation settings live in it);
- shared among tenants by cluster/fair_share.py's rules (one tenant on at most `workers - 1` threads, at most
  `queue` jobs waiting, round-robin by tenant); one more is refused with 429 and Retry-After
  (deploy/serve/admission.py, `too_many`); a job holds its tokenizer copy until it ends.

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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from cluster.fair_share import FairSlots
from deploy.serve.admission import too_many

T = TypeVar("T")


class TokenizerPool:
    """Run `fn(tokenizer, *args)` on a pool thread for a tenant; see the module docstring for the rules."""

    def __init__(self, tokenizer: Any, workers: int, queue_limit: int, retry_after_s: int) -> None:
        self.workers, self.queue_limit, self.retry_after_s = workers, queue_limit, retry_after_s
        self.slots = FairSlots(workers, queue_limit, self._full)  # cluster/fair_share.py: the sharing rules
        self._copies: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(workers):
            self._copies.put(tokenizer if i == 0 else copy.deepcopy(tokenizer))
        self._executor = ThreadPoolExecutor(workers, thread_name_prefix="tokenize")

    @property
    def busy(self) -> int:
        return self.slots.busy

    @property
    def queued(self) -> int:
        return self.slots.queued

    async def run(self, tenant: str, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.wrap_future(await self.slots.submit(self._executor, tenant, self._call, fn, args))

    def _full(self, busy: int, queued: int) -> Exception:
        return too_many(f"{busy} prompts are being tokenized and {queued} wait (serve.edge.tokenizer_queue)",
                        "tokenizer_queue_full", self.retry_after_s)

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
