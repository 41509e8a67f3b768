"""An instance start timed phase by phase (actors/start_phases.py): nested phases are not counted twice, a phase
outside a recorded start costs nothing, and a real start reports its weights, layout and calibration."""

from __future__ import annotations

import time
from pathlib import Path

from actors.serving.build import local_instance
from actors.start_phases import StartClock, phase
from cluster.config import CacheConfig, EngineConfig, ModelConfig, SpeculationConfig


def test_nested_phases_add_up_to_the_wall_time_without_counting_twice() -> None:
    with StartClock().current() as clock:
        with phase("layout"):
            time.sleep(0.05)
            with phase("kernels"):
                time.sleep(0.4)
        with phase("layout"):  # a second model's: adds up
            time.sleep(0.05)
    got = clock.result()
    assert [n for n, _ in got.phases] == ["kernels", "layout"]
    assert got.seconds("kernels") >= 0.4
    # the kernels' 0.4 s inside it counted once, as kernels (twice, layout would be 0.5 s); the margin is for a
    # loaded host's late wake-ups
    assert 0.1 <= got.seconds("layout") < 0.4
    assert abs(sum(s for _, s in got.phases) + got.other_s - got.total_s) < 0.01
    with phase("weights"):  # no start recorded here: nothing to record it in
        pass
    assert clock.result().seconds("weights") == 0.0
    spawned = got.with_phase("process", 1.5, first=True)
    assert spawned.phases[0] == ("process", 1.5) and abs(spawned.total_s - got.total_s - 1.5) < 1e-6


def test_a_start_reports_its_phases(tiny_gguf: Path, tmp_path: Path) -> None:
    cfg = EngineConfig(model=ModelConfig(target=str(tiny_gguf), dtype="bf16", weights="stored"),
                       speculation=SpeculationConfig(method="ngram", policy="goodput", k=2),
                       cache=CacheConfig(block_size=4, num_blocks=64))
    with StartClock().current() as clock:
        local_instance(cfg)  # no calibration folder: timed now, during the start
    got = clock.result()
    for name in ("tokenizer", "weights", "layout", "calibration"):
        assert got.seconds(name) > 0, (name, got)
    # each figure is rounded to the millisecond, so each may be off by half of one (CI saw 0.305 against 0.304)
    assert sum(s for _, s in got.phases) <= got.total_s + 0.0005 * (len(got.phases) + 1) + 1e-9

    with StartClock().current() as clock:
        local_instance(cfg, calibration_dir=tmp_path)  # with one: the calibration waits until it serves
    assert clock.result().seconds("calibration") < got.seconds("calibration")
