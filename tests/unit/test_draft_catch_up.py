"""The draft follows a request only while it drafts: k = 0 costs the draft no forward, and the lazy catch-up after
a pause leaves the draft's KV as a continuous run leaves it."""

from __future__ import annotations

import pytest
import torch

from actors.engine.core import Engine
from actors.engine.offline import generate
from actors.speculation.cost_model import StepCostModel
from actors.speculation.policy import BatchBase, Candidate
from cluster.config import SchedulerConfig, SpeculationConfig
from cluster.request import Request, SamplingParams
from tests.unit.helpers import load, reference_greedy, runner, text_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
# the draft costs more per forward than the target: drafting never pays
COSTLY_DRAFT = StepCostModel.from_weights(target=[0.020, 0.0001, 0.0], draft=[0.050, 0.001, 0.0])
CHEAP_DRAFT = StepCostModel.from_weights(target=[0.020, 0.0001, 0.0], draft=[0.001, 0.00001, 0.0])


class Scripted:
    """A policy giving k = 0 in the steps of `pause` and k otherwise (the engine's k choice, scripted)."""

    name = "scripted"

    def __init__(self, k: int, pause: range) -> None:
        self.k, self.pause, self.calls = k, pause, 0

    def allows(self, batch: int) -> bool:
        return True

    def observe_step(self, batch: int, drafted: bool, tokens: int, seconds: float) -> None:
        pass

    def declined(self, batch: int) -> None:
        pass

    def choose(self, cands: list[Candidate], base: BatchBase, budget: int) -> list[int]:
        step, self.calls = self.calls, self.calls + 1
        return [0 if step in self.pause else min(self.k, c.max_k) for c in cands]


def engine_with(tiny_models, tiny_draft_models, policy: str = "fixed", cost: StepCostModel | None = None,
                prior: float = 0.7) -> Engine:
    target = load(tiny_models["llama"])
    return Engine(runner(target), runner(load(tiny_draft_models["llama"])),
                  SpeculationConfig(policy=policy, k=3, prior_acceptance=prior), cost_model=cost)


@pytest.mark.parametrize("prior", [0.0, 0.9])
def test_when_drafting_does_not_pay_the_draft_runs_no_forward(tiny_models, tiny_draft_models, prior) -> None:
    engine = engine_with(tiny_models, tiny_draft_models, "goodput", COSTLY_DRAFT, prior)
    prompts = text_prompts(engine.target.model, 4)
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", tuple(p), GREEDY))
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for d in engine.step():
            outputs.setdefault(d.request_id, []).extend(d.token_ids)
        assert engine.draft.cache.num_used_blocks == 0  # not a token of any request went through the draft
    for i, p in enumerate(prompts):
        assert outputs[f"r{i}"] == reference_greedy(tiny_models["llama"], p, 24)
    assert engine.stats().spec.mean_k == 0


def test_when_drafting_pays_the_same_engine_drafts(tiny_models, tiny_draft_models) -> None:
    """The control of the test above: the same requests with a cheap draft do go through the draft."""
    engine = engine_with(tiny_models, tiny_draft_models, "goodput", CHEAP_DRAFT, 0.9)
    [c] = generate(engine, [text_prompts(engine.target.model, 1)[0]], GREEDY)
    assert c.stats.proposed > 0


def draft_kv(engine: Engine, rid: str) -> tuple[torch.Tensor, torch.Tensor]:
    e = engine.draft.cache.export(rid)
    return e.k, e.v  # (L, tokens, kv_heads, head_dim) each


@pytest.mark.parametrize("pause", [range(0, 6), range(3, 9)], ids=["from-the-prompt", "mid-decode"])
def test_catch_up_after_a_pause_leaves_the_draft_kv_of_a_continuous_run(tiny_models, tiny_draft_models, pause) -> None:
    prompt = text_prompts(load(tiny_models["llama"]), 1)[0]
    continuous = engine_with(tiny_models, tiny_draft_models)
    paused = engine_with(tiny_models, tiny_draft_models)
    paused.policy = Scripted(3, pause)
    for e in (continuous, paused):
        e.add_request(Request("r", tuple(prompt), GREEDY))

    seen: list[tuple[torch.Tensor, torch.Tensor]] = []  # the continuous run's draft KV after every step
    tokens_c: list[int] = []
    while continuous.has_unfinished():
        tokens_c += [t for d in continuous.step() for t in d.token_ids]
        if continuous.draft.cache.has("r"):
            seen.append(draft_kv(continuous, "r"))

    tokens_p: list[int] = []
    lengths = []
    for step in range(pause.stop + 1):
        tokens_p += [t for d in paused.step() for t in d.token_ids]
        lengths.append(paused.draft.cache.length("r") if paused.draft.cache.has("r") else 0)
        if step in pause:  # no forward for the request: its draft KV does not move
            assert lengths[-1] == (lengths[-2] if step > 0 else 0)
    assert lengths[-1] > lengths[-2]  # the resumed round caught up
    k, v = draft_kv(paused, "r")
    n = k.shape[1]
    ref = next(kv for kv in seen if kv[0].shape[1] >= n)  # the continuous run's KV once it held as many tokens
    assert torch.allclose(k, ref[0][:, :n], atol=1e-5, rtol=1e-4)
    assert torch.allclose(v, ref[1][:, :n], atol=1e-5, rtol=1e-4)
    while paused.has_unfinished():
        tokens_p += [t for d in paused.step() for t in d.token_ids]
    assert tokens_p == tokens_c == reference_greedy(tiny_models["llama"], prompt, 24)


def test_a_batch_still_filling_from_its_queue_does_not_catch_its_draft_up(tiny_models, tiny_draft_models) -> None:
    """Requests admitted a few at a time (a small token budget) into a batch of 8 that drafting does not pay at, a
    request alone drafts: while others wait, the policy's steady state is the batch they fill, so no request catches
    its draft up on a prompt for the few rounds before the batch is full (the Qwen pair at batch 8 did, in its first
    steps: 2 of its 27 s). Once the queue is empty and the batch thins out, drafting may pay again."""
    convex_at_8 = [0.0] * 17
    convex_at_8[:2], convex_at_8[3 + 7 + 2] = [0.020, 0.0], 0.004  # 20 ms a forward, 4 ms a token beyond 8
    cost = StepCostModel.from_weights(target=convex_at_8, draft=[0.002, 0.001, 0.0])
    target = load(tiny_models["llama"])
    engine = Engine(runner(target), runner(load(tiny_draft_models["llama"])),
                    SpeculationConfig(policy="goodput", k=4, prior_acceptance=0.8),
                    SchedulerConfig(max_batch_size=8, max_num_batched_tokens=16), cost_model=cost)
    prompts = text_prompts(target, 12)
    for i, p in enumerate(prompts):
        engine.add_request(Request(f"r{i}", tuple(p), GREEDY))
    filling, outputs = 0, {}
    while engine.has_unfinished():
        waited = bool(engine.waiting)
        for d in engine.step():
            outputs.setdefault(d.request_id, []).extend(d.token_ids)
        if waited:
            filling += 1
            assert engine.draft.cache.num_used_blocks == 0, f"step {filling}: the draft caught up while others waited"
    assert filling >= 4  # the queue did take several steps to drain
    for i, p in enumerate(prompts):
        assert outputs[f"r{i}"] == reference_greedy(tiny_models["llama"], p, 24)
