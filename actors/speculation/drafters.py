"""Draft kinds behind one interface: a draft model (plain, int8 or a layer subset of the target) and model-free lookups.

The engine asks a drafter, per step, for a `Proposal` (actors/speculation/step.py) per drafting work: up to its k tokens
and, for sampled requests, the draft distribution q of each. A model drafter runs its own forwards over its own
KV; its cache follows a request only while the request drafts: it catches up on the tokens it has not
seen (lazily, in its first forward of the next round that drafts), so a request the policy gives k = 0
costs it nothing. A lookup drafter (n-gram, suffix; actors/speculation/lookup.py) runs no forward and holds no
KV; its proposals are deterministic, so q is one-hot on the proposed token, with which rejection
sampling (actors/speculation/verify.py) still emits exactly the target's distribution.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from actors.model.metadata import SeqChunk
from actors.model.runner import ModelRunner
from actors.speculation.cost_model import ATTENTION_UNIT, ForwardShape
from actors.speculation.evidence import match_class
from actors.speculation.coupled import coupled_tokens
from actors.speculation.lookup import NgramIndex, OutputCache, SuffixIndex, suffix_match
from actors.speculation.processors import process_request, processes
from actors.speculation.sampling import probs_from_logits, sample
from actors.speculation.step import Drafting, Drafts, Proposal, Work
from actors.speculation.step import SeqState as Sequence  # the engine's request state, as speculation reads it
from cluster.config import DraftParallelConfig, SpeculationConfig

DraftKind = Literal["model", "ngram", "suffix"]  # a model draft of any weights (plain, int8, a layer subset) is "model"


class Drafter(Protocol):
    """What the engine needs of a draft kind."""

    kind: DraftKind  # which method proposes (cluster.config SpeculationConfig.method)
    runs_forwards: bool  # whether proposing costs draft forwards (the cost model's `draft` part)

    def lookahead(self, seq: Sequence, k: int) -> int:
        """At most how many tokens it would propose for `seq` now (k for a model; the match for a lookup)."""
        ...

    def evidence(self, seq: Sequence) -> int | None:
        """After `lookahead`: the class of what backs its proposal (a lookup: the context length it matched, 0 for
        none), keying the planner's acceptance estimate (actors/speculation/evidence.py); None: no such class."""
        ...

    def backlog(self, seq: Sequence, end: int) -> int:
        """Tokens it must catch up on before drafting after position `end` (0 for a lookup)."""
        ...

    def reserve(self, w: Work, k: int) -> int:
        """Room for k drafts of this work; returns the k that fits."""
        ...

    def propose(self, drafting: Seq[Drafting]) -> Drafts:
        """A proposal of k tokens (fewer for a lookup without a match) per drafting work, and the forwards it ran."""
        ...

    def accepted(self, seq: Sequence, length: int) -> None:
        """The request's tokens [0, length) are final: drop what the drafter holds beyond them."""
        ...

    def release(self, seq: Sequence, finished: bool) -> None:
        """The request left the engine (finished) or was preempted; free what the drafter holds for it."""
        ...


class ModelDrafter:
    """A draft model with its own KV cache, drafting autoregressively, batched position by position."""

    kind: DraftKind = "model"
    runs_forwards = True

    def __init__(self, runner: ModelRunner, device: torch.device | None = None,
                 parallel: DraftParallelConfig = DraftParallelConfig(), coupled: bool = False) -> None:
        self.runner = runner
        self.device = device  # where the target's logits arrive: q must sit beside p
        # sampled proposals by position-keyed noise, as the target's (actors/speculation/coupled.py)
        self.coupled = coupled
        # EasySpec (actors/speculation/easyspec.py): forwards after a round's first run the layer groups in parallel;
        # with bonus calibration the first runs in true order and the KV of the parallel ones is dropped after verifying
        self.parallel = parallel.enabled
        self.calibrate = parallel.calibrate or not parallel.enabled
        self._exact: dict[str, int] = {}  # per request, the prefix of its draft KV computed in true layer order
        self._drafted: dict[str, int] = {}  # per request, how far its last round's forwards wrote draft KV
        self.calibration = Calibration()

    def lookahead(self, seq: Sequence, k: int) -> int:
        return k

    def evidence(self, seq: Sequence) -> int | None:
        return None  # a model's drafts are alike: the request's own estimate is the one to go by

    def backlog(self, seq: Sequence, end: int) -> int:
        return max(0, end - self.runner.cache.length(seq.request_id))

    def reserve(self, w: Work, k: int) -> int:
        seq, cache = w.seq, self.runner.cache
        end = w.start + w.num_new
        if k > 0 and seq.draft_names is not None and not cache.has(seq.request_id):  # a cached prefix skips catch-up
            self._exact[seq.request_id] = cache.match(seq.request_id, seq.draft_names.upto(seq.token_ids, end - 1))
        if k > 0 and not self.runner.reserve(seq.request_id, end + k - 1):
            self.release(seq, finished=False)  # draft KV is optional: drop it, catch up later
            return 0
        return k

    def propose(self, drafting: Seq[Drafting]) -> Drafts:
        """Forward j feeds each work still drafting at position j one token; the first also feeds each its
        backlog (prompt chunks and accepted tokens it has not seen), so a request that paused catches up here."""
        t_start = time.perf_counter()
        out = {d.request_id: Proposal() for d in drafting}
        probs: dict[str, list[torch.Tensor]] = {d.request_id: [] for d in drafting}
        stuck: set[str] = set()  # requests whose last draft the grammar refused (it is not stepped over)
        sizes: list[int] = []  # tokens fed by each draft forward
        attention = 0.0
        for j in range(max((d.k for d in drafting), default=0)):
            exact = j == 0 and self.calibrate  # a round's first forward re-runs what the parallel ones approximated
            rows, chunks = [], []
            for d in drafting:
                if j >= d.k or d.request_id in stuck:
                    continue
                rid, w = d.request_id, d.work
                if j == 0:
                    have, end = self.runner.cache.length(rid), w.start + w.num_new
                    if self.parallel and exact:
                        self.calibration.tokens += max(0, min(end, self._drafted.get(rid, have)) - have)
                    chunks.append(SeqChunk(rid, tuple(w.seq.token_ids[have:end])))
                else:
                    chunks.append(SeqChunk(rid, (out[rid].tokens[-1],)))
                rows.append(d)
            if not chunks:  # every request stopped drafting early (its grammar allowed nothing more)
                break
            t0 = time.perf_counter()
            logits = self.runner.forward(chunks, parallel=self.parallel and not exact)  # (works drafting at j, V)
            if exact:
                for c in chunks:
                    self._exact[c.request_id] = self.runner.cache.length(c.request_id)
                if self.parallel:
                    self.calibration.seconds += time.perf_counter() - t0
            sizes.append(sum(len(c.token_ids) for c in chunks))
            attention += sum(len(c.token_ids) * self.runner.cache.length(c.request_id) for c in chunks) / ATTENTION_UNIT
            processed = [i for i, d in enumerate(rows) if processes(d.work.seq)]
            if processed:  # as the target will process them: penalties, bias, min_tokens, the grammar's mask
                logits = logits.float().clone()
                for i in processed:
                    seq = rows[i].work.seq
                    logits[i:i + 1] = process_request(seq, logits[i:i + 1], (), seq.output.stop_ids,
                                                      before=out[rows[i].request_id].tokens)
            greedy = [i for i, d in enumerate(rows) if d.work.seq.greedy]
            picked = logits[greedy].argmax(-1).tolist() if greedy else []  # one transfer for the greedy rows
            for i, token in zip(greedy, picked):
                out[rows[i].request_id].tokens.append(token)
            for d, row in zip(rows, logits):
                seq = d.work.seq
                if not seq.greedy:
                    q = probs_from_logits(row[None].to(self.device or row.device), seq.request.params)  # (1, V)
                    drafted = out[d.request_id].tokens
                    token = (coupled_tokens(q, seq.generator.initial_seed(), len(seq.token_ids) + len(drafted))
                             if self.coupled else sample(q, seq.generator))  # (1,)
                    drafted.append(int(token))
                    probs[d.request_id].append(q[0])
            for d in rows:  # a grammar follows the proposal, so the next position is masked after it
                seq, p = d.work.seq, out[d.request_id]
                if seq.grammar is not None and not seq.grammar.step(p.tokens[-1]):
                    p.tokens.pop()  # refused (nothing was allowed): the round stops drafting here
                    if probs[d.request_id]:
                        probs[d.request_id].pop()
                    stuck.add(d.request_id)
        for d in drafting:  # the grammar steps back: verification walks the drafts again from the emitted tokens
            if d.work.seq.grammar is not None:
                d.work.seq.grammar.back(len(out[d.request_id].tokens))
        for d in drafting:
            p, q = out[d.request_id], probs[d.request_id]
            if q:
                p.probs = torch.stack(q)  # (k, V)
            if p.tokens:
                self._drafted[d.request_id] = d.work.start + d.work.num_new + len(p.tokens) - 1  # draft KV written up to
        shape = ForwardShape(len(sizes), sum(sizes), attention, tuple(sizes))
        return Drafts(out, shape, time.perf_counter() - t_start)

    def accepted(self, seq: Sequence, length: int) -> None:
        """Keep the draft KV of the accepted prefix; with calibration, only as far as it was computed exactly."""
        rid = seq.request_id
        if self.runner.cache.has(rid):
            keep = min(self.runner.cache.length(rid), length)
            if self.calibrate:
                keep = min(keep, self._exact.get(rid, 0))
            self.runner.cache.crop(rid, keep)
            self._commit(seq)

    def _commit(self, seq: Sequence) -> None:
        """Name the request's full draft blocks in the prefix cache: what it holds between steps is its accepted
        tokens' KV, computed in true layer order (without bonus calibration a layer-parallel draft's is not: it
        is never shared)."""
        cache, rid = self.runner.cache, seq.request_id
        if seq.draft_names is not None and self.calibrate and cache.has(rid):
            cache.commit(rid, seq.draft_names.upto(seq.token_ids, cache.length(rid)))

    def release(self, seq: Sequence, finished: bool) -> None:
        self._commit(seq)
        self.runner.cache.free(seq.request_id)
        self._exact.pop(seq.request_id, None)
        self._drafted.pop(seq.request_id, None)

    def imported(self, request_id: str, length: int) -> None:
        """Draft KV of a request's first `length` tokens arrived by migration, computed as exactly as it was at
        its source (whose rounds cropped it to that prefix): keep it when verifying."""
        self._exact[request_id] = length


@dataclass
class Calibration:
    """Bonus calibration's running cost: tokens re-run in true order after a parallel round, and the seconds of
    the rounds' first (exact) forwards that carried them."""

    tokens: int = 0
    seconds: float = 0.0


class LookupDrafter:
    """What the model-free drafters share (n-gram and suffix lookup, actors/speculation/lookup.py): proposals from
    the request's own tokens, found once per step by `_lookup` (a subclass's) and reused by `propose`; no forward,
    no KV."""

    kind: DraftKind
    runs_forwards = False

    def __init__(self, cfg: SpeculationConfig) -> None:
        self.cfg = cfg
        # this step's lookahead per request, reused by propose: its tokens and the class of the match behind them
        self._pending: dict[str, tuple[list[int], int]] = {}

    def _lookup(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        """Up to k tokens the lookup proposes after `seq`'s tokens, and the length of the context it matched."""
        raise NotImplementedError

    def _drafts(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        """The lookup's tokens; under a grammar (tool calls, structured output), cut at the first it refuses and
        continued by the tokens it forces (a call's fixed keys and brackets, which a lookup may not have seen
        in this order), as grammar fast-forwarding does (llguidance; SGLang's jump-forward decoding), but drafted,
        so the target still verifies them."""
        tokens, matched = self._lookup(seq, k) if k > 0 else ([], 0)
        return (seq.grammar.extend(tokens, k) if seq.grammar is not None and k > 0 else tokens), matched

    def lookahead(self, seq: Sequence, k: int) -> int:
        tokens, matched = self._drafts(seq, k)
        self._pending[seq.request_id] = tokens, match_class(matched)
        return len(tokens)

    def evidence(self, seq: Sequence) -> int | None:
        pending = self._pending.get(seq.request_id)
        return None if pending is None else pending[1]

    def backlog(self, seq: Sequence, end: int) -> int:
        return 0

    def reserve(self, w: Work, k: int) -> int:
        return k

    def propose(self, drafting: Seq[Drafting]) -> Drafts:
        t0 = time.perf_counter()
        out = {}
        for d in drafting:
            pending = self._pending.pop(d.request_id, None)
            tokens = pending[0] if pending is not None else []
            if pending is None and d.k > 0:
                tokens = self._drafts(d.work.seq, d.k)[0]
            # `_drafts` already cut them where the grammar refuses (a prefix of them stays valid)
            out[d.request_id] = Proposal(list(tokens[:d.k]))
        self._pending.clear()
        return Drafts(out, ForwardShape(), time.perf_counter() - t0)

    def accepted(self, seq: Sequence, length: int) -> None:
        pass  # the indexes only ever read accepted tokens

    def release(self, seq: Sequence, finished: bool) -> None:
        raise NotImplementedError


class NgramDrafter(LookupDrafter):
    """n-gram prompt lookup: the tokens that followed the latest earlier occurrence of the request's last n tokens."""

    kind: DraftKind = "ngram"

    def __init__(self, cfg: SpeculationConfig) -> None:
        super().__init__(cfg)
        self._ngrams: dict[str, NgramIndex] = {}

    def _lookup(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        index = self._ngrams.setdefault(seq.request_id, NgramIndex(self.cfg.ngram.min_n, self.cfg.ngram.max_n))
        return index.match(seq.token_ids, k)

    def release(self, seq: Sequence, finished: bool) -> None:
        self._ngrams.pop(seq.request_id, None)


class SuffixDrafter(LookupDrafter):
    """Suffix-tree lookup (SuffixDecoding) over the request's own tokens and its scope's recent outputs."""

    kind: DraftKind = "suffix"

    def __init__(self, cfg: SpeculationConfig) -> None:
        super().__init__(cfg)
        self.shared = OutputCache(cfg.suffix.depth, cfg.suffix.cache_tokens)
        self._suffixes: dict[str, SuffixIndex] = {}

    def _lookup(self, seq: Sequence, k: int) -> tuple[list[int], int]:
        own = self._suffixes.setdefault(seq.request_id, SuffixIndex(self.cfg.suffix.depth))
        shared = self.shared.trie(self._scope(seq))
        return suffix_match(own, shared, seq.token_ids, k, self.cfg.suffix.min_prob)

    def _scope(self, seq: Sequence) -> str:
        """Whose recent outputs a request drafts from: its tenant's (suffix.scope: tenant), or everyone's."""
        return seq.request.tenant if self.cfg.suffix.scope == "tenant" else ""

    def release(self, seq: Sequence, finished: bool) -> None:
        self._suffixes.pop(seq.request_id, None)
        if finished:
            self.shared.add(self._scope(seq), seq.output.token_ids)


def make_drafter(cfg: SpeculationConfig, draft: ModelRunner | None, device: torch.device | None = None,
                 coupled: bool = False) -> Drafter | None:
    """The drafter `cfg.method` names; None when there is nothing to draft with (method model, no draft runner).
    `coupled`: sampled requests draw by position-keyed noise (deterministic mode, actors/speculation/coupled.py)."""
    if cfg.method == "ngram":
        return NgramDrafter(cfg)
    if cfg.method == "suffix":
        return SuffixDrafter(cfg)
    return ModelDrafter(draft, device, cfg.draft_parallel, coupled) if draft is not None else None
