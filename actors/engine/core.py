"""The instance engine: continuous batching with lossless speculative decoding; `step()` maps the data plane.

Each step hands one typed object to the next (actors/speculation/step.py):
  schedule  the scheduler (actors/engine/scheduler.py) admits and chunks work under the KV block and token budgets;
  plan      the speculation planner (actors/speculation/plan.py) gives each emitting request its k and reserves KV;
  propose   the drafter (actors/speculation/drafters.py: a draft model, or a model-free n-gram / suffix lookup)
            proposes up to k tokens per request (a draft model's first forward also catches up on the tokens
            it has not seen: the prompt, and every token since the request last drafted);
  score     the target scores every prefill chunk and all k+1 positions of every decode in one forward;
  verify    greedy matching or rejection sampling decides every round (actors/speculation/verdicts.py);
  apply     the one place that emits, crops rejected KV in both caches, frees finished requests and records.
See actors/speculation/verify.py for the vocabulary (accepted, recovered, bonus). A migration's operations on an
engine are in actors/engine/migration.py, offline generation (a batch served to completion) in actors/engine/offline.py.

KV invariants after every step, per running request with n = len(token_ids):
  target cache holds tokens [0, m), m <= n-1, with m = n-1 once its prompt is processed;
  draft cache holds a prefix [0, d), d <= n-1 (it lags while the request does not draft, and catches
  up when it next drafts: a request given k = 0 costs the draft no forward).
The draft's KV is optional: when its cache is out of blocks a request simply drafts nothing that step.
"""

from __future__ import annotations

import copy
import itertools
import logging
import time
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from actors.engine.stats import StepCounters
from actors.engine.loading import load_runners
from actors.model.metadata import SeqChunk
from actors.model.runner import ModelRunner
from actors.engine.output import RequestOutput
from actors.engine.scheduler import Failed, Scheduler
from actors.engine.sequence import EngineSequence, SeqStatus
from actors.speculation.calibration import CalibrationFile, Pending, calibrate, seed, setup_of
from actors.speculation.cost_model import ATTENTION_UNIT, ForwardShape, StepCostModel
from actors.speculation.drafters import Drafter, ModelDrafter, make_drafter
from actors.speculation.plan import SpeculationPlanner
from actors.speculation.policy import Acceptance, SpecPolicy, make_policy
from actors.speculation.sampling import make_generator
from actors.speculation.structured import CompiledGrammar, GrammarCompiler
from actors.start_phases import phase
from actors.speculation.step import Drafts, Scores, SpecPlan, Verdict
from actors.speculation.verdicts import logprobs_of, verify
from cluster.config import EngineConfig, GrammarConfig, SchedulerConfig, SpeculationConfig
from cluster.migration_policy import InstanceLoad, RequestLoad
from cluster.prefix import ChainNames, request_root
from cluster.request import FinishReason, InvalidRequest, Request, TokenDelta, check_prompt, context_length
from cluster.rounds import RoundRecord
from cluster.stats import EngineStats, LoadStats, MoEStats, PrefixCacheStats, SpecDecodingStats, StepStats


log = logging.getLogger(__name__)

RequestError = InvalidRequest  # a request the engine cannot take (empty prompt, too long, bad token ids...)


def model_identity(runner) -> str:
    """What names a runner's KV content in the prefix cache: its checkpoint and dtype (cluster/prefix.py root)."""
    return f"{runner.model.source}|{runner.model.dtype}"


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
        calibration: CalibrationFile | None = None,
        prefix_caching: bool = False,
        prefix_identity: str | None = None,
        deterministic: bool = False,
        share_across_tenants: bool = False,
        grammar: GrammarConfig = GrammarConfig(),
        calibrate_later: bool = False,
    ) -> None:
        if draft is not None and draft.model.config.vocab_size != target.model.config.vocab_size:
            raise ValueError(
                f"draft vocabulary ({draft.model.config.vocab_size}) differs from the target's "
                f"({target.model.config.vocab_size}): they must share a tokenizer"
            )
        self.target, self.draft = target, draft
        self.device = target.device  # where the target's logits arrive: sampling and verification run here
        # deterministic mode: the target's forward is batch-invariant (its runners'), and sampled tokens are drawn
        # by position-keyed noise, so output does not depend on k or the batch (docs/determinism.md)
        self.deterministic = deterministic
        self.drafter: Drafter | None = make_drafter(speculation, draft, self.device, deterministic)
        self._drafter_kind = self.drafter.kind if self.drafter is not None else ""  # what each RoundRecord names
        self.cost_model = cost_model or StepCostModel()
        policy = make_policy(speculation, self.drafter is not None, self.cost_model,
                             draft_forwards=self.drafter is not None and self.drafter.runs_forwards)
        self.k = speculation.k if policy.name != "off" else 0  # the most drafts a request gets
        self.acceptance = Acceptance.prior(speculation.prior_acceptance, decay=speculation.acceptance_decay)
        self.scheduler = Scheduler(scheduler, target.cache, self.k, self.free)
        self.planner = SpeculationPlanner(policy, self.drafter, target, self.k, self.acceptance)
        # capped at what the target's cache holds: a request that can never fit is refused when added (a 400), not
        # failed after it started streaming (a draft without room only stops drafting: actors/speculation)
        self.max_model_len = context_length(target.model.max_model_len, max_model_len, target.cache.capacity_tokens)
        if self.max_model_len < context_length(target.model.max_model_len, max_model_len):
            log.warning("the context is capped at %d tokens: what the KV cache holds (engine.cache.num_blocks - 1 "
                        "blocks of engine.cache.block_size)", self.max_model_len)
        self.tokenizer: PreTrainedTokenizerBase = target.model.tokenizer
        self.eos_token_ids = target.model.eos_token_ids
        self._ids = itertools.count()
        self._stats = StepCounters()
        # automatic prefix caching: where every shard's cache replays every op (not data-parallel expert ranks)
        self.prefix_caching = prefix_caching and target.replicated_cache
        # the root of the target's block names (EngineConfig.prefix_identity: the same in every instance of an app)
        self.prefix_identity = prefix_identity or model_identity(target)
        self.share_across_tenants = share_across_tenants  # else a block's name includes its request's tenant
        # structured outputs' grammars for this tokenizer (llguidance's view of it built on the first that asks); an
        # instance's server compiles them off this loop (actors/serving/grammar_pool.py) and hands them in with the request
        self.grammars = GrammarCompiler(self.tokenizer, target.model.config.vocab_size, sorted(self.eos_token_ids),
                                        cache_bytes=grammar.cache_bytes)
        if prefix_caching and not self.prefix_caching:
            log.info("prefix caching is off: the target's expert-parallel ranks each hold their own requests' "
                     "KV (engine.experts.attention: data), so a cached block is not where another request runs")
        self.calibration = calibration  # where this setup's calibration is saved (None: time it at every start)
        # `calibrate_later`: a calibration that must be timed is, by `idle_work`, after the engine takes requests
        self.pending_calibration: Pending | None = None
        if self.policy.name == "goodput" and not self.cost_model.fitted:
            self.calibrate(later=calibrate_later)

    @classmethod
    def from_config(cls, cfg: EngineConfig, device: torch.device | str | None = None,
                    calibration_dir: Path | None = None) -> "Engine":
        """Load the model pair named by `cfg` (files or hub ids, already resolved) onto `device` (default: the
        config's `model.device`) and build the engine; a goodput engine keeps its calibration in
        `calibration_dir` (actors/speculation/calibration.py) and reuses it on later starts of the same setup."""
        target, draft = load_runners(cfg, None, device)
        calibration = None
        if calibration_dir is not None and cfg.speculation.policy == "goodput":
            calibration = CalibrationFile(calibration_dir, setup_of(cfg, target[0].device))
        return cls(target[0], draft, cfg.speculation, cfg.scheduler, cfg.model.max_model_len,
                   calibration=calibration,
                   prefix_caching=cfg.cache.prefix_caching, prefix_identity=cfg.prefix_identity,
                   deterministic=cfg.deterministic, share_across_tenants=cfg.cache.share_across_tenants,
                   grammar=cfg.grammar)

    @property
    def policy(self) -> SpecPolicy:
        """The speculation-length policy (the planner's)."""
        return self.planner.policy

    @policy.setter
    def policy(self, policy: SpecPolicy) -> None:
        self.planner.policy = policy

    @property
    def waiting(self) -> list[EngineSequence]:
        return self.scheduler.waiting

    @property
    def running(self) -> list[EngineSequence]:
        return self.scheduler.running

    # ---- requests ---------------------------------------------------------------------------
    def add_request(self, request: Request, grammar: CompiledGrammar | None = None) -> EngineSequence:
        """Queue a request (RequestError if it can never be served); its sequence, whose stats fill in as it runs.
        `grammar`: its structured output's grammar compiled beforehand (else compiled here, on the caller's thread)."""
        grammar = self.check_request(request, grammar)
        return self._enqueue(request, grammar)

    def _enqueue(self, request: Request, grammar: CompiledGrammar | None = None) -> EngineSequence:
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
        seq = EngineSequence(request, tokens, out, gen, seqno=next(self._ids),
                       acceptance=Acceptance(0.0, 0.0, self.acceptance.decay))  # its own rounds only
        if params.structured is not None:
            seq.grammar = (grammar or self.grammars.compile(params.structured)).start()
            seq.grammar.consume(out.token_ids)  # a resumed request's tokens so far
        if self.prefix_caching and params.prompt_logprobs is None:  # scoring a prompt runs every position of it
            share, tenant, salt = self.share_across_tenants, request.tenant, request.cache_salt
            seq.target_names = ChainNames(request_root(self.prefix_identity, tenant, salt, share),
                                          self.target.cache.block_size)
            if isinstance(self.drafter, ModelDrafter) and self.draft.replicated_cache:
                seq.draft_names = ChainNames(request_root(model_identity(self.draft), tenant, salt, share),
                                             self.draft.cache.block_size)
        if resume is not None and resume.stats is not None:
            seq.stats = copy.deepcopy(resume.stats)
        self.scheduler.add(seq)
        return seq

    def check_request(self, request: Request, grammar: CompiledGrammar | None = None) -> CompiledGrammar | None:
        """Raise RequestError if the request can never be served; changes nothing. Returns its structured output's
        compiled grammar (`grammar` if given, else compiled here: an invalid spec is a 400 here)."""
        params, vocab = request.params, self.target.model.config.vocab_size
        check_prompt(request.prompt_token_ids, params.max_tokens, self.max_model_len, vocab)
        if self.sequence(request.request_id) is not None:
            raise RequestError(f"request id {request.request_id!r} is already in use")
        if any(t >= vocab for t in params.logit_bias):
            raise RequestError(f"logit_bias token ids must be in [0, {vocab})", param="logit_bias")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise RequestError(f"stop_token_ids must be in [0, {vocab})", param="stop_token_ids")
        if params.structured is None:
            return None
        return grammar or self.grammars.compile(params.structured)

    def abort(self, request_id: str) -> TokenDelta | None:
        """Cancel a request and free its KV; returns its final delta, or None if it is unknown."""
        seq = self.scheduler.remove(request_id)
        if seq is None:
            return None
        self.free(seq)
        seq.status = SeqStatus.FINISHED
        seq.output.finish_reason = FinishReason.ABORT
        return TokenDelta(request_id, (), seq.output.text_delta(), FinishReason.ABORT)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def sequence(self, request_id: str) -> EngineSequence | None:
        """The request's sequence if it is queued or running here."""
        return next((s for s in self.waiting + self.running if s.request_id == request_id), None)

    def flush(self) -> None:
        """Nothing to ship: the runners take the cache ops of the last step with their next forward (an Instance
        ships its shards' at once; actors/engine/offline.py calls this after a batch)."""

    # ---- the step ---------------------------------------------------------------------------
    def step(self) -> list[TokenDelta]:
        """One step: schedule -> plan speculation -> propose -> score -> verify -> apply."""
        t0 = time.perf_counter()
        schedule = self.scheduler.schedule()
        deltas = [self._failed(f) for f in schedule.failed]
        if not schedule.works:
            return deltas
        # the batch it settles into: what runs and what waits, up to the batch size (a request that drafts while the
        # queue is still filling the batch catches its draft up on a prompt it will not draft for)
        settled = min(len(self.running) + len(self.waiting), self.scheduler.cfg.max_batch_size)
        plan = self.planner.plan(schedule, running=settled)
        t1 = time.perf_counter()
        drafts = self._propose(plan)
        scores = self._score(plan, drafts)
        t2 = time.perf_counter()
        verdicts = verify(plan, drafts, scores, coupled=self.deterministic)
        deltas += self._apply(plan, scores, verdicts)
        self._observe(plan, drafts, scores, deltas, plan_s=t1 - t0, apply_s=time.perf_counter() - t2,
                      step_s=time.perf_counter() - t0)
        return deltas

    def _propose(self, plan: SpecPlan) -> Drafts:
        """Each drafting work's proposal (none where k = 0)."""
        drafting = plan.drafting
        if self.drafter is None or not drafting:
            return Drafts({})
        return self.drafter.propose(drafting)

    def _score(self, plan: SpecPlan, drafts: Drafts) -> Scores:
        """One target forward over every work's chunk plus its drafts; logits (k+1, V) for each emitting work."""
        t0 = time.perf_counter()
        chunks, rows, prompt_rows, n = [], {}, {}, 0
        for d in plan.works:
            w, tokens = d.work, drafts.of(d.request_id).tokens
            scored = self._scores_prompt(w)  # prompt positions it wants logprobs after (all of this chunk's)
            logits = (len(tokens) + 1 if w.emits else 0) + (w.num_new - (1 if w.emits else 0) if scored else 0)
            chunks.append(SeqChunk(d.request_id, tuple(w.seq.token_ids[w.start:w.start + w.num_new] + tokens), logits))
            if scored:
                prompt_rows[d.request_id] = (n, w.num_new)
            if w.emits:
                rows[d.request_id] = (n + logits - len(tokens) - 1, len(tokens) + 1)
            n += logits
        logits = self.target.forward(chunks)  # (sum over works of the rows each asked for, V)
        tokens = sum(len(c.token_ids) for c in chunks)
        attention = sum(len(c.token_ids) * self.target.cache.length(c.request_id) for c in chunks) / ATTENTION_UNIT
        return Scores(logits, rows, ForwardShape(1, tokens, attention), time.perf_counter() - t0, prompt_rows)

    @staticmethod
    def _scores_prompt(w) -> bool:
        """Whether this chunk's positions give prompt logprobs: the request asked, and the chunk is in its prompt."""
        return w.seq.request.params.prompt_logprobs is not None and w.start < len(w.seq.request.prompt_token_ids)

    def _apply(self, plan: SpecPlan, scores: Scores, verdicts: dict[str, Verdict]) -> list[TokenDelta]:
        """Emit each round's tokens, then crop rejected KV (target and drafter) or free a finished request."""
        deltas = []
        for rid, (first, n) in scores.prompt_rows.items():
            self._score_prompt(plan, rid, scores.logits[first:first + n])
        for d in plan.emitting:
            seq, v = d.work.seq, verdicts[d.request_id]
            n_before = len(seq.token_ids)
            self._observe_round(seq, RoundRecord(d.request_id, self._drafter_kind, v.proposed, v.accepted))
            self.planner.observe(d, v.proposed, v.accepted)
            if seq.output.max_new_tokens == 0:  # a prompt being scored: nothing to generate
                seq.output.finish_reason = FinishReason.LENGTH
                taken = []
            else:
                taken = seq.output.append(list(v.tokens))
            seq.token_ids.extend(taken)
            if seq.grammar is not None:
                seq.grammar.consume(taken)
            rid = seq.request_id
            if seq.output.finish_reason is not None:
                self.scheduler.remove(rid)
                seq.status = SeqStatus.FINISHED
                self.free(seq)
            else:
                self.target.cache.crop(rid, n_before + v.accepted)
                if self.drafter is not None:
                    self.drafter.accepted(seq, n_before + v.accepted)
            deltas.append(TokenDelta(rid, tuple(taken), seq.output.text_delta(), seq.output.finish_reason,
                                     logprobs=v.logprobs[: len(taken)] if v.logprobs is not None else None,
                                     prompt_logprobs=self._take_prompt_logprobs(seq)))
        if self.prefix_caching:
            for d in plan.works:  # prompt chunks and accepted tokens whose blocks filled up join the prefix cache
                if d.work.seq.status is not SeqStatus.FINISHED:
                    self._commit(d.work.seq)
        return deltas

    def _observe_round(self, seq: EngineSequence, r: RoundRecord) -> None:
        """The round's one record, read by each figure that counts rounds: the engine's per-position counters, the
        request's stats, and the policy's acceptance estimates (the request's and the engine-wide one)."""
        self._stats.observe(r)
        seq.stats.observe(r)
        seq.acceptance.observe(r)
        self.acceptance.observe(r)

    def _score_prompt(self, plan: SpecPlan, request_id: str, logits: torch.Tensor) -> None:
        """Record the logprobs of the prompt tokens a chunk's rows (n, V) predict (raw logits: vLLM's prompt
        logprobs are not processed)."""
        w = next(d.work for d in plan.works if d.request_id == request_id)
        seq, prompt = w.seq, w.seq.request.prompt_token_ids
        if seq.prompt_logprobs is None:
            seq.prompt_logprobs = [None]
        start = len(seq.prompt_logprobs) - 1  # rows already scored (a recomputed chunk is not scored twice)
        targets = [(i, prompt[w.start + i + 1]) for i in range(logits.shape[0])
                   if start <= w.start + i and w.start + i + 1 < len(prompt)]
        if targets:
            rows = logits[[i for i, _ in targets]].float().log_softmax(-1)  # (T, V)
            seq.prompt_logprobs += logprobs_of(rows, [t for _, t in targets], seq.request.params.prompt_logprobs)

    @staticmethod
    def _take_prompt_logprobs(seq: EngineSequence) -> tuple | None:
        """The prompt's logprobs, once: with the request's first delta."""
        if seq.prompt_logprobs is None or seq.prompt_logprobs_sent:
            return None
        seq.prompt_logprobs_sent = True
        return tuple(seq.prompt_logprobs)

    def _observe(self, plan: SpecPlan, drafts: Drafts, scores: Scores, deltas: list[TokenDelta], plan_s: float,
                 apply_s: float, step_s: float) -> None:
        """Feed the step's times to the cost model (the goodput policy's) and the counters (the stats')."""
        forwards = self.drafter is not None and self.drafter.runs_forwards
        lookup_s = 0.0 if forwards else drafts.seconds  # a lookup's (small) time is per-request overhead
        self.cost_model.observe(scores.shape, scores.seconds, drafts.shape, drafts.seconds if forwards else 0.0,
                                requests=len(plan.emitting), overhead_s=plan_s + apply_s + lookup_s)
        self._stats.record(plan, deltas, step_s)
        drafted = sum(len(p.tokens) for p in drafts.proposals.values())
        if plan.emitting and not plan.schedule.num_prefill_tokens:  # decode steps alone are alike enough to compare
            self.policy.observe_step(len(plan.emitting), drafted > 0, sum(len(d.token_ids) for d in deltas), step_s)
        if drafted and forwards:
            self._stats.draft_stage(drafted, drafts.seconds)

    # ---- KV and errors ----------------------------------------------------------------------
    def _commit(self, seq: EngineSequence) -> None:
        """Name the request's full target blocks whose KV is final (its accepted tokens) in the prefix cache."""
        cache, rid = self.target.cache, seq.request_id
        if seq.target_names is not None and cache.has(rid):
            cache.commit(rid, seq.target_names.upto(seq.token_ids, cache.length(rid)))

    def free(self, seq: EngineSequence) -> None:
        """Free a request's KV (finished, aborted, failed or preempted) and what the drafter holds for it; with
        prefix caching its full blocks stay cached for later requests that start alike."""
        self._commit(seq)
        self.target.cache.free(seq.request_id)
        if self.drafter is not None:
            self.drafter.release(seq, finished=seq.status is SeqStatus.FINISHED and seq.output.finish_reason is not None)

    @staticmethod
    def _failed(failure: Failed) -> TokenDelta:
        """A request the scheduler gave up on ends with an error."""
        seq = failure.seq
        seq.status = SeqStatus.FINISHED
        seq.output.finish_reason = FinishReason.ERROR
        return TokenDelta(seq.request_id, (), "", FinishReason.ERROR, error=failure.message)

    # ---- cost model and stats ---------------------------------------------------------------
    def calibrate(self, later: bool = False) -> None:
        """Seed the step-time model with timed forwards at a few sizes, or with the points saved for this setup by
        an earlier start (`self.calibration`; actors/speculation/calibration.py). `later`: forwards that must be
        timed are left to `idle_work` (the engine serves meanwhile on the steps it has seen)."""
        runners = [("target", self.target)] + ([("draft", self.draft)] if self.draft is not None else [])
        with phase("calibration"):
            if not later:
                calibrate(self.cost_model, runners, self.max_model_len, self.calibration)
                return
            saved = self.calibration.load() if self.calibration is not None else None
            if saved is not None:
                seed(self.cost_model, saved)
            else:
                self.pending_calibration = Pending(self.cost_model, runners, self.max_model_len, self.calibration)

    def idle_work(self) -> bool:
        """Work done while no request runs (the serving loop calls it then, between commands): one forward of a
        calibration left for later. True while more remains."""
        pending = self.pending_calibration
        if pending is None:
            return False
        if not pending.step():
            self.pending_calibration = None
        return self.pending_calibration is not None

    def load(self, instance_id: str) -> InstanceLoad:
        """This engine's load in target KV blocks, per request, for the router's migration policies."""
        tc = self.target.cache

        def peak(s: EngineSequence) -> int:  # blocks at its length limit
            return tc.blocks_for(min(len(s.token_ids) + s.remaining, self.max_model_len))

        running = tuple(RequestLoad(s.request_id, tc.blocks_for(tc.length(s.request_id)), s.request.priority,
                                    len(s.token_ids), peak(s)) for s in self.running if tc.has(s.request_id))
        queued = sorted(self.waiting, key=EngineSequence.order_key)
        waiting = tuple(RequestLoad(s.request_id, tc.blocks_for(len(s.token_ids) + 1), s.request.priority,
                                    len(s.token_ids), peak(s)) for s in queued)
        return InstanceLoad(instance_id, tc.num_used_blocks + tc.num_free_blocks, running, waiting,
                            max_running=self.scheduler.cfg.max_batch_size)

    def stats(self) -> EngineStats:
        """Load and speed figures after the last step (what the router reads)."""
        c, tc = self._stats, self.target.cache
        calibration = self.drafter.calibration if isinstance(self.drafter, ModelDrafter) else None
        dc = self.draft.cache if self.draft is not None else None
        ep = self.target.expert_stats()  # an expert-parallel target's figures since the start (else None)
        return EngineStats(
            load=LoadStats(running=len(self.running), waiting=len(self.waiting), kv_blocks_used=tc.num_used_blocks,
                           kv_blocks_free=tc.num_free_blocks, draft_kv_blocks_used=dc.num_used_blocks if dc else 0,
                           draft_kv_blocks_free=dc.num_free_blocks if dc else 0,
                           num_preemptions=self.scheduler.num_preemptions),
            step=StepStats(num_steps=c.steps, step_time_s=c.step_s, step_time_ema_s=c.step_ema_s,
                           batch_size=c.batch_size, batch_tokens=c.batch_tokens, prefill_tokens=c.prefill_tokens,
                           tokens_emitted=c.tokens_emitted),
            spec=SpecDecodingStats(policy=self.policy.name, mean_k=c.mean_k, acceptance=self.acceptance.rate,
                                   draft_s_per_token=c.draft_s_per_token,
                                   acceptance_by_position=c.acceptance_by_position,
                                   calibration_tokens=calibration.tokens if calibration else 0,
                                   calibration_s=calibration.seconds if calibration else 0.0),
            prefix_cache=PrefixCacheStats(queries=self.scheduler.prefix_queries, hits=self.scheduler.prefix_hits,
                                          cached_blocks=tc.num_cached_blocks),
            moe=MoEStats(ep.local_rate, ep.bytes_per_token, ep.seconds_per_token) if ep else MoEStats(),
        )
