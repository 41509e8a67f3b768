"""Acceptance by a lookup match's class, position by position (actors/speculation/evidence.py), and the planner's use
of it: drafts from strong matches go ahead in a full batch while weak ones stop, where one rate per request would
treat them alike."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from actors.engine.core import Engine
from actors.engine.offline import generate
from actors.speculation.cost_model import StepCostModel
from actors.speculation.evidence import EvidenceAcceptance, PositionRates, match_class
from actors.speculation.plan import SpeculationPlanner
from actors.speculation.policy import Acceptance, GoodputPolicy, expected_tokens
from actors.speculation.step import Drafting
from cluster.config import SpeculationConfig
from cluster.request import SamplingParams
from tests.unit.helpers import load, runner

# This CPU's default model at batch 8 (docs/benchmarks.md, "Acceptance by the n-gram's length"): a forward costs
# about 14 ms plus 1.2 ms a row, so in a batch of 8 a draft row pays only if it is accepted over 40% of the time.
ROWS_COST = StepCostModel.from_weights(target=[0.014, 0.0012, 0.0], draft=[0.0, 0.0, 0.0])


def test_each_position_counts_the_rounds_that_reached_it() -> None:
    rates = PositionRates()
    rates.update(4, 2, decay=1.0)  # positions 0 and 1 accepted, 2 rejected, 3 never tried
    rates.update(4, 4, decay=1.0)
    assert rates.trials == [2.0, 2.0, 2.0, 1.0] and rates.successes == [2.0, 2.0, 1.0, 1.0]
    assert rates.rate(2, prior=0.5, weight=0.0) == pytest.approx(0.5)
    assert rates.rate(7, prior=0.3) == pytest.approx(0.3)  # never reached: the prior alone


def test_with_no_evidence_the_expectation_is_the_iid_one() -> None:
    for alpha in (0.0, 0.3, 0.9):
        assert PositionRates().expected(4, alpha) == pytest.approx([expected_tokens(alpha, k) for k in range(5)])


def test_rounds_without_drafts_teach_nothing() -> None:
    est = EvidenceAcceptance()
    est.observe(3, 0, 0)
    assert est.by_class == {}


def test_long_matches_share_classes() -> None:
    assert [match_class(n) for n in (0, 1, 4, 5, 8, 9, 16, 17, 23, 63)] == [0, 1, 4, 8, 8, 16, 16, 32, 32, 32]


class ClassedLookup:
    """A lookup drafter whose every request has a 4-token match of a fixed class."""

    kind, runs_forwards = "ngram", False

    def __init__(self, classes: dict[str, int | None]) -> None:
        self.classes = classes

    def lookahead(self, seq, k: int) -> int:  # noqa: ANN001
        return min(k, 4)

    def evidence(self, seq) -> int | None:  # noqa: ANN001
        return self.classes[seq.request_id]

    def backlog(self, seq, end: int) -> int:  # noqa: ANN001
        return 0

    def reserve(self, w, k: int) -> int:  # noqa: ANN001
        return k


def batch_of_eight(classes: dict[str, int | None]) -> tuple[SpeculationPlanner, SimpleNamespace]:
    """A planner over `classes`' requests, each with its own acceptance estimate at 0.5, and their schedule."""
    engine_wide = Acceptance.prior(0.5)
    planner = SpeculationPlanner(GoodputPolicy(4, ROWS_COST, draft_forwards=False), ClassedLookup(classes),
                                 SimpleNamespace(reserve=lambda rid, n: True), 4, engine_wide)
    works = [SimpleNamespace(seq=SimpleNamespace(request_id=rid, remaining=100, acceptance=Acceptance.prior(0.5)),
                             start=100, num_new=1, emits=True) for rid in classes]
    return planner, SimpleNamespace(works=works, draft_budget=64)


def test_a_full_batch_drafts_strong_matches_and_not_weak_ones() -> None:
    classes = {f"strong{i}": 4 for i in range(4)} | {f"weak{i}": 2 for i in range(4)}
    planner, schedule = batch_of_eight(classes)
    strong, weak = (Drafting(schedule.works[0], 4, 4), Drafting(schedule.works[4], 4, 2))
    for _ in range(30):  # what verification saw: 4-gram drafts all accepted, 2-gram drafts all rejected
        planner.observe(strong, 4, 4)
        planner.observe(weak, 4, 0)
    ks = {d.request_id: d.k for d in planner.plan(schedule, running=8).works}
    assert all(ks[f"strong{i}"] == 4 for i in range(4)) and all(ks[f"weak{i}"] == 0 for i in range(4)), ks
    # one rate per request (0.5 each, the same evidence mixed) would give every request the same k
    blind, schedule = batch_of_eight(dict.fromkeys(classes))
    assert len({d.k for d in blind.plan(schedule, running=8).works}) == 1


def test_the_engine_feeds_its_ngram_rounds_to_their_match_classes(tiny_models) -> None:
    """Through the engine: every drafting round lands in the class of the n-gram it followed, and the output is
    still plain decoding's."""
    target = load(tiny_models["llama"])
    spec = SpeculationConfig(method="ngram", policy="fixed", k=3, ngram={"min_n": 1, "max_n": 3})
    engine = Engine(runner(target), None, spec)
    plain = Engine(runner(target), None, SpeculationConfig(policy="off"))
    prompt = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    out = generate(engine, [prompt], params)[0]
    assert out.token_ids == generate(plain, [prompt], params)[0].token_ids
    by_class = engine.planner.evidence.by_class
    assert set(by_class) <= {1, 2, 3} and by_class, by_class
    assert sum(r.trials[0] for r in by_class.values()) > 0


def test_the_lookup_bench_reads_each_drafts_fate_off_the_greedy_output() -> None:
    """`specfleet bench lookup`'s counting: "1 2 3" recurs, so its 3-gram proposes 4 5 6; the output goes 4 5 7, so
    two drafts are accepted and the third rejected; then nothing matches "5 7" and the last round has no drafts."""
    from deploy.bench.lookup import acceptance_by_match
    from cluster.config import NgramConfig

    classes, rounds = acceptance_by_match([[1, 2, 3, 4, 5, 6, 1, 2, 3]], [[4, 5, 7, 8]], k=4, ngram=NgramConfig())
    assert rounds == 2 and list(classes) == [3]
    c = classes[3]
    assert (c.rounds, c.accepted, list(c.counts.trials), list(c.counts.successes)) == (1, 2, [1, 1, 1], [1, 1, 0])
    assert c.rates() == [1.0, 1.0, 0.0]
