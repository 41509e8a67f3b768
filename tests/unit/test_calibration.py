"""A goodput engine's saved calibration: a second start of the same setup reads it and times nothing; another
setup, or a damaged file, is timed again (and the file rewritten), never loaded."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from actors.engine.core import Engine
from actors.model import cpu_kernels
from actors.model.runner import ModelRunner
from actors.speculation import calibration
from actors.speculation.calibration import SIZES, CalibrationFile, setup_of
from cluster.config import CacheConfig, EngineConfig, ModelConfig, SpeculationConfig
from tests.unit.helpers import load, runner

CACHE = CacheConfig(block_size=4, num_blocks=256)


def _config(model: Path, method: str = "ngram", dtype: str = "fp32", draft: Path | None = None) -> EngineConfig:
    return EngineConfig(model=ModelConfig(target=str(model), draft=str(draft) if draft else None, dtype=dtype,
                                          device="cpu"),
                        speculation=SpeculationConfig(policy="goodput", method=method, k=3), cache=CACHE)


class ForwardCount:
    """Counts ModelRunner.forward calls (the real forwards still run)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        real = ModelRunner.forward

        def counted(runner, *args, **kwargs):
            self.calls += 1
            return real(runner, *args, **kwargs)

        monkeypatch.setattr(ModelRunner, "forward", counted)


def _weights(engine: Engine) -> dict:
    return engine.cost_model.as_dict()


def test_a_second_start_reads_the_saved_calibration_and_runs_no_forward(tiny_models, tiny_draft_models, tmp_path,
                                                                        monkeypatch) -> None:
    cfg = _config(tiny_models["llama"], method="model", draft=tiny_draft_models["llama"])
    forwards = ForwardCount(monkeypatch)
    first = Engine.from_config(cfg, calibration_dir=tmp_path)
    timed = forwards.calls
    assert timed >= 2 * len(SIZES)  # target and draft, every size at least once
    [saved] = tmp_path.glob("*.json")
    assert {p["phase"] for p in json.loads(saved.read_text())["points"]} == {"target", "draft"}

    second = Engine.from_config(cfg, calibration_dir=tmp_path)

    assert forwards.calls == timed  # nothing timed again
    assert _weights(second) == _weights(first)
    assert second.cost_model.fitted


def test_another_setup_is_timed_again_under_its_own_file(tiny_models, tmp_path, monkeypatch) -> None:
    forwards = ForwardCount(monkeypatch)
    Engine.from_config(_config(tiny_models["llama"]), calibration_dir=tmp_path)
    after_first = forwards.calls

    Engine.from_config(_config(tiny_models["llama"], dtype="bf16"), calibration_dir=tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        Engine.from_config(_config(tiny_models["llama"]), calibration_dir=tmp_path)
    finally:
        torch.set_num_threads(threads)

    assert forwards.calls == 3 * after_first  # each new setup timed its forwards
    assert len(list(tmp_path.glob("*.json"))) == 3


@pytest.mark.parametrize("damage", ["truncated", "other setup", "negative time", "unknown phase", "no points"])
def test_a_damaged_calibration_file_is_timed_again_and_rewritten(tiny_models, tmp_path, monkeypatch,
                                                                 damage: str) -> None:
    cfg = _config(tiny_models["llama"])
    Engine.from_config(cfg, calibration_dir=tmp_path)
    [path] = tmp_path.glob("*.json")
    good = json.loads(path.read_text())
    bad = json.loads(path.read_text())
    if damage == "truncated":
        path.write_text(path.read_text()[:200])
    else:
        if damage == "other setup":
            bad["setup"]["dtype"] = "bf16"
        elif damage == "negative time":
            bad["points"][0]["seconds"] = -1.0
        elif damage == "unknown phase":
            bad["points"][0]["phase"] = "verify"
        else:
            bad["points"] = []
        path.write_text(json.dumps(bad))
    assert CalibrationFile(tmp_path, setup_of(cfg, torch.device("cpu"))).load() is None
    forwards = ForwardCount(monkeypatch)

    Engine.from_config(cfg, calibration_dir=tmp_path)

    assert forwards.calls >= len(SIZES)  # timed again
    rewritten = json.loads(path.read_text())
    assert rewritten["setup"] == good["setup"] and len(rewritten["points"]) == len(good["points"])
    assert CalibrationFile(tmp_path, setup_of(cfg, torch.device("cpu"))).load() is not None


def test_other_kernels_are_timed_again_under_their_own_file(tiny_models, tmp_path, monkeypatch) -> None:
    """A change to our CPU kernels (their sources' digest), or torch's ops in their place, changes the forward times
    as another CPU would: a calibration saved with other kernels is not reused."""
    cfg = _config(tiny_models["llama"])
    monkeypatch.setenv("SPECFLEET_CPU_KERNELS", "torch")
    assert setup_of(cfg, torch.device("cpu"))["kernels"] == "torch"
    Engine.from_config(cfg, calibration_dir=tmp_path)
    monkeypatch.delenv("SPECFLEET_CPU_KERNELS")
    monkeypatch.setattr(cpu_kernels, "identity", lambda: "0123456789ab")  # as after an edit of int4_cpu.cpp
    forwards = ForwardCount(monkeypatch)

    Engine.from_config(cfg, calibration_dir=tmp_path)

    assert forwards.calls >= len(SIZES)  # timed again
    assert {json.loads(p.read_text())["setup"]["kernels"] for p in tmp_path.glob("*.json")} == {"torch",
                                                                                                 "0123456789ab"}


def test_an_engine_without_a_calibration_folder_times_every_start(tiny_models, monkeypatch) -> None:
    forwards = ForwardCount(monkeypatch)
    Engine.from_config(_config(tiny_models["llama"]))
    once = forwards.calls
    Engine.from_config(_config(tiny_models["llama"]))
    assert once >= len(SIZES) and forwards.calls == 2 * once


def test_a_served_instance_times_its_calibration_after_it_takes_requests(tiny_models, tmp_path, monkeypatch) -> None:
    """Off the critical path: an instance with a calibration folder and nothing saved starts without a forward, takes
    a request at once (its output the target's own greedy output), times its calibration while idle, saves it, and
    the next start reads it back and times nothing."""
    from actors.serving.build import local_instance
    from actors.engine.offline import generate
    from actors.serving.loop import ServingLoop
    from cluster.request import Request, SamplingParams
    from tests.unit.helpers import load, text_prompts
    from tests.unit.test_serving import Collector

    cfg = _config(tiny_models["llama"])
    forwards = ForwardCount(monkeypatch)
    inst = local_instance(cfg, calibration_dir=tmp_path)
    assert forwards.calls == 0 and inst.engine.pending_calibration is not None
    assert not inst.engine.cost_model.fitted and not list(tmp_path.glob("*.json"))

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = text_prompts(load(tiny_models["llama"]), 1, offset=2)[0]
    plain = cfg.model_copy(update={"speculation": SpeculationConfig(policy="off")})
    [expected] = generate(local_instance(plain).engine, [prompt], params)
    loop, got = ServingLoop(inst, idle=inst.idle_work), Collector()
    try:
        loop.submit(Request("r0", tuple(prompt), params), got.sink("r0")).result(timeout=60)
        items = got.wait("r0")
        assert [t for i in items for t in i.delta.token_ids] == list(expected.token_ids)
        deadline = time.monotonic() + 120
        while inst.engine.pending_calibration is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert inst.engine.pending_calibration is None, "the calibration was not finished while idle"
    finally:
        loop.close()
    [saved] = tmp_path.glob("*.json")
    assert {p["phase"] for p in json.loads(saved.read_text())["points"]} == {"target"}
    assert inst.engine.cost_model.fitted

    calls = forwards.calls
    again = local_instance(cfg, calibration_dir=tmp_path)
    assert forwards.calls == calls and again.engine.pending_calibration is None  # read back, nothing timed
    assert again.engine.cost_model.fitted


def test_each_timed_forward_follows_an_untimed_one_of_its_size(tiny_models, monkeypatch) -> None:
    """The first forward after a longer one is a transient that steady steps do not pay (docs/scheduler.md): each
    size is timed on its second forward, its context (and the attention recorded) taking in the first."""
    sizes = [(1, 32), (8, 0)]
    monkeypatch.setattr(calibration, "SIZES", tuple(sizes))
    fed: list[int] = []
    real = ModelRunner.forward

    def recorded(model_runner, chunks, *args, **kwargs):
        fed.append(sum(len(c.token_ids) for c in chunks))
        return real(model_runner, chunks, *args, **kwargs)

    monkeypatch.setattr(ModelRunner, "forward", recorded)
    points = calibration.time_forwards([("target", runner(load(tiny_models["llama"])))], max_model_len=64)

    assert fed == [32, 1, 1, 8, 8] * calibration.REPEATS  # context, then the size twice: the second one is timed
    assert [(p.tokens, p.attention) for p in points] == [(1, 1 * 34 / 1024), (8, 8 * 16 / 1024)] * calibration.REPEATS
