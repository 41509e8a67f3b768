"""The goodput policy's measured guard on plain step timings: drafting stops at a batch size where it measures
slower than plain steps, whatever the cost model says, and continues where it measures faster."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors.engine.offline import generate
from actors.speculation.cost_model import StepCostModel
from actors.speculation.guard import MeasuredGuard, bucket_of
from actors.speculation.plan import SpeculationPlanner
from actors.speculation.policy import Acceptance, BatchBase, Candidate, GoodputPolicy, make_policy
from cluster.config import SpeculationConfig
from cluster.request import SamplingParams
from tests.unit.helpers import load, runner, text_prompts

# A cost model that says drafts are nearly free (a memory-bound accelerator): the policy drafts whenever it may.
SAYS_DRAFTS_PAY = StepCostModel.from_weights(target=[0.020, 0.00005, 0.0], draft=[0.002, 0.00001, 0.0])


def machine_step(batch: int, ks: list[int], alpha: float, plain_s: float, per_draft_s: float) -> tuple[int, float]:
    """What a step really emits and costs on a machine where each draft row costs `per_draft_s` (expected tokens,
    deterministic: each request emits 1 + alpha * k rounded down to whole tokens on average over the batch)."""
    tokens = batch + int(alpha * sum(ks))
    return tokens, plain_s + per_draft_s * sum(ks)


def run_steps(policy: GoodputPolicy, batch: int, steps: int, alpha: float, plain_s: float,
              per_draft_s: float) -> list[bool]:
    """Drive `policy` as the engine's planner does (allows -> choose -> observe_step); which steps drafted."""
    drafted = []
    for _ in range(steps):
        ks = [0] * batch
        if policy.allows(batch):
            ks = policy.choose([Candidate(alpha, 4, 1, 200) for _ in range(batch)], BatchBase(), budget=4 * batch)
        tokens, seconds = machine_step(batch, ks, alpha, plain_s, per_draft_s)
        policy.observe_step(batch, any(ks), tokens, seconds)
        drafted.append(any(ks))
    return drafted


def test_drafting_stops_where_it_measures_slower_than_plain_steps() -> None:
    # 8 requests, a 40 ms plain step; each draft row really costs 5 ms and is accepted half the time: a step of
    # 32 drafts emits 24 tokens in 200 ms (120 tok/s) against a plain step's 8 in 40 ms (200 tok/s)
    guarded = GoodputPolicy(4, SAYS_DRAFTS_PAY, draft_forwards=False, guard=MeasuredGuard(explore_every=16))
    unguarded = GoodputPolicy(4, SAYS_DRAFTS_PAY, draft_forwards=False)
    args = dict(batch=8, steps=200, alpha=0.5, plain_s=0.040, per_draft_s=0.005)
    old, new = run_steps(unguarded, **args), run_steps(guarded, **args)
    assert all(old)  # the cost model alone keeps drafting at a loss: the old policy fails here
    tail = new[50:]
    assert sum(tail) <= len(tail) / 16 + 1  # only the explorations draft once the guard has seen enough
    assert guarded.guard.closed(8)


def test_drafting_continues_where_it_measures_faster() -> None:
    # drafts that cost 1 ms a row and are accepted 90% of the time: drafting steps emit far more per second
    guarded = GoodputPolicy(4, SAYS_DRAFTS_PAY, draft_forwards=False, guard=MeasuredGuard(explore_every=16))
    drafted = run_steps(guarded, batch=8, steps=200, alpha=0.9, plain_s=0.040, per_draft_s=0.001)
    assert not guarded.guard.closed(8)
    assert sum(drafted) >= len(drafted) * (1 - 1 / 16) - 1  # all but the plain explorations that give it a baseline
    assert guarded.guard.buckets[8].plain.samples >= 3  # it did measure plain steps to compare against


def test_where_drafting_clearly_wins_no_plain_step_is_forced() -> None:
    # a lone request whose drafts are accepted 90% of the time at 1 ms a row: once three plain steps gave a baseline,
    # every step drafts (a forced plain step in eight would cost an eighth of the gain)
    guarded = GoodputPolicy(4, SAYS_DRAFTS_PAY, draft_forwards=False, guard=MeasuredGuard(explore_every=8))
    drafted = run_steps(guarded, batch=1, steps=200, alpha=0.9, plain_s=0.020, per_draft_s=0.001)
    assert all(drafted[50:])
    assert guarded.guard.buckets[1].plain.samples == 3


def test_a_closed_batch_size_reopens_when_drafting_pays_again() -> None:
    guarded = GoodputPolicy(4, SAYS_DRAFTS_PAY, draft_forwards=False, guard=MeasuredGuard(explore_every=8))
    run_steps(guarded, batch=4, steps=100, alpha=0.5, plain_s=0.040, per_draft_s=0.010)
    assert guarded.guard.closed(4)
    later = run_steps(guarded, batch=4, steps=200, alpha=0.95, plain_s=0.040, per_draft_s=0.0005)
    assert not guarded.guard.closed(4)
    assert sum(later[-50:]) >= 40  # drafting again, through the explorations' measurements


def test_batch_sizes_are_judged_apart() -> None:
    guard = MeasuredGuard(explore_every=16)
    policy = GoodputPolicy(4, SAYS_DRAFTS_PAY, draft_forwards=False, guard=guard)
    run_steps(policy, batch=1, steps=100, alpha=0.8, plain_s=0.020, per_draft_s=0.001)  # pays alone
    run_steps(policy, batch=8, steps=100, alpha=0.5, plain_s=0.040, per_draft_s=0.005)  # loses in a full batch
    assert not guard.closed(1) and guard.closed(8)
    assert bucket_of(1) == 1 and bucket_of(8) == 8 and bucket_of(9) == bucket_of(16) == 16 and bucket_of(17) == 32


def test_the_guard_needs_evidence_of_both_kinds_before_it_judges() -> None:
    guard = MeasuredGuard(explore_every=4, min_samples=3)
    for _ in range(2):
        guard.observe(8, True, 8, 1.0)  # very slow drafting steps
        guard.observe(8, False, 8, 0.01)
    assert not guard.closed(8)
    guard.observe(8, True, 8, 1.0)
    guard.observe(8, False, 8, 0.01)
    assert guard.closed(8)
    assert [guard.allows(8) for _ in range(8)] == [False, False, False, True] * 2  # one exploration in four


def test_the_guard_is_configured_and_can_be_turned_off() -> None:
    on = make_policy(SpeculationConfig(policy="goodput", guard={"explore_every": 32}), True, SAYS_DRAFTS_PAY)
    assert on.guard is not None and on.guard.explore_every == 32
    assert make_policy(SpeculationConfig(policy="goodput", guard={"enabled": False}), True, SAYS_DRAFTS_PAY).guard is None
    with pytest.raises(ValueError):
        SpeculationConfig(policy="goodput", guard={"explore_every": 1})


def test_a_closed_batch_size_takes_the_plain_path_and_stays_lossless(tiny_models) -> None:
    """An engine whose guard judged drafting slower at batch 2 plans k = 0 for both requests (no lookup, no search)
    except in its explorations, and emits what plain decoding emits."""
    from actors.engine.core import Engine

    target = load(tiny_models["llama"])
    spec = SpeculationConfig(method="ngram", policy="goodput", k=3, ngram={"min_n": 1, "max_n": 3},
                             guard={"explore_every": 1000})
    engine = Engine(runner(target), None, spec, cost_model=SAYS_DRAFTS_PAY)
    plain = Engine(runner(target), None, SpeculationConfig(policy="off"))
    for _ in range(3):  # measured before: drafting steps at half the plain steps' tokens per second
        engine.policy.guard.observe(2, True, 4, 0.2)
        engine.policy.guard.observe(2, False, 2, 0.05)
    prompts = text_prompts(target, 2)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = generate(engine, prompts, params)
    assert [c.token_ids for c in out] == [c.token_ids for c in generate(plain, prompts, params)]
    ks = [k for c in out for k in c.stats.k_history]
    assert ks and not any(ks)  # every step at batch 2 took the plain path
    assert engine.policy.guard.buckets[2].plain.samples > 3  # and was measured as plain


def test_a_draft_model_that_never_pays_is_not_searched_every_step() -> None:
    """A draft model whose drafts never pay: the policy says k = 0 each time it is asked, so the guard never sees a
    drafting step to close on; it now skips the search (milliseconds a step) until its next exploration, where the
    policy is asked again. A lookup is asked every step (its next match may pay)."""
    asked = []

    class Counting(GoodputPolicy):
        def choose(self, cands, base, budget):  # noqa: ANN001
            asked.append(len(cands))
            return super().choose(cands, base, budget)

    never_pays = StepCostModel.from_weights(target=[0.020, 0.004, 0.0], draft=[0.020, 0.004, 0.0])
    for draft_forwards, expected in ((True, 1 + 64 // 8), (False, 64)):  # the first step, then every 8th
        asked.clear()
        policy = Counting(4, never_pays, draft_forwards=draft_forwards, guard=MeasuredGuard(explore_every=8))
        planner = SpeculationPlanner(policy, FourAhead(draft_forwards), SimpleNamespace(reserve=lambda rid, n: True),
                                     4, Acceptance.prior(0.3))
        works = [SimpleNamespace(seq=SimpleNamespace(request_id=f"r{i}", remaining=100,
                                                     acceptance=Acceptance.prior(0.3)),
                                 start=100, num_new=1, emits=True) for i in range(8)]
        for _ in range(64):
            assert all(d.k == 0 for d in planner.plan(SimpleNamespace(works=works, draft_budget=32), 8).works)
        assert len(asked) == expected, (draft_forwards, len(asked))


class FourAhead:
    """A drafter that can always propose 4 tokens (a draft model, or a lookup with a match every step)."""

    kind = "model"

    def __init__(self, runs_forwards: bool) -> None:
        self.runs_forwards = runs_forwards

    def lookahead(self, seq, k: int) -> int:  # noqa: ANN001
        return k

    def evidence(self, seq) -> None:  # noqa: ANN001
        return None

    def backlog(self, seq, end: int) -> int:  # noqa: ANN001
        return 0

    def reserve(self, w, k: int) -> int:  # noqa: ANN001
        return k
