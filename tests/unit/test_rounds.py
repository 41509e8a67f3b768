"""One round, decided in a batch and recorded once: batched rejection sampling and the `RoundRecord` its readers fold."""

from __future__ import annotations

import pytest
import torch

from actors.engine.core import Engine
from actors.engine.offline import generate
from actors.engine.stats import StepCounters
from actors.speculation.policy import Acceptance
from actors.speculation.verify import round_noise, verify_sampled_batch
from cluster.config import SpeculationConfig
from cluster.request import SamplingParams, SpecStats
from cluster.rounds import RoundRecord
from tests.unit.helpers import chi_square, load, runner, text_prompts

V = 6
ALPHA = 1e-3  # fixed seeds: ALPHA bounds how unlucky a seed may be


def one_hot(*tokens: int) -> torch.Tensor:
    """Rows (n, V), row i certain of tokens[i]."""
    return torch.nn.functional.one_hot(torch.tensor(tokens), V).float()


def batch(rows: list[tuple[list[int], torch.Tensor, torch.Tensor]], seeds: list[int]):
    """Pack requests (drafts (k,), p (k+1, V), q (k, V)) and their generators' noise as the engine does; decide."""
    k = max(len(d) for d, _, _ in rows)
    drafts = torch.tensor([d + [-1] * (k - len(d)) for d, _, _ in rows], dtype=torch.long).reshape(len(rows), k)
    counts = torch.tensor([len(d) for d, _, _ in rows])
    p = torch.cat([p for _, p, _ in rows])
    q = torch.cat([q for _, _, q in rows]) if k else torch.zeros(0, V)
    p_first = torch.tensor([p.shape[0] for _, p, _ in rows]).cumsum(0) - torch.tensor([p.shape[0] for _, p, _ in rows])
    q_first = counts.cumsum(0) - counts
    noise = [round_noise(len(d), V, p.dtype, torch.Generator().manual_seed(s)) for (d, _, _), s in zip(rows, seeds)]
    u = torch.stack([torch.cat([u, torch.ones(k - u.shape[0])]) for u, _ in noise]).reshape(len(rows), k)
    e = torch.stack([e for _, e in noise])
    accepted, token = verify_sampled_batch(drafts, counts, p, p_first, q, q_first, u, e)
    return accepted.tolist(), token.tolist()


def test_all_accepted_takes_the_bonus_from_the_last_row() -> None:
    p = one_hot(2, 3, 4, 5)  # the draft proposes exactly what the target is certain of
    assert batch([([2, 3, 4], p, p[:3])], [0]) == ([3], [5])


def test_first_draft_rejected_draws_the_normalised_residual() -> None:
    p = torch.tensor([[0.0, 0.5, 0.5, 0, 0, 0], [1.0, 0, 0, 0, 0, 0]])
    q = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0, 0]])  # proposes 3, which the target never emits
    # residual max(0, p - q) = 0.5 on token 2 only: the recovered token is 2 whatever the noise
    for seed in range(20):
        assert batch([([3], p, q)], [seed]) == ([0], [2])


def test_rows_without_drafts_mix_with_rows_with_drafts() -> None:
    """k = 0 rows draw from their single row; their neighbours' offsets into the packed rows stay right."""
    rows = [([], one_hot(1), torch.zeros(0, V)),
            ([2, 3], one_hot(2, 3, 4), one_hot(2, 3)),  # all accepted: bonus 4
            ([], one_hot(5), torch.zeros(0, V)),
            ([1, 1], one_hot(1, 0, 0), one_hot(1, 1)),  # the second draft has p = 0: rejected, recovered 0
            ([], one_hot(3), torch.zeros(0, V))]
    assert batch(rows, list(range(5))) == ([0, 2, 0, 1, 0], [1, 4, 5, 0, 3])


def test_a_batch_of_rows_without_any_draft() -> None:
    assert batch([([], one_hot(4), torch.zeros(0, V)), ([], one_hot(2), torch.zeros(0, V))], [0, 1]) == ([0, 0], [4, 2])


def reference(draft: list[int], p: torch.Tensor, q: torch.Tensor, seed: int) -> tuple[int, int]:
    """One request alone, as verification drew before it was batched: k uniforms, then torch.multinomial."""
    g = torch.Generator().manual_seed(seed)
    k = len(draft)
    accepted = k
    if k:
        u = torch.rand(k, generator=g)
        ok = u * q[range(k), draft] < p[range(k), draft]
        accepted = int(ok.long().cumprod(0).sum())
    if accepted < k:
        residual = (p[accepted] - q[accepted]).clamp_min(0)
        dist = residual / residual.sum() if residual.sum() > 0 else p[accepted]
        return accepted, int(torch.multinomial(dist, 1, generator=g))
    return k, int(torch.multinomial(p[k], 1, generator=g))


def test_batched_draws_equal_each_request_verified_alone_with_its_seed() -> None:
    """Each request's generator gives the same noise in the same order, so seeded output is unchanged."""
    g = torch.Generator().manual_seed(7)
    rows, seeds = [], list(range(100, 140))
    for i, _ in enumerate(seeds):
        k = i % 4
        p = torch.softmax(torch.randn(k + 1, V, generator=g) * 2, -1)
        q = torch.softmax(torch.randn(k, V, generator=g) * 2, -1)
        draft = [int(torch.multinomial(q[j], 1, generator=g)) for j in range(k)]
        rows.append((draft, p, q))
    accepted, tokens = batch(rows, seeds)
    assert list(zip(accepted, tokens)) == [reference(d, p, q, s) for (d, p, q), s in zip(rows, seeds)]
    assert 0 < sum(accepted) < sum(len(d) for d, _, _ in rows)  # both paths taken


def test_first_emitted_token_is_distributed_as_the_target_in_a_mixed_batch() -> None:
    """Rounds of k = 2 and k = 0 in one batch: the first emitted token follows p's first row either way (Leviathan
    et al. 2023); the same counts against the draft's q are rejected (the test has the power to fail)."""
    n, g = 12_000, torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(3, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    rows = []
    for i in range(n):
        if i % 3 == 0:
            rows.append(([], p[:1], torch.zeros(0, V)))
        else:
            rows.append(([int(torch.multinomial(q[j], 1, generator=g)) for j in range(2)], p, q))
    accepted, tokens = batch(rows, list(range(n)))
    first = torch.tensor([d[0] if a else t for (d, _, _), a, t in zip(rows, accepted, tokens)])
    for group in (first[0::3], torch.cat([first[1::3], first[2::3]])):
        observed = torch.bincount(group, minlength=V)
        assert chi_square(observed, p[0])[1] > ALPHA
        assert chi_square(observed, q[0])[1] < ALPHA


def test_a_round_record_checks_its_counts() -> None:
    with pytest.raises(ValueError, match="accepts 0..2"):
        RoundRecord("r", "ngram", 2, 3)
    assert RoundRecord("r", "ngram", 3, 1).rejected and not RoundRecord("r", "ngram", 3, 3).rejected


def test_every_reader_folds_the_same_rounds() -> None:
    rounds = [RoundRecord("r", "model", 3, 1), RoundRecord("r", "model", 0, 0), RoundRecord("r", "model", 2, 2)]
    stats, counters, acceptance = SpecStats(), StepCounters(), Acceptance(0.0, 0.0, decay=1.0)
    for r in rounds:
        stats.observe(r)
        counters.observe(r)
        acceptance.observe(r)
    assert stats.k_history == [3, 0, 2] and (stats.proposed, stats.accepted, stats.rounds) == (5, 3, 2)
    assert counters.proposed_at == [2, 2, 1] and counters.accepted_at == [2, 1, 0]
    assert stats.accepted_per_position == counters.accepted_at  # one per draft position, the largest k long
    assert (acceptance.successes, acceptance.trials) == (3, 4)  # 1 + 1 rejection, then 2 with none


def test_an_engines_figures_agree_with_its_requests(tiny_models, tiny_draft_models) -> None:
    """The engine's per-position counters and its requests' stats read the same records: their sums agree."""
    target = load(tiny_models["llama"])
    engine = Engine(runner(target), runner(load(tiny_draft_models["llama"])), SpeculationConfig(k=3))
    prompts = text_prompts(target, 4)
    done = generate(engine, prompts, [SamplingParams(temperature=t, max_tokens=12, seed=5) for t in (0, 1, 0, 0.7)])
    stats = engine._stats
    assert sum(c.stats.proposed for c in done) == sum(stats.proposed_at) > 0
    assert sum(c.stats.accepted for c in done) == sum(stats.accepted_at)
    assert 0 < engine.stats().spec.acceptance < 1
