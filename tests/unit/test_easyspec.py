"""EasySpec layer-parallel drafting: lossless output, bonus calibration's exact KV, and group size 1 as sequential."""

from __future__ import annotations

import pytest
import torch

from actors.engine.core import Engine
from actors.model.metadata import SeqChunk
from actors.engine.offline import generate
from actors.speculation import easyspec
from actors.speculation.easyspec import layer_groups
from cluster.config import DraftParallelConfig, SchedulerConfig, SpeculationConfig
from cluster.request import Request, SamplingParams
from tests.unit.helpers import drain, load, reference_greedy, runner, text_prompts
from tests.unit.test_lossless import NEW_TOKENS, PROMPT_OFFSET, assert_all_blocks_free

GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)


def test_layer_groups_keep_head_and_tail_in_order() -> None:
    assert layer_groups(8, 2, 2, 2) == [(0,), (1,), (2, 3), (4, 5), (6,), (7,)]
    assert layer_groups(8, 3, 1, 1) == [(0,), (1, 2, 3), (4, 5, 6), (7,)]
    assert layer_groups(4, 2, 0, 0) == [(0, 1), (2, 3)]
    assert layer_groups(4, 3, 0, 0) == [(0, 1, 2), (3,)]
    assert layer_groups(4, 2, 3, 3) == [(0,), (1,), (2,), (3,)]  # head and tail cover everything
    assert layer_groups(5, 1, 1, 1) == [(i,) for i in range(5)]
    assert [i for g in layer_groups(24, 4, 2, 2) for i in g] == list(range(24))
    with pytest.raises(ValueError):
        layer_groups(4, 0, 1, 1)


def draft_runner(tiny_models, tiny_draft_models, draft: str, cfg: DraftParallelConfig | None = None):
    """The perturbed copy of the tiny llama ("pair"), or the target's own layers [0, 3] ("layers"), with `cfg`'s groups."""
    target = load(tiny_models["llama"])
    r = runner(load(tiny_draft_models["llama"])) if draft == "pair" else runner(target, [0, 1, 2, 3])
    if cfg is not None:
        easyspec.enable(r, cfg)
    return r


def make_engine(tiny_models, tiny_draft_models, draft: str, cfg: DraftParallelConfig, k: int = 3,
                batch: int = 8) -> Engine:
    speculation = SpeculationConfig(policy="fixed", k=k, draft_parallel=cfg)
    return Engine(runner(load(tiny_models["llama"])), draft_runner(tiny_models, tiny_draft_models, draft, cfg),
                  speculation, SchedulerConfig(max_batch_size=batch))


SETTINGS = [(g, m, d) for g in (2, 3) for m in ("attention", "layer") for d in ("pair", "layers")]


@pytest.mark.parametrize("batch_size", [1, 4])
@pytest.mark.parametrize(("group", "mode", "draft"), SETTINGS, ids=[f"g{g}-{m}-{d}" for g, m, d in SETTINGS])
def test_layer_parallel_drafting_is_lossless(tiny_models, tiny_draft_models, group, mode, draft, batch_size) -> None:
    cfg = DraftParallelConfig(group_size=group, sequential_head=0, sequential_tail=0, mode=mode)
    engine = make_engine(tiny_models, tiny_draft_models, draft, cfg)
    prompts = text_prompts(engine.target.model, batch_size, offset=PROMPT_OFFSET[batch_size])

    completions = generate(engine, prompts, GREEDY)

    for prompt, c in zip(prompts, completions):
        assert c.token_ids == reference_greedy(tiny_models["llama"], prompt, NEW_TOKENS)
    assert_all_blocks_free(engine)
    stats = engine.stats()
    assert len(stats.spec.acceptance_by_position) == 3 and stats.spec.draft_s_per_token > 0


def test_a_parallel_forward_approximates_and_a_sequential_one_is_exact(tiny_models, tiny_draft_models) -> None:
    """The groups change the draft's logits (the approximation is real); parallel=False is the plain forward."""
    plain = draft_runner(tiny_models, tiny_draft_models, "pair")
    grouped = draft_runner(tiny_models, tiny_draft_models, "pair", DraftParallelConfig(group_size=2,
                                                                                        sequential_head=0,
                                                                                        sequential_tail=0))
    prompt = tuple(text_prompts(plain.model, 1)[0])
    want = plain.forward([SeqChunk("a", prompt)])
    assert torch.equal(grouped.forward([SeqChunk("a", prompt)], parallel=False), want)
    assert not torch.allclose(grouped.forward([SeqChunk("b", prompt)], parallel=True), want, atol=1e-3)


def test_group_size_one_is_the_sequential_draft(tiny_models, tiny_draft_models) -> None:
    """A schedule of groups of one, run in parallel mode, writes the same KV and logits as the plain runner."""
    plain = draft_runner(tiny_models, tiny_draft_models, "pair")
    single = draft_runner(tiny_models, tiny_draft_models, "pair")
    single.layer_parallel = easyspec.LayerParallel(len(single.layers), 1, 0, 0, "attention")
    prompt = tuple(text_prompts(plain.model, 1)[0])
    for r in (plain, single):
        r.forward([SeqChunk("a", prompt[:-3])], parallel=True)
    for token in prompt[-3:]:  # decode steps, one token each
        assert torch.equal(single.forward([SeqChunk("a", (token,))], parallel=True),
                           plain.forward([SeqChunk("a", (token,))]))
    a, b = plain.cache.export("a", 0, len(prompt)), single.cache.export("a", 0, len(prompt))
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def sequential_kv(engine: Engine, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V (L, T, kvh, hd) that a plain, sequential forward of the draft writes for `tokens`."""
    fresh = runner(engine.draft.model, engine.draft.layer_ids)
    fresh.forward([SeqChunk("ref", tuple(tokens), 0)])
    e = fresh.cache.export("ref", 0, len(tokens))
    return e.k, e.v


@pytest.mark.parametrize("mode", ["attention", "layer"])
def test_bonus_calibration_leaves_only_exact_kv(tiny_models, tiny_draft_models, mode) -> None:
    """After every round each draft layer's KV equals a sequential forward's over the same tokens; with calibration
    off the accepted drafts keep the KV the parallel forwards wrote, which differs."""
    found = {}
    for calibrate in (True, False):
        cfg = DraftParallelConfig(group_size=2, sequential_head=0, sequential_tail=0, mode=mode, calibrate=calibrate)
        engine = make_engine(tiny_models, tiny_draft_models, "layers", cfg, k=4)
        for i, prompt in enumerate(text_prompts(engine.target.model, 3, offset=4)):
            engine.add_request(Request(f"r{i}", tuple(prompt), GREEDY))
        worst = 0.0

        def check(e: Engine) -> None:
            nonlocal worst
            for seq in e.running:
                n = e.draft.cache.length(seq.request_id) if e.draft.cache.has(seq.request_id) else 0
                if n == 0:
                    continue
                got = e.draft.cache.export(seq.request_id, 0, n)
                k, v = sequential_kv(e, seq.token_ids[:n])
                worst = max(worst, (got.k - k).abs().max().item(), (got.v - v).abs().max().item())

        drain(engine, check=check)
        found[calibrate] = (worst, engine.stats())
    (exact, calibrated), (fuzzy, uncalibrated) = found[True], found[False]
    assert exact < 1e-5, f"calibrated draft KV differs from a sequential forward's by {exact}"
    assert fuzzy > 1e-3, "without calibration the accepted drafts' KV should be the parallel forwards' approximation"
    assert calibrated.spec.calibration_tokens > 0 and calibrated.spec.calibration_s > 0
    assert uncalibrated.spec.calibration_tokens == 0
