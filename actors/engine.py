"""The instance engine: continuous batching with lossless speculative decoding; `step()` maps the data plane.

Each step runs one speculative round for every running request: the draft proposes k tokens
autoregressively (its first forward also catches up on tokens it has not seen yet: the prompt, the
previous round's last accepted draft and the target's bonus token), the target scores all k+1
positions of every request in one forward, greedy matching or rejection sampling accepts a prefix,
and rejected KV is cropped in both caches. The same path serves prefill: a request's first round
feeds its whole prompt. See actors/spec/verify.py for the vocabulary (accepted, recovered, bonus).

KV invariants after every round, per running request with n = len(token_ids):
  target cache holds exactly tokens [0, n-1) (the newest token is fed next round);
  draft cache holds a prefix [0, m), m <= n-1.
Out of KV blocks: waiting requests wait; a running request that cannot grow preempts the
lowest-priority, latest-arrived running request, whose KV is freed and recomputed on resumption
(recompute rather than swap: on CPU a swap is a copy to the same memory, and recompute keeps the
output identical at temperature 0).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass

import torch
from transformers import PreTrainedTokenizerBase

from actors.model.loader import LoadedModel, load_model
from actors.model.metadata import SeqChunk
from actors.model.quant import quantize_runner_int8
from actors.model.runner import ModelRunner
from actors.output import RequestOutput
from actors.sequence import Sequence, SeqStatus
from actors.spec.sampling import make_generator, probs_from_logits, sample
from actors.spec.verify import verify_greedy, verify_sampled
from cluster.config import ConfigError, EngineConfig, SpeculationConfig
from cluster.request import FinishReason, Request, SamplingParams, SpecStats, TokenDelta


class RequestError(ValueError):
    """A request the engine cannot take (empty prompt, too long, bad token ids...)."""


@dataclass
class Completion:
    """A finished request, as `Engine.generate` returns it."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    stats: SpecStats
    error: str | None = None


class Engine:
    """One model instance in one process: a target runner, an optional draft runner, and the step loop."""

    def __init__(
        self,
        target: ModelRunner,
        draft: ModelRunner | None,
        speculation: SpeculationConfig,
        max_batch_size: int = 8,
        max_model_len: int | None = None,
    ) -> None:
        if draft is not None and draft.model.config.vocab_size != target.model.config.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft.model.config.vocab_size}) differs from the target's "
                f"({target.model.config.vocab_size}): they must share a tokenizer"
            )
        self.target, self.draft = target, draft
        self.k = speculation.k if (draft is not None and speculation.policy != "off") else 0
        self.max_batch_size = max_batch_size
        self.max_model_len = min(max_model_len or target.model.max_model_len, target.model.max_model_len)
        self.tokenizer: PreTrainedTokenizerBase = target.model.tokenizer
        self.eos_token_ids = target.model.eos_token_ids
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._finished: list[TokenDelta] = []  # ended outside a round (errors), reported at the next step
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, cfg: EngineConfig, resolve: Callable[[str], str] = lambda s: s) -> "Engine":
        """Load the model pair named by `cfg` (`resolve` maps catalog names to files) and build the engine."""
        m = cfg.model
        target_model = load_model(resolve(m.target), m.dtype)
        target = ModelRunner(target_model, range(target_model.num_layers), cfg.cache)
        draft = None
        if cfg.speculation.policy != "off":
            if m.draft is not None:
                draft_model = load_model(resolve(m.draft), m.dtype)
                draft = ModelRunner(draft_model, range(draft_model.num_layers), cfg.cache)
            elif m.draft_layers is not None:
                n = target_model.num_layers
                if any(not 0 <= i < n for i in m.draft_layers):
                    raise ConfigError(f"model.draft_layers: {list(m.draft_layers)} not within the target's {n} layers")
                draft = ModelRunner(target_model, m.draft_layers, cfg.cache)
            if draft is not None and m.draft_quantization == "int8":
                quantize_runner_int8(draft)
        return cls(target, draft, cfg.speculation, cfg.max_batch_size, m.max_model_len)

    # ---- requests ---------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Tokenize a prompt with the target's tokenizer (see LoadedModel.encode)."""
        return self.target.model.encode(prompt, chat)

    def add_request(self, request: Request) -> None:
        """Queue a request; raises RequestError if it can never be served."""
        self.check_request(request)
        self._enqueue(request)

    def _enqueue(self, request: Request) -> Sequence:
        """Queue an already checked request."""
        params = request.params
        out = RequestOutput(self.tokenizer, params, self.eos_token_ids, params.max_tokens)
        gen = None if params.greedy else make_generator(params)
        seq = Sequence(request, list(request.prompt_token_ids), out, gen, seqno=next(self._ids))
        self.waiting.append(seq)
        return seq

    def check_request(self, request: Request) -> None:
        """Raise RequestError if the request can never be served; changes nothing."""
        n = len(request.prompt_token_ids)
        if n == 0:
            raise RequestError("the prompt is empty")
        vocab = self.target.model.config.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        if n >= self.max_model_len:
            raise RequestError(f"the prompt has {n} tokens; the model's context is {self.max_model_len}")
        if n + request.params.max_tokens > self.max_model_len:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({request.params.max_tokens}) exceeds the model's "
                f"context of {self.max_model_len} tokens"
            )
        if any(s.request_id == request.request_id for s in self.waiting + self.running):
            raise RequestError(f"request id {request.request_id!r} is already in use")

    def abort(self, request_id: str) -> TokenDelta | None:
        """Cancel a request and free its KV; returns its final delta, or None if it is unknown."""
        for queue in (self.waiting, self.running):
            for seq in queue:
                if seq.request_id == request_id:
                    queue.remove(seq)
                    self._free(seq)
                    seq.output.finish_reason = FinishReason.ABORT
                    return TokenDelta(request_id, (), seq.output.text_delta(), FinishReason.ABORT)
        return None

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._finished)

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams]) -> list[Completion]:
        """Serve a batch of tokenized prompts to completion (offline use); results in prompt order."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        requests = [Request(f"gen-{next(self._ids)}", tuple(p), sp) for p, sp in zip(prompts, params_list, strict=True)]
        for r in requests:  # all or nothing: a bad prompt must not leave the good ones queued
            self.check_request(r)
        done: dict[str, Completion] = {}
        for r in requests:
            seq = self._enqueue(r)
            done[r.request_id] = Completion(r.request_id, list(r.prompt_token_ids), [], "", None, seq.stats)
        while any(c.finish_reason is None for c in done.values()) and self.has_unfinished():
            for delta in self.step():
                c = done.get(delta.request_id)
                if c is not None:
                    c.token_ids.extend(delta.token_ids)
                    c.text += delta.text
                    c.finish_reason, c.error = delta.finish_reason, delta.error
        return list(done.values())

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        """One round: schedule, draft, verify, accept, emit."""
        batch = self._schedule()
        deltas, self._finished = self._finished, []
        if not batch:
            return deltas
        ks = [self._num_draft_tokens(seq) for seq in batch]
        drafts, draft_probs = self._propose(batch, ks)
        target_logits = self._score(batch, drafts)
        for seq, d, q, logits in zip(batch, drafts, draft_probs, target_logits):
            deltas.append(self._accept(seq, d, q, logits))
        return deltas

    def _num_draft_tokens(self, seq: Sequence) -> int:
        """k for this round: the configured K, never more than the tokens still allowed minus the bonus."""
        return max(0, min(self.k, seq.remaining - 1))

    def _schedule(self) -> list[Sequence]:
        """Make room for this round of every running request (preempting if needed), then admit waiting ones."""
        for seq in sorted(self.running, key=Sequence.order_key):
            while seq.status is SeqStatus.RUNNING and not self._reserve(seq):
                victim = max(self.running, key=Sequence.order_key)
                self._preempt(victim)
        for seq in sorted(self.waiting, key=Sequence.order_key):
            if len(self.running) >= self.max_batch_size:
                break
            if not self._reserve(seq):
                self._free(seq)
                if not self.running:  # alone in an empty cache and still no room: it never fits
                    self.waiting.remove(seq)
                    self._fail(seq, "the request does not fit in the KV cache")
                    continue
                break
            self.waiting.remove(seq)
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
        return sorted(self.running, key=Sequence.order_key)

    def _reserve(self, seq: Sequence) -> bool:
        """Reserve KV for the next round: the target gets n + k tokens, the draft n + k - 1."""
        n, k = len(seq.token_ids), self._num_draft_tokens(seq)
        ok = self.target.reserve(seq.request_id, n + k)
        if ok and self.draft is not None and k > 0:
            ok = self.draft.reserve(seq.request_id, n + k - 1)
        return ok

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.status = SeqStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.append(seq)

    def _free(self, seq: Sequence) -> None:
        self.target.cache.free(seq.request_id)
        if self.draft is not None:
            self.draft.cache.free(seq.request_id)

    def _fail(self, seq: Sequence, message: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.output.finish_reason = FinishReason.ERROR
        self._finished.append(TokenDelta(seq.request_id, (), "", FinishReason.ERROR, error=message))

    def _propose(self, batch: list[Sequence], ks: list[int]) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
        """Draft k_i tokens for each request, batched position by position.

        Returns per request the draft tokens and, for sampled requests, the draft distributions q (V,).
        """
        drafts: list[list[int]] = [[] for _ in batch]
        probs: list[list[torch.Tensor]] = [[] for _ in batch]
        for j in range(max(ks, default=0)):
            rows = [i for i, k in enumerate(ks) if k > j]
            chunks = []
            for i in rows:
                seq = batch[i]
                new = seq.token_ids[self.draft.cache.length(seq.request_id):] if j == 0 else drafts[i][-1:]
                chunks.append(SeqChunk(seq.request_id, tuple(new)))
            logits = self.draft.forward(chunks)  # (len(rows), V)
            for i, row in zip(rows, logits):
                seq = batch[i]
                if seq.greedy:
                    drafts[i].append(int(row.argmax()))
                else:
                    q = probs_from_logits(row[None], seq.request.params)  # (1, V)
                    drafts[i].append(int(sample(q, seq.generator)))
                    probs[i].append(q[0])
        return drafts, probs

    def _score(self, batch: list[Sequence], drafts: list[list[int]]) -> list[torch.Tensor]:
        """One target forward over every request's unseen tokens plus its drafts; logits (k+1, V) each."""
        chunks = [
            SeqChunk(seq.request_id, tuple(seq.token_ids[self.target.cache.length(seq.request_id):] + d), len(d) + 1)
            for seq, d in zip(batch, drafts)
        ]
        logits = self.target.forward(chunks)  # (sum(k_i + 1), V)
        return list(logits.split([len(d) + 1 for d in drafts]))

    def _accept(self, seq: Sequence, draft: list[int], q: list[torch.Tensor], logits: torch.Tensor) -> TokenDelta:
        """Verify one request's drafts, emit the accepted tokens plus one, and crop rejected KV."""
        n_before = len(seq.token_ids)
        d = torch.tensor(draft, dtype=torch.long)
        if seq.greedy:
            accepted, extra = verify_greedy(d, logits)
        else:
            p = probs_from_logits(logits, seq.request.params)  # (k+1, V)
            q_ = torch.stack(q) if q else p[:0]
            accepted, extra = verify_sampled(d, q_, p, seq.generator)
        if draft:
            seq.stats.record(len(draft), accepted)
        taken = seq.output.append(draft[:accepted] + [extra])
        seq.token_ids.extend(taken)
        rid = seq.request_id
        if seq.output.finish_reason is not None:
            self.running.remove(seq)
            self._free(seq)
            seq.status = SeqStatus.FINISHED
        else:
            self.target.cache.crop(rid, n_before + accepted)
            if self.draft is not None and self.draft.cache.has(rid):
                self.draft.cache.crop(rid, min(self.draft.cache.length(rid), n_before + accepted))
        return TokenDelta(rid, tuple(taken), seq.output.text_delta(), seq.output.finish_reason)
