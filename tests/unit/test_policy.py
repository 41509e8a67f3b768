"""Speculation-length policies on plain data: fixed, off, and goodput's choices under acceptance and load."""

from __future__ import annotations

import pytest

from actors.speculation.cost_model import ForwardShape, StepCostModel
from actors.speculation.policy import (
    Acceptance, BatchBase, Candidate, FixedPolicy, GoodputPolicy, OffPolicy, expected_tokens, make_policy,
)
from cluster.config import SpeculationConfig

# A memory-bound accelerator: a forward costs mostly its fixed part, so extra tokens are nearly free,
# and a draft forward costs a tenth of the target's.
MEMORY_BOUND = StepCostModel.from_weights(target=[0.020, 0.00005, 0.0], draft=[0.002, 0.00001, 0.0])
# A compute-bound one: every token costs as much as the fixed part of the forward.
COMPUTE_BOUND = StepCostModel.from_weights(target=[0.020, 0.004, 0.0], draft=[0.002, 0.0008, 0.0])


def cands(alphas: list[float], max_k: int = 4) -> list[Candidate]:
    return [Candidate(a, max_k, 1, 200) for a in alphas]


def test_expected_tokens_is_the_geometric_sum() -> None:
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_acceptance_counts_trials_up_to_the_first_rejection() -> None:
    est = Acceptance(0.0, 0.0, decay=1.0)
    est.update(4, 4)  # four successes, no failure
    est.update(4, 1)  # one success, then a failure; the last two drafts were never tried
    assert est.rate == pytest.approx(5 / 6)
    est.update(0, 0)  # a round without drafts says nothing
    assert est.rate == pytest.approx(5 / 6)


def test_acceptance_forgets_old_rounds() -> None:
    est = Acceptance.prior(0.9, weight=2.0, decay=0.5)
    for _ in range(10):
        est.update(4, 0)
    assert est.rate < 0.01
    assert est.copy().rate == pytest.approx(est.rate)


def test_fixed_and_off() -> None:
    c = [Candidate(0.1, 4, 1, 10), Candidate(0.9, 2, 1, 10), Candidate(0.9, 0, 1, 10)]
    assert FixedPolicy(4).choose(c, BatchBase(), 100) == [4, 2, 0]
    assert FixedPolicy(4).choose(c, BatchBase(), 5) == [4, 1, 0]  # the budget caps the total
    assert OffPolicy().choose(c, BatchBase(), 100) == [0, 0, 0]


def test_goodput_picks_zero_for_a_useless_draft_and_the_most_for_a_perfect_one() -> None:
    policy = GoodputPolicy(4, MEMORY_BOUND)
    assert policy.choose(cands([0.0]), BatchBase(), 100) == [0]
    assert policy.choose(cands([1.0]), BatchBase(), 100) == [4]
    assert policy.choose(cands([0.0] * 8), BatchBase(), 100) == [0] * 8


def test_goodput_speculates_less_under_load_on_a_compute_bound_device() -> None:
    policy = GoodputPolicy(4, COMPUTE_BOUND)
    light = policy.choose(cands([0.8]), BatchBase(), 100)
    heavy = policy.choose(cands([0.8] * 16), BatchBase(), 100)
    assert light[0] > 0
    assert sum(heavy) / len(heavy) < light[0]


def test_goodput_gives_more_drafts_to_the_requests_that_accept_more() -> None:
    policy = GoodputPolicy(4, COMPUTE_BOUND)
    ks = policy.choose(cands([0.95, 0.3, 0.95, 0.3]), BatchBase(), 100)
    assert ks[0] == ks[2] > ks[1] == ks[3]


def test_goodput_is_at_least_as_good_as_every_uniform_k() -> None:
    for model in (MEMORY_BOUND, COMPUTE_BOUND):
        policy = GoodputPolicy(6, model)
        for alphas in ([0.6] * 4, [0.9, 0.2, 0.7], [0.5] * 12):
            c = cands(alphas, max_k=6)
            chosen = policy.goodput(c, BatchBase(), policy.choose(c, BatchBase(), 1000))
            for k in range(7):
                assert chosen >= policy.goodput(c, BatchBase(), [k] * len(c)) - 1e-9


def test_goodput_respects_each_request_cap_and_the_budget() -> None:
    policy = GoodputPolicy(4, MEMORY_BOUND)
    c = [Candidate(1.0, 1, 1, 10), Candidate(1.0, 4, 1, 10), Candidate(1.0, 4, 1, 10)]
    ks = policy.choose(c, BatchBase(), 5)
    assert ks[0] <= 1 and sum(ks) <= 5


def test_a_long_prefill_in_the_step_makes_drafts_relatively_cheaper() -> None:
    """With a big prefill chunk riding along, the step is long anyway, so more k pays on a compute-bound device."""
    policy = GoodputPolicy(4, COMPUTE_BOUND)
    c = cands([0.7] * 8)
    alone = sum(policy.choose(c, BatchBase(), 100))
    with_prefill = sum(policy.choose(c, BatchBase(ForwardShape(1, 256, 0.0)), 100))
    assert with_prefill >= alone


def test_a_prefill_in_the_step_does_not_buy_drafts_that_lose_in_a_decode_step() -> None:
    """On a forward linear in its rows, a draft accepted 45% of the time loses in a decode step of 8 (a row costs
    what 0.6 of a plain token does); a 256-token prefill riding along makes the step's own tokens per second so low
    that any draft lifts it, but the drafts still cost their rows: the choice is the decode step's."""
    policy = GoodputPolicy(4, COMPUTE_BOUND)
    assert policy.choose(cands([0.45] * 8), BatchBase(), 100) == [0] * 8
    assert policy.choose(cands([0.45] * 8), BatchBase(ForwardShape(1, 256, 0.0)), 100) == [0] * 8
    assert sum(policy.choose(cands([0.9] * 8), BatchBase(ForwardShape(1, 256, 0.0)), 100)) > 0  # ones that pay, do


def test_a_prompts_last_chunk_is_prefill_to_a_draft_model_not_to_a_lookup() -> None:
    """A request whose step feeds its prompt's last 200 tokens emits one token, as a decode does. To a draft model
    those tokens are prefill, as another request's chunk is, so they buy no drafts that lose in the decode step of 8
    (the Qwen pair at batch 8 drafted k = 4 for every request in such steps, then caught its draft up on each prompt
    for nothing). A lookup keeps the chunk in its candidate: its drafts on a prompt's tail cost only their rows."""
    model = GoodputPolicy(4, COMPUTE_BOUND)
    last_chunk = [Candidate(0.45, 4, 200, 300)] + cands([0.45] * 7)
    assert model.choose(last_chunk, BatchBase(), 100) == [0] * 8
    assert sum(model.choose([Candidate(0.9, 4, 200, 300)] + cands([0.9] * 7), BatchBase(), 100)) > 0  # these pay
    lookup = GoodputPolicy(4, COMPUTE_BOUND, draft_forwards=False)
    assert lookup.choose(cands([0.45] * 8), BatchBase(), 100) == [0] * 8  # in a decode step they lose
    assert sum(lookup.choose(last_chunk, BatchBase(), 100)) > 0  # the long step's own rate: the rule before


def test_an_unfitted_cost_model_does_not_speculate() -> None:
    assert GoodputPolicy(4, StepCostModel()).choose(cands([1.0]), BatchBase(), 100) == [0]


def test_make_policy_by_name() -> None:
    cost = StepCostModel()
    assert make_policy(SpeculationConfig(policy="goodput", k=3), True, cost).name == "goodput"
    assert make_policy(SpeculationConfig(policy="fixed", k=3), True, cost).name == "fixed"
    assert make_policy(SpeculationConfig(policy="fixed", k=3), False, cost).name == "off"  # no draft
    assert make_policy(SpeculationConfig(policy="goodput", k=0), True, cost).name == "off"


def test_a_draft_backlog_is_caught_up_only_if_the_rest_of_the_request_pays_for_it() -> None:
    """After a pause the draft must first feed the tokens it missed; the policy charges that once-only cost over the
    rounds the request has left: a long remainder resumes drafting, a short one does not."""
    # memory-bound, but a draft fed many tokens at once pays for each (0.2 ms a token)
    policy = GoodputPolicy(4, StepCostModel.from_weights(target=[0.020, 0.00005, 0.0], draft=[0.002, 0.0002, 0.0]))
    fresh = Candidate(0.8, 4, 1, 400, draft_backlog=1, remaining=200)
    long_rest = Candidate(0.8, 4, 1, 400, draft_backlog=300, remaining=200)
    short_rest = Candidate(0.8, 4, 1, 400, draft_backlog=300, remaining=5)
    assert policy.choose([fresh], BatchBase(), 100) == [4]
    assert policy.choose([long_rest], BatchBase(), 100)[0] > 0
    assert policy.choose([short_rest], BatchBase(), 100) == [0]
    assert policy.catch_up_seconds(short_rest, 4) > policy.catch_up_seconds(long_rest, 4) > 0
    assert policy.catch_up_seconds(short_rest, 0) == 0  # no drafting, no catch-up


def test_a_lookup_drafter_costs_no_draft_forwards() -> None:
    """With draft_forwards=False (n-gram, suffix) drafting adds only the verified tokens to the target: on a
    compute-bound device where a draft model does not pay at alpha 0.5, a lookup still does."""
    c = cands([0.5])
    model_draft = GoodputPolicy(4, COMPUTE_BOUND)
    lookup = GoodputPolicy(4, COMPUTE_BOUND, draft_forwards=False)
    assert lookup.goodput(c, BatchBase(), [2]) > model_draft.goodput(c, BatchBase(), [2])
    assert sum(lookup.choose(c, BatchBase(), 100)) >= sum(model_draft.choose(c, BatchBase(), 100))
    assert lookup.choose(c, BatchBase(), 100)[0] > 0


def test_a_catch_up_is_paid_in_full_by_a_request_that_would_not_draft_once_the_batch_settles() -> None:
    """A step with a prefill chunk makes a draft look cheap; if the 8 running requests' decode-only steps give this
    request k = 0, no later round shares its catch-up, so this step pays all of it (the Qwen pair at batch 8 caught
    its draft up on whole prompts for one round of drafts). Alone, it drafts in every round, so the catch-up is
    spread over them."""
    convex_at_8 = [0.0] * 17
    convex_at_8[:2], convex_at_8[3 + 7 + 2] = [0.020, 0.0], 0.004  # 20 ms a forward, 4 ms a token beyond 8
    policy = GoodputPolicy(4, StepCostModel.from_weights(target=convex_at_8, draft=[0.002, 0.004, 0.0]))
    behind = Candidate(0.8, 4, 1, 300, draft_backlog=150, remaining=200)
    prefill = ForwardShape(1, 20, 0.0)
    assert policy.choose([Candidate(0.8, 4, 1, 300)] * 8, BatchBase(), 256) == [0] * 8  # the settled batch of 8
    assert policy.choose([Candidate(0.8, 4, 1, 300)], BatchBase(), 256)[0] > 0  # a request alone
    assert policy.choose([behind], BatchBase(prefill, running=8), 256) == [0]
    assert policy.choose([behind], BatchBase(prefill, running=1), 256)[0] > 0
    assert policy.catch_up_seconds(behind, 4, one_off=True) > 50 * policy.catch_up_seconds(behind, 4)
