"""Sampling is lossless in distribution: verification emits the target's p, filters match brute force, seeds repeat."""

from __future__ import annotations

import functools

import pytest
import torch

from actors.engine.core import Engine
from actors.model.metadata import SeqChunk
from actors.engine.offline import generate
from actors.speculation.drafters import Proposal
from actors.speculation.sampling import make_generator, probs_from_logits, sample
from actors.speculation.verify import verify_greedy, verify_sampled
from cluster.config import SpeculationConfig
from cluster.request import FinishReason, SamplingParams
from tests.unit.helpers import chi_square, load, runner, text_prompts

V = 12
TRIALS = 20_000
ALPHA = 1e-3  # the tests below are deterministic (fixed seeds); ALPHA bounds how unlucky a seed may be


def distributions(k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Target p (k+1, V) and draft q (k, V), far apart; each p row forbids a token q proposes and vice versa."""
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(k + 1, V, generator=g) * 1.2, -1)
    q = torch.softmax(torch.randn(k, V, generator=g) * 1.2, -1)
    p[:, 0] = 0.0  # the target never emits token 0, though the draft proposes it
    q[:, 1] = 0.0  # the draft never proposes token 1, though the target wants it
    return p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)


def buggy_verify(bug: str):
    """verify_sampled with one deliberate mistake, for negative controls."""

    def verify(draft_tokens, draft_probs, target_probs, generator):
        k = draft_tokens.shape[0]
        for j in range(k):
            x = int(draft_tokens[j])
            u = torch.rand((), generator=generator)
            if bug == "accept_all" or u * draft_probs[j, x] < target_probs[j, x]:
                continue
            dist = target_probs[j] if bug == "resample_from_p" else (target_probs[j] - draft_probs[j]).clamp_min(0)
            return j, int(torch.multinomial(dist / dist.sum(), 1, generator=generator))
        bonus = k - 1 if bug == "bonus_off_by_one" else k
        return k, int(torch.multinomial(target_probs[bonus], 1, generator=generator))

    return verify


@functools.cache
def emitted(k: int, procedure: str = "verify_sampled", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Run `procedure` TRIALS times on drafts sampled from q; returns accepted counts (N,) and the first two
    emitted tokens (N, 2), the second -1 where the round emitted only one."""
    p, q = distributions(k, seed)
    verify = verify_sampled if procedure == "verify_sampled" else buggy_verify(procedure)
    g = torch.Generator().manual_seed(seed + 1)
    drafts = torch.stack([torch.multinomial(q[j], TRIALS, replacement=True, generator=g) for j in range(k)], 1)
    accepted = torch.empty(TRIALS, dtype=torch.long)
    tokens = torch.full((TRIALS, 2), -1, dtype=torch.long)
    for i in range(TRIALS):
        a, extra = verify(drafts[i], q, p, g)
        out = drafts[i, :a].tolist() + [extra]
        accepted[i] = a
        tokens[i, : min(2, len(out))] = torch.tensor(out[:2])
    return accepted, tokens


def fit(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of tokens (N,) against probs (V,); tokens of probability 0 must never occur."""
    counts = torch.bincount(tokens, minlength=V)
    assert counts[probs == 0].sum() == 0, "a token the distribution forbids was emitted"
    return chi_square(counts[probs > 0], probs[probs > 0])[1]


# ---- rejection sampling ------------------------------------------------------------------------
@pytest.mark.heavy
@pytest.mark.parametrize("k", [1, 2, 3])
def test_first_emitted_token_is_distributed_as_the_target(k: int) -> None:
    p, q = distributions(k, 0)
    accepted, tokens = emitted(k)

    assert fit(tokens[:, 0], p[0]) > ALPHA
    assert 0 < (accepted == 0).sum() < TRIALS and (accepted == k).sum() > 0  # both paths taken
    # the acceptance rate is sum_x min(p, q) (Leviathan et al., Theorem 3.5)
    beta = torch.minimum(p[0], q[0]).sum()
    assert abs((accepted >= 1).float().mean() - beta) < 4 * (beta * (1 - beta) / TRIALS) ** 0.5


@pytest.mark.parametrize("k", [1, 2, 3])
def test_second_token_after_an_accepted_first_is_distributed_as_the_target(k: int) -> None:
    p, _ = distributions(k, 0)
    accepted, tokens = emitted(k)
    second = tokens[accepted >= 1, 1]  # the bonus token when k == 1
    assert (second >= 0).all() and len(second) > TRIALS // 4

    assert fit(second, p[1]) > ALPHA


@pytest.mark.parametrize(("bug", "position", "k"), [
    ("accept_all", 0, 2),  # emits q instead of p
    ("resample_from_p", 0, 2),  # on rejection draws from p instead of norm(max(0, p - q))
    ("bonus_off_by_one", 1, 1),  # the bonus token drawn from the last draft position's p
])
@pytest.mark.heavy
def test_the_statistic_rejects_wrong_procedures(bug: str, position: int, k: int) -> None:
    """Negative controls: the same check, run on the output of subtly wrong verifiers, rejects them."""
    p, _ = distributions(k, 0)
    accepted, tokens = emitted(k, bug)
    picked = tokens[:, 0] if position == 0 else tokens[accepted >= 1, 1]
    counts, target = torch.bincount(picked, minlength=V), p[position]

    # over the tokens the target allows only (emitting a forbidden one would be caught anyway)
    assert chi_square(counts[target > 0], target[target > 0])[1] < ALPHA


@pytest.mark.heavy
@pytest.mark.parametrize("k", [1, 2])
def test_a_deterministic_draft_with_one_hot_q_emits_the_target(k: int) -> None:
    """Lookup drafters (n-gram, suffix) propose fixed tokens; with q one-hot on them the output is still p."""
    p, _ = distributions(k, 3)
    drafted = [int(p[j].argmax()) for j in range(k)]  # a likely draft, so that both paths are taken
    q = Proposal(drafted).q(V, p.device)  # (k, V)
    g = torch.Generator().manual_seed(7)
    first, second = [], []
    for _ in range(TRIALS):
        a, extra = verify_sampled(torch.tensor(drafted), q, p, g)
        out = drafted[:a] + [extra]
        first.append(out[0])
        if a >= 1:
            second.append(out[1])

    assert q.sum(-1).eq(1).all() and q[torch.arange(k), drafted].eq(1).all()
    assert fit(torch.tensor(first), p[0]) > ALPHA
    assert fit(torch.tensor(second), p[1]) > ALPHA
    assert 0.2 * TRIALS < len(second) < 0.95 * TRIALS  # accepted about p[0][drafted[0]] of the time


def test_greedy_verification_accepts_the_matching_prefix() -> None:
    logits = torch.full((4, V), -1.0)
    for j, best in enumerate([3, 5, 7, 9]):
        logits[j, best] = 1.0
    assert verify_greedy(torch.tensor([3, 5, 7]), logits) == (3, 9)  # all accepted, bonus
    assert verify_greedy(torch.tensor([3, 6, 7]), logits) == (1, 5)  # rejected at 1, the target's token
    assert verify_greedy(torch.tensor([4, 5, 7]), logits) == (0, 3)  # later matches do not count
    assert verify_greedy(torch.tensor([], dtype=torch.long), logits[:1]) == (0, 3)


def test_verify_sampled_with_identical_distributions_accepts_everything() -> None:
    p, _ = distributions(3, 5)
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        drafts = torch.stack([torch.multinomial(p[j], 1, generator=g)[0] for j in range(3)])
        assert verify_sampled(drafts, p[:3], p, g)[0] == 3


# ---- filters -------------------------------------------------------------------------------------
def brute_force(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """softmax(logits / T) kept to the top_k tokens, renormalized, then to the fewest reaching top_p mass."""
    probs = torch.softmax(logits.double() / temperature, -1)
    out = torch.zeros_like(probs)
    for pr, o in zip(probs, out):
        order = sorted(range(len(pr)), key=lambda i: -float(pr[i]))
        if 0 < top_k < len(order):
            order = order[:top_k]
        mass = sum(float(pr[i]) for i in order)
        kept, total = [], 0.0
        for i in order:
            kept.append(i)
            total += float(pr[i]) / mass
            if total >= top_p:
                break
        o[kept] = pr[kept] / sum(float(pr[i]) for i in kept)
    return out.float()


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
def test_temperature_scales_the_logits(temperature: float) -> None:
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(1)) * 3
    got = probs_from_logits(logits, SamplingParams(temperature=temperature))
    torch.testing.assert_close(got, torch.softmax(logits / temperature, -1))
    if temperature < 1:  # a lower temperature sharpens
        assert (got.max(-1).values > torch.softmax(logits, -1).max(-1).values).all()


@pytest.mark.parametrize("top_k", [1, 2, 5, 39])
def test_top_k_keeps_exactly_k_tokens(top_k: int) -> None:
    logits = torch.randn(8, 40, generator=torch.Generator().manual_seed(top_k)) * 2
    got = probs_from_logits(logits, SamplingParams(temperature=0.8, top_k=top_k))

    assert ((got > 0).sum(-1) == top_k).all()
    assert torch.equal((got > 0), torch.zeros_like(got, dtype=torch.bool).scatter(-1, logits.topk(top_k).indices, True))
    torch.testing.assert_close(got, brute_force(logits, 0.8, top_k, 1.0))


@pytest.mark.parametrize("top_k", [0, -1, 40, 100])
def test_top_k_off_keeps_everything(top_k: int) -> None:
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    got = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=top_k))
    torch.testing.assert_close(got, torch.softmax(logits, -1))


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [
    (1.0, 0, 0.5), (1.0, 0, 0.9), (0.7, 0, 0.95), (1.5, 0, 0.3), (1.0, 0, 0.01), (1.0, 10, 0.8), (0.5, 3, 0.99),
])
def test_top_p_keeps_the_smallest_set_reaching_the_mass(temperature: float, top_k: int, top_p: float) -> None:
    logits = torch.randn(64, 30, generator=torch.Generator().manual_seed(int(top_p * 100))) * 2
    got = probs_from_logits(logits, SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p))
    expected = brute_force(logits, temperature, top_k, top_p)

    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(got.sum(-1), torch.ones(64))


def test_sample_draws_from_the_distribution() -> None:
    probs = torch.tensor([[0.0, 0.2, 0.5, 0.3]]).repeat(8000, 1)
    g = make_generator(SamplingParams(seed=3))
    counts = torch.bincount(sample(probs, g), minlength=4)
    assert counts[0] == 0
    assert chi_square(counts[1:], probs[0, 1:])[1] > ALPHA


# ---- the engine ----------------------------------------------------------------------------------
def sampling_engine(tiny_models, tiny_draft_models, family: str = "llama", draft: str = "pair", k: int = 3,
                    coupled: bool = False) -> Engine:
    """`coupled`: deterministic mode's draw, by position-keyed noise (actors/speculation/coupled.py)."""
    target = load(tiny_models[family])
    if draft in ("ngram", "suffix"):
        return Engine(runner(target), None, SpeculationConfig(k=k, method=draft, ngram={"min_n": 1, "max_n": 3}),
                      deterministic=coupled)
    d = runner(load(tiny_draft_models[family])) if draft == "pair" else runner(target, [0, 3])
    return Engine(runner(target), d, SpeculationConfig(k=k), deterministic=coupled)


def test_same_seed_same_output_across_engines_and_batches(tiny_models, tiny_draft_models) -> None:
    prompt = text_prompts(load(tiny_models["llama"]), 1)[0]
    params = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=20, seed=1234)
    outputs = []
    for batch in ([], [7, 8, 9]):  # alone, and among other seeded requests
        engine = sampling_engine(tiny_models, tiny_draft_models)
        others = [SamplingParams(temperature=1.0, max_tokens=20, seed=s) for s in batch]
        outputs.append(generate(engine, [prompt] * (1 + len(batch)), [params, *others]))
        assert engine.target.cache.num_used_blocks == engine.draft.cache.num_used_blocks == 0

    assert outputs[0][0].token_ids == outputs[1][0].token_ids
    assert outputs[0][0].finish_reason == FinishReason.LENGTH and len(outputs[0][0].token_ids) == 20
    different = [c.token_ids for c in outputs[1]]
    assert len({tuple(t) for t in different}) == len(different), "different seeds gave the same 20 tokens"


def test_unseeded_requests_differ(tiny_models, tiny_draft_models) -> None:
    prompt = text_prompts(load(tiny_models["qwen2"]), 1)[0]
    engine = sampling_engine(tiny_models, tiny_draft_models, "qwen2")
    a, b = generate(engine, [prompt, prompt], SamplingParams(temperature=1.0, max_tokens=20))
    assert a.token_ids != b.token_ids


@torch.no_grad()
def target_next_token_probs(model, prompt: list[int]) -> torch.Tensor:
    return torch.softmax(model.hf_model(torch.tensor([prompt])).logits[0, -1].double(), -1)


def bucket(tokens: torch.Tensor, probs: torch.Tensor, n: int, min_expected: float = 20.0):
    """Counts and probabilities of the tokens expected at least `min_expected` times, plus an "other" bucket."""
    top = (probs * n >= min_expected).nonzero().squeeze(-1)
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    observed = torch.cat([counts[top], (counts.sum() - counts[top].sum()).reshape(1)])
    expected = torch.cat([probs[top], (1 - probs[top].sum()).reshape(1)])
    return observed, expected, len(top)


@pytest.mark.heavy
@pytest.mark.parametrize(("draft", "params"), [
    ("layers", SamplingParams(temperature=1.0, max_tokens=2)),
    ("pair", SamplingParams(temperature=0.7, top_k=6, max_tokens=2)),
], ids=["layers-T1", "pair-T0.7-topk6"])
def test_engine_first_token_follows_the_targets_distribution(tiny_models, tiny_draft_models, draft, params) -> None:
    n = 1000
    model = load(tiny_models["llama"])
    prompt = text_prompts(model, 2)[1]
    engine = sampling_engine(tiny_models, tiny_draft_models, "llama", draft, k=1)
    requests = [params.model_copy(update={"seed": seed}) for seed in range(n)]

    completions = generate(engine, [prompt] * n, requests)  # batched max_batch_size (8) at a time

    first = torch.tensor([c.token_ids[0] for c in completions])
    assert sum(c.stats.proposed for c in completions) == n  # every first token went through verification
    logits = torch.log(target_next_token_probs(model, prompt))
    p = brute_force(logits[None], params.temperature, params.top_k, 1.0)[0].double()
    observed, expected, kept = bucket(first, p, n)
    assert kept >= 3
    assert chi_square(observed, expected)[1] > ALPHA
    # power: the draft's own distribution is far enough from the target's that emitting it would be caught
    q = probs_from_logits(engine.draft.forward([SeqChunk("probe", tuple(prompt))]), params)[0].double()
    engine.draft.cache.free("probe")
    observed_q, expected_q, _ = bucket(first, q, n)
    assert chi_square(observed_q, expected_q)[1] < ALPHA


@pytest.mark.heavy
@pytest.mark.parametrize("draft,coupled", [("ngram", False), ("suffix", False), ("ngram", True)],
                         ids=["ngram", "suffix", "ngram, deterministic mode's draw"])
def test_engine_with_a_lookup_draft_samples_the_targets_distribution(tiny_models, tiny_draft_models, draft,
                                                                     coupled) -> None:
    """A prompt `half c half` makes the lookup propose c first, so every first token goes through verification;
    c is picked so that the target accepts it about half the time (both paths of rejection sampling taken)."""
    n = 1000
    model = load(tiny_models["llama"])
    half = text_prompts(model, 2)[1]
    likely = target_next_token_probs(model, half + half).topk(20).indices.tolist()
    c = min(likely, key=lambda c: abs(float(target_next_token_probs(model, [*half, c, *half])[c]) - 0.5))
    prompt = [*half, c, *half]
    params = SamplingParams(temperature=1.0, max_tokens=2)
    engine = sampling_engine(tiny_models, tiny_draft_models, "llama", draft, k=1, coupled=coupled)

    completions = generate(engine, [prompt] * n, [params.model_copy(update={"seed": s}) for s in range(n)])

    assert sum(c.stats.k_history[0] for c in completions) == n  # drafted for every first token
    assert 0 < sum(c.stats.accepted for c in completions) < n
    first = torch.tensor([c.token_ids[0] for c in completions])
    p = target_next_token_probs(model, prompt)
    observed, expected, kept = bucket(first, p, n)
    assert kept >= 3
    assert chi_square(observed, expected)[1] > ALPHA


@pytest.mark.heavy
@pytest.mark.parametrize("coupled", [False, True], ids=["rejection sampling", "deterministic mode's draw"])
def test_engine_first_two_tokens_follow_the_targets_joint_distribution(tiny_models, tiny_draft_models,
                                                                       coupled: bool) -> None:
    """(x0, x1) ~ p(x0) p(x1 | x0), whether x1 came as the bonus of an accepted round or from the next round."""
    n = 1500
    model = load(tiny_models["qwen2"])
    prompt = text_prompts(model, 2)[1]
    engine = sampling_engine(tiny_models, tiny_draft_models, "qwen2", "pair", k=1, coupled=coupled)
    params = [SamplingParams(temperature=1.0, max_tokens=2, ignore_eos=True, seed=10_000 + seed) for seed in range(n)]

    completions = generate(engine, [prompt] * n, params)

    pairs = [tuple(c.token_ids) for c in completions]
    assert all(len(pair) == 2 for pair in pairs)
    accepted = sum(c.stats.accepted for c in completions)
    assert 0.1 * n < accepted < 0.9 * n  # both ways of emitting x1 are well represented
    p0 = target_next_token_probs(model, prompt)
    joint = {}
    for x0 in (p0 * n >= 15).nonzero().squeeze(-1).tolist():
        p1 = target_next_token_probs(model, [*prompt, x0])
        for x1 in (p0[x0] * p1 * n >= 15).nonzero().squeeze(-1).tolist():
            joint[(x0, x1)] = float(p0[x0] * p1[x1])
    assert len(joint) >= 4
    keys = list(joint)
    observed = torch.tensor([sum(pair == key for pair in pairs) for key in keys] + [0], dtype=torch.float64)
    observed[-1] = n - observed[:-1].sum()
    expected = torch.tensor([joint[key] for key in keys] + [1 - sum(joint.values())], dtype=torch.float64)
    assert chi_square(observed, expected)[1] > ALPHA
