"""The instance engine: continuous batching with lossless speculative decoding; `step()` maps the data plane.

Each step: the scheduler (actors/scheduler.py) admits and chunks work under the KV block and token
budgets; the policy (actors/spec/policy.py) picks each emitting request's k; the drafter
(actors/spec/drafters.py: a draft model, or a model-free n-gram / suffix lookup) proposes up to k tokens
per request (a draft model's first forward also catches up on the tokens it has not seen: the prompt,
and every token since the request last drafted); the target scores every prefill chunk and all k+1
positions of every decode in one forward; greedy matching or rejection sampling accepts a prefix;
rejected KV is cropped in both caches. See actors/spec/verify.py for the vocabulary (accepted,
recovered, bonus).

KV invariants after every step, per running request with n = len(token_ids):
  target cache holds tokens [0, m), m <= n-1, with m = n-1 once its prompt is processed;
  draft cache holds a prefix [0, d), d <= n-1 (it lags while the request does not draft, and catches
  up when it next drafts: a request given k = 0 costs the draft no forward).
The draft's KV is optional: when its cache is out of blocks a request simply drafts nothing that step.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from actors.model.metadata import SeqChunk
from actors.model.runner import ModelRunner
from actors.output import RequestOutput
from actors.scheduler import Schedule, Scheduler, Work
from actors.sequence import Sequence, SeqStatus
from actors.spec.calibration import REPEATS as CALIBRATION_REPEATS, SIZES as CALIBRATION_SIZES
from actors.spec.calibration import CalibrationFile, TimedForward, setup_of
from actors.spec.cost_model import ATTENTION_UNIT, ForwardShape, StepCostModel
from actors.spec.drafters import Drafter, ModelDrafter, Proposal, make_drafter
from actors.spec.policy import Acceptance, BatchBase, Candidate, make_policy
from actors.spec.sampling import make_generator, probs_from_logits
from actors.spec.verify import verify_greedy, verify_sampled
from cluster.config import EngineConfig, SchedulerConfig, SpeculationConfig
from actors.kv_cache import KVExport
from actors.kv_links import LinkedKV, kv_span
from cluster.migration import Link
from cluster.request import (FinishReason, InvalidRequest, Request, Resume, SamplingParams, SpecStats, TokenDelta,
                             check_prompt)
from cluster.migration_policy import InstanceLoad, RequestLoad
from cluster.stats import EngineStats


RequestError = InvalidRequest  # a request the engine cannot take (empty prompt, too long, bad token ids...)


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
        scheduler: SchedulerConfig = SchedulerConfig(),
        max_model_len: int | None = None,
        cost_model: StepCostModel | None = None,
        draft_quantized: bool = False,
        calibration: CalibrationFile | None = None,
    ) -> None:
        if draft is not None and draft.model.config.vocab_size != target.model.config.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft.model.config.vocab_size}) differs from the target's "
                f"({target.model.config.vocab_size}): they must share a tokenizer"
            )
        self.target, self.draft = target, draft
        self.device = target.device  # where the target's logits arrive: sampling and verification run here
        self.drafter: Drafter | None = make_drafter(speculation, draft, draft_quantized, self.device)
        self.cost_model = cost_model or StepCostModel()
        self.policy = make_policy(speculation, self.drafter is not None, self.cost_model,
                                  draft_forwards=self.drafter is not None and self.drafter.runs_forwards)
        self.k = speculation.k if self.policy.name != "off" else 0  # the most drafts a request gets
        self.acceptance = Acceptance.prior(speculation.prior_acceptance, decay=speculation.acceptance_decay)
        self.scheduler = Scheduler(scheduler, target.cache, self.k, self._free, self._fail)
        self.max_model_len = min(max_model_len or target.model.max_model_len, target.model.max_model_len)
        self.tokenizer: PreTrainedTokenizerBase = target.model.tokenizer
        self.eos_token_ids = target.model.eos_token_ids
        self._finished: list[TokenDelta] = []  # ended outside a step's verification (errors), reported next step
        self._ids = itertools.count()
        self._stats = _Counters()
        self.calibration = calibration  # where this setup's calibration is saved (None: time it at every start)
        if self.policy.name == "goodput" and not self.cost_model.fitted:
            self.calibrate()

    @classmethod
    def from_config(cls, cfg: EngineConfig, device: torch.device | str | None = None,
                    calibration_dir: Path | None = None) -> "Engine":
        """Load the model pair named by `cfg` (files or hub ids, already resolved) onto `device` (default: the
        config's `model.device`) and build the engine; a goodput engine keeps its calibration in
        `calibration_dir` (actors/spec/calibration.py) and reuses it on later starts of the same setup."""
        from actors.local_stages import load_runners  # it builds on this module's neighbours, not on Engine

        target, draft = load_runners(cfg, None, device)
        calibration = None
        if calibration_dir is not None and cfg.speculation.policy == "goodput":
            calibration = CalibrationFile(calibration_dir, setup_of(cfg, target[0].device))
        return cls(target[0], draft, cfg.speculation, cfg.scheduler, cfg.model.max_model_len,
                   draft_quantized=cfg.model.draft_quantization != "none", calibration=calibration)

    @property
    def waiting(self) -> list[Sequence]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    # ---- requests ---------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        """Tokenize a prompt with the target's tokenizer (see LoadedModel.encode)."""
        return self.target.model.encode(prompt, chat)

    def add_request(self, request: Request) -> None:
        """Queue a request; raises RequestError if it can never be served."""
        self.check_request(request)
        self._enqueue(request)

    def _enqueue(self, request: Request) -> Sequence:
        """Queue an already checked request (one that resumes carries on from its tokens, text and sampler)."""
        params, resume = request.params, request.resume
        out = RequestOutput(self.tokenizer, params, self.eos_token_ids, params.max_tokens)
        gen = None if params.greedy else make_generator(params, self.device)
        tokens = list(request.prompt_token_ids)
        if resume is not None:
            out.restore(list(resume.token_ids), resume.text_chars)
            tokens += resume.token_ids
            if gen is not None and resume.generator_state is not None:
                gen.set_state(torch.frombuffer(bytearray(resume.generator_state), dtype=torch.uint8))
        seq = Sequence(request, tokens, out, gen, seqno=next(self._ids),
                       acceptance=Acceptance(0.0, 0.0, self.acceptance.decay))  # its own rounds only
        if resume is not None and resume.stats is not None:
            seq.stats = copy.deepcopy(resume.stats)
        self.scheduler.add(seq)
        return seq

    def check_request(self, request: Request) -> None:
        """Raise RequestError if the request can never be served; changes nothing."""
        check_prompt(request.prompt_token_ids, request.params.max_tokens, self.max_model_len,
                     self.target.model.config.vocab_size)
        if any(s.request_id == request.request_id for s in self.waiting + self.running):
            raise RequestError(f"request id {request.request_id!r} is already in use")

    def abort(self, request_id: str) -> TokenDelta | None:
        """Cancel a request and free its KV; returns its final delta, or None if it is unknown."""
        seq = self.scheduler.remove(request_id)
        if seq is None:
            return None
        self._free(seq)
        seq.status = SeqStatus.FINISHED
        seq.output.finish_reason = FinishReason.ABORT
        return TokenDelta(request_id, (), seq.output.text_delta(), FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._finished)

    def generate(self, prompts: Seq[Seq[int]], params: SamplingParams | Seq[SamplingParams],
                 step: Callable[[], list[TokenDelta]] | None = None) -> list[Completion]:
        """Serve a batch of tokenized prompts to completion (offline use); results in prompt order.

        `step` replaces `self.step` (an Instance passes its own, which turns a shard failure into error deltas).
        """
        step = step or self.step
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        requests = [Request(f"gen-{next(self._ids)}", tuple(p), sp) for p, sp in zip(prompts, params_list, strict=True)]
        for r in requests:  # all or nothing: a bad prompt must not leave the good ones queued
            self.check_request(r)
        done: dict[str, Completion] = {}
        for r in requests:
            seq = self._enqueue(r)
            done[r.request_id] = Completion(r.request_id, list(r.prompt_token_ids), [], "", None, seq.stats)
        while any(c.finish_reason is None for c in done.values()) and self.has_unfinished():
            for delta in step():
                c = done.get(delta.request_id)
                if c is not None:
                    c.token_ids.extend(delta.token_ids)
                    c.text += delta.text
                    c.finish_reason, c.error = delta.finish_reason, delta.error
        return list(done.values())

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        """One step: schedule, choose k, draft, verify in one target forward, accept, emit."""
        t0 = time.perf_counter()
        plan = self.scheduler.schedule()
        deltas, self._finished = self._finished, []
        if not plan.works:
            return deltas
        self._choose_k(plan)
        t1 = time.perf_counter()
        proposals, draft_shape = self._propose(plan.works)
        t2 = time.perf_counter()
        target_logits, target_shape = self._score(plan.works, proposals)
        t3 = time.perf_counter()
        emitting = 0
        for w, proposal, logits in zip(plan.works, proposals, target_logits, strict=True):
            if w.emits:
                deltas.append(self._accept(w, proposal, logits))
                emitting += 1
        t4 = time.perf_counter()
        # a lookup drafter runs no forward: its (small) time is part of the step's per-request overhead
        lookup_s = t2 - t1 if self.drafter is not None and not self.drafter.runs_forwards else 0.0
        self.cost_model.observe(target_shape, t3 - t2, draft_shape, t2 - t1,
                                requests=emitting, overhead_s=(t1 - t0) + (t4 - t3) + lookup_s)
        self._stats.record(plan, deltas, t4 - t0)
        drafted = sum(len(p.tokens) for p in proposals)
        if drafted and self.drafter is not None and self.drafter.runs_forwards:
            self._stats.drafted += drafted
            self._stats.draft_s += t2 - t1
        return deltas

    def _choose_k(self, plan: Schedule) -> None:
        """Set each emitting work's k from the policy, capped by what the drafter can propose and by the KV it
        can reserve. The draft follows no prefill chunk: it catches up when a request next drafts, and the
        policy is told each request's catch-up (its draft backlog) as part of that request's cost."""
        emitting = [w for w in plan.works if w.emits]
        if self.k == 0 or not emitting:
            return
        chunks = [w for w in plan.works if not w.emits]
        tokens = sum(w.num_new for w in chunks)
        attention = sum(w.num_new * (w.start + w.num_new) for w in chunks) / ATTENTION_UNIT
        base = BatchBase(ForwardShape(1, tokens, attention), running=len(self.running))
        cands = []
        for w in emitting:
            end = w.start + w.num_new
            limit = max(0, min(self.k, w.seq.remaining - 1))
            limit = self.drafter.lookahead(w.seq, limit) if limit else 0
            # the request's own rounds over a prior that is the engine's current estimate (learnt from every
            # request): a fixed prior outweighed one failed round, and a refit then made a random draft look worth it
            rate = w.seq.acceptance.blend(self.acceptance.rate)
            cands.append(Candidate(rate, limit, w.num_new, end,
                                   draft_backlog=self.drafter.backlog(w.seq, end), remaining=w.seq.remaining))
        for w, k in zip(emitting, self.policy.choose(cands, base, plan.draft_budget)):
            w.k = self._reserve_drafts(w, k)

    def _reserve_drafts(self, w: Work, k: int) -> int:
        """Reserve KV for k drafts (target: n + k tokens; the drafter its own); the k that fits."""
        rid, n = w.seq.request_id, w.start + w.num_new
        while k > 0 and not self.target.reserve(rid, n + k):
            k -= 1
        return self.drafter.reserve(w, k) if k > 0 else 0

    def _propose(self, works: list[Work]) -> tuple[list[Proposal], ForwardShape]:
        """Each work's proposal (empty where k = 0) and the shape of the draft's forwards for the cost model."""
        if self.drafter is None or not any(w.k for w in works):
            return [Proposal() for _ in works], ForwardShape()
        return self.drafter.propose(works)

    def _score(self, works: list[Work], proposals: list[Proposal]) -> tuple[list[torch.Tensor], ForwardShape]:
        """One target forward over every work's chunk plus its drafts; logits (k+1, V) for emitting works."""
        chunks = [
            SeqChunk(w.seq.request_id, tuple(w.seq.token_ids[w.start:w.start + w.num_new] + p.tokens),
                     len(p.tokens) + 1 if w.emits else 0)
            for w, p in zip(works, proposals, strict=True)
        ]
        logits = self.target.forward(chunks)  # (sum over emitting works of k+1, V)
        tokens = sum(len(c.token_ids) for c in chunks)
        attention = sum(len(c.token_ids) * self.target.cache.length(c.request_id) for c in chunks) / ATTENTION_UNIT
        return list(logits.split([c.num_logits for c in chunks])), ForwardShape(1, tokens, attention)

    def _accept(self, w: Work, proposal: Proposal, logits: torch.Tensor) -> TokenDelta:
        """Verify one request's drafts, emit the accepted tokens plus one, and crop rejected KV."""
        seq = w.seq
        n_before = len(seq.token_ids)
        draft = proposal.tokens
        d = torch.tensor(draft, dtype=torch.long, device=logits.device)  # (k,)
        if seq.greedy:
            accepted, extra = verify_greedy(d, logits)
        else:
            p = probs_from_logits(logits, seq.request.params)  # (k+1, V)
            q = proposal.q(p.shape[-1], p.device)  # (k, V)
            accepted, extra = verify_sampled(d, q, p, seq.generator)
        seq.stats.k_history.append(len(draft))
        if draft:
            self._stats.by_position(len(draft), accepted)
            seq.stats.record(len(draft), accepted)
            seq.acceptance.update(len(draft), accepted)
            self.acceptance.update(len(draft), accepted)
        taken = seq.output.append(draft[:accepted] + [extra])
        seq.token_ids.extend(taken)
        rid = seq.request_id
        if seq.output.finish_reason is not None:
            self.scheduler.remove(rid)
            seq.status = SeqStatus.FINISHED
            self._free(seq)
        else:
            self.target.cache.crop(rid, n_before + accepted)
            if self.drafter is not None:
                self.drafter.accepted(seq, n_before + accepted)
        return TokenDelta(rid, tuple(taken), seq.output.text_delta(), seq.output.finish_reason)

    # ---- live migration (cluster/migration.py drives these between steps) ----------------------
    def kv_length(self, request_id: str) -> int:
        """Tokens of a request whose target KV this engine holds."""
        return self.target.cache.length(request_id)

    def export_kv(self, request_id: str, start: int, end: int | None = None,
                  links: list[Link] | None = None) -> list[KVExport] | LinkedKV:
        """The request's target KV from token `start` to `end` (default: what it holds now), one export per stage, or
        with `links` (a migration's) sent by the stages over them; none for a request that holds no KV (queued,
        never started)."""
        if not self.target.cache.has(request_id):
            return []
        have = self.target.cache.length(request_id)
        return self.target.export_kv(request_id, start, have if end is None else min(end, have), links)

    def reserve_incoming(self, request_id: str, tokens: int) -> bool:
        """The migration handshake: hold KV blocks for `tokens` tokens of a request about to arrive, or refuse."""
        if any(s.request_id == request_id for s in self.waiting + self.running):
            return False
        return self.target.reserve(request_id, tokens)

    def import_kv(self, exports: list[KVExport] | LinkedKV) -> bool:
        """Append an arriving request's KV (exported by any split of the same model, or received over a migration's
        links); False if out of blocks. A request that held no KV at its source (queued there) arrives with none."""
        return self.target.import_kv(exports) if exports else True

    def drop_incoming(self, request_id: str) -> None:
        """An arriving request was not committed: free what was reserved and imported for it."""
        if not any(s.request_id == request_id for s in self.waiting + self.running):
            self.target.cache.free(request_id)
            if self.draft is not None:
                self.draft.cache.free(request_id)

    def export_draft(self, request_id: str, start: int = 0, end: int | None = None,
                     links: list[Link] | None = None) -> list[KVExport] | LinkedKV | None:
        """A migration's copy of the request's draft KV from `start` to `end` (or to what it holds) as it stands
        between two steps (the draft's view of the accepted tokens: a prefix of the request that never changes),
        or with `links` sent over them; None without a draft model whose KV can move (an EasySpec group's is
        rebuilt at the destination), or without draft KV beyond `start`."""
        if self.draft is None or not self.draft.exports_kv or not self.holds(request_id) \
                or not self.draft.cache.has(request_id):
            return None
        n = self.draft.cache.length(request_id)
        if n <= start:
            return None
        return self.draft.export_kv(request_id, start, n if end is None else min(end, n), links)

    def import_draft(self, exports: list[KVExport] | LinkedKV) -> bool:
        """Append an arriving request's draft KV (its draft then catches up only on the tokens after it); False,
        changing nothing, without a draft model whose KV can move, if it does not continue what came before, or
        without room (the draft catches up from what it has)."""
        rid, start, _ = kv_span(exports)
        if self.draft is None or not self.draft.exports_kv or self.holds(rid):
            return False
        if start != (self.draft.cache.length(rid) if self.draft.cache.has(rid) else 0):
            return False
        if not self.draft.import_kv(exports):
            return False
        if isinstance(self.drafter, ModelDrafter):
            self.drafter.imported(rid, self.draft.cache.length(rid))
        return True

    def export_out(self, request_id: str, start: int, end: int, links: list[Link] | None = None
                   ) -> tuple[list[KVExport] | LinkedKV, int] | None:
        """A migration's copy: the request's KV from `start` to `end` (or to what it holds; over `links` if given),
        and where that ends; None if it is not here, or holds less than `start` (preempted since its copy began:
        its KV was freed)."""
        if not self.holds(request_id) or self.kv_length(request_id) < start:
            return None
        end = min(end, self.kv_length(request_id))
        return self.export_kv(request_id, start, end, links), end

    def stop_out(self, request_id: str, start: int, links: list[Link] | None = None
                 ) -> tuple[Sequence, Resume, list[KVExport] | LinkedKV, int] | None:
        """A migration's stop: the rest of the request's KV from `start` (over `links` if given), then the request
        taken out of the step loop (KV kept until released); None, and the request left running, if `export_out`
        would give None."""
        exported = self.export_out(request_id, start, self.kv_length(request_id), links)
        if exported is None:
            return None
        seq, resume = self.detach(request_id)
        return seq, resume, *exported

    def holds(self, request_id: str) -> bool:
        """Whether the request is queued or running here."""
        return any(s.request_id == request_id for s in self.waiting + self.running)

    def detach(self, request_id: str) -> tuple[Sequence, Resume] | None:
        """Take a request out of the step loop, keeping its KV, and say where it stands; None if not here."""
        seq = self.scheduler.remove(request_id)
        if seq is None:
            return None
        state = seq.generator.get_state().numpy().tobytes() if seq.generator is not None else None
        return seq, Resume(tuple(seq.output.token_ids), seq.output.emitted, state, copy.deepcopy(seq.stats))

    def reattach(self, seq: Sequence) -> None:
        """A detached request carries on here (its migration was aborted): its KV never left."""
        seq.status = SeqStatus.WAITING
        self.scheduler.add(seq)

    def release_detached(self, seq: Sequence) -> None:
        """A detached request now runs elsewhere: free its KV here."""
        self._free(seq)

    # ---- KV and errors ----------------------------------------------------------------------
    def _free(self, seq: Sequence) -> None:
        """Free a request's KV (finished, aborted, failed or preempted) and what the drafter holds for it."""
        self.target.cache.free(seq.request_id)
        if self.drafter is not None:
            self.drafter.release(seq, finished=seq.status is SeqStatus.FINISHED and seq.output.finish_reason is not None)

    def _fail(self, seq: Sequence, message: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.output.finish_reason = FinishReason.ERROR
        self._finished.append(TokenDelta(seq.request_id, (), "", FinishReason.ERROR, error=message))

    # ---- cost model and stats ---------------------------------------------------------------
    def calibrate(self) -> None:
        """Seed the step-time model with timed forwards of a throwaway request at a few sizes (pinned points),
        or with the points saved for this setup by an earlier start (`self.calibration`)."""
        models = {"target": self.cost_model.target, "draft": self.cost_model.draft}
        saved = self.calibration.load() if self.calibration is not None else None
        points = saved if saved is not None else self._time_forwards()
        for p in points:
            models[p.phase].observe(ForwardShape(1, p.tokens, p.attention), p.seconds, pinned=True)
        if saved is None and self.calibration is not None:
            self.calibration.save(points)

    def _time_forwards(self) -> list[TimedForward]:
        """Time one forward of a throwaway request at each of the calibration's (new tokens, context) sizes."""
        points = []
        runners = [("target", self.target)] + ([("draft", self.draft)] if self.draft is not None else [])
        for phase, runner in runners:
            rid = "__calibration__"
            for new, ctx in CALIBRATION_SIZES * CALIBRATION_REPEATS:
                if ctx + new > self.max_model_len or not runner.reserve(rid, ctx + new):
                    continue
                have = runner.cache.length(rid)
                if have > ctx:
                    runner.cache.crop(rid, ctx)
                elif have < ctx:  # context to attend to (not timed)
                    runner.forward([SeqChunk(rid, tuple(range(have + 1, ctx + 1)), 0)])
                chunk = SeqChunk(rid, tuple(range(1, new + 1)))
                t0 = time.perf_counter()
                runner.forward([chunk])
                seconds = time.perf_counter() - t0
                points.append(TimedForward(phase, new, new * (ctx + new) / ATTENTION_UNIT, seconds))
            runner.cache.free(rid)
        return points

    def load(self, instance_id: str) -> InstanceLoad:
        """This engine's load in target KV blocks, per request, for the router's migration policies."""
        tc = self.target.cache

        def peak(s: Sequence) -> int:  # blocks at its length limit
            return tc.blocks_for(min(len(s.token_ids) + s.remaining, self.max_model_len))

        running = tuple(RequestLoad(s.request_id, tc.blocks_for(tc.length(s.request_id)), s.request.priority,
                                    len(s.token_ids), peak(s)) for s in self.running if tc.has(s.request_id))
        waiting = tuple(RequestLoad(s.request_id, tc.blocks_for(len(s.token_ids) + 1), s.request.priority,
                                    len(s.token_ids), peak(s)) for s in sorted(self.waiting, key=Sequence.order_key))
        return InstanceLoad(instance_id, tc.num_used_blocks + tc.num_free_blocks, running, waiting,
                            max_running=self.scheduler.cfg.max_batch_size)

    def stats(self) -> EngineStats:
        """Load and speed figures after the last step (what the router reads)."""
        c, tc = self._stats, self.target.cache
        calibration = self.drafter.calibration if isinstance(self.drafter, ModelDrafter) else None
        dc = self.draft.cache if self.draft is not None else None
        expert_stats = getattr(self.target, "expert_stats", None)  # an expert-parallel target (PipelineRunner)
        ep = expert_stats() if expert_stats is not None else None
        return EngineStats(
            running=len(self.running), waiting=len(self.waiting),
            kv_blocks_used=tc.num_used_blocks, kv_blocks_free=tc.num_free_blocks,
            draft_kv_blocks_used=dc.num_used_blocks if dc else 0, draft_kv_blocks_free=dc.num_free_blocks if dc else 0,
            num_steps=c.steps, step_time_s=c.step_s, step_time_ema_s=c.step_ema_s,
            batch_size=c.batch_size, batch_tokens=c.batch_tokens, prefill_tokens=c.prefill_tokens,
            mean_k=c.mean_k, acceptance=self.acceptance.rate, tokens_emitted=c.tokens_emitted,
            num_preemptions=self.scheduler.num_preemptions, policy=self.policy.name,
            draft_s_per_token=c.draft_s / c.drafted if c.drafted else 0.0,
            acceptance_by_position=tuple(a / p for a, p in zip(c.accepted_at, c.proposed_at)),
            calibration_tokens=calibration.tokens if calibration else 0,
            calibration_s=calibration.seconds if calibration else 0.0,
            moe_local_rate=ep.local_rate if ep else 0.0,
            moe_alltoall_bytes_per_token=ep.bytes_per_token if ep else 0.0,
            moe_s_per_token=ep.seconds_per_token if ep else 0.0,
        )


@dataclass
class _Counters:
    """Running figures behind Engine.stats()."""

    steps: int = 0
    step_s: float = 0.0
    step_ema_s: float = 0.0
    batch_size: int = 0
    batch_tokens: int = 0
    prefill_tokens: int = 0
    mean_k: float = 0.0
    tokens_emitted: int = 0
    drafted: int = 0  # draft tokens proposed by a draft model, and the draft stage's seconds for them
    draft_s: float = 0.0
    proposed_at: list[int] = field(default_factory=list)  # per draft position: rounds that drafted it
    accepted_at: list[int] = field(default_factory=list)  # and in how many it was accepted

    def by_position(self, k: int, accepted: int) -> None:
        """A round of k drafts of which the first `accepted` were taken."""
        while len(self.proposed_at) < k:
            self.proposed_at.append(0)
            self.accepted_at.append(0)
        for j in range(k):
            self.proposed_at[j] += 1
            self.accepted_at[j] += j < accepted

    def record(self, plan: Schedule, deltas: list[TokenDelta], seconds: float) -> None:
        self.steps += 1
        self.step_s = seconds
        self.step_ema_s = seconds if self.steps == 1 else 0.9 * self.step_ema_s + 0.1 * seconds
        self.batch_size = len(plan.works)
        self.batch_tokens = sum(w.num_new + w.k for w in plan.works)
        self.prefill_tokens = plan.num_prefill_tokens
        ks = [w.k for w in plan.works if w.emits]
        self.mean_k = sum(ks) / len(ks) if ks else 0.0
        self.tokens_emitted += sum(len(d.token_ids) for d in deltas)
