"""`engine.model.dtype: auto`: chosen for the hardware (actors/model/device.py choose_dtype) where the app is resolved."""

from __future__ import annotations

import logging

import pytest

from actors.model.device import choose_dtype
from actors.model import cpu_kernels
from cluster.config import EngineConfig, ModelConfig
from deploy.serve.fleet import resolved

AVX512 = {"avx2", "fma", "f16c", "avx512_bf16", "avx512_vnni"}


@pytest.fixture
def cpu(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - a function
    """Stands for another CPU by its /proc/cpuinfo flags and an ISA setting, and lets cpu_kernels choose again."""
    def set_cpu(flags: set[str], isa: str = "auto") -> None:
        monkeypatch.delenv("SPECFLEET_CPU_KERNELS", raising=False)
        monkeypatch.setenv("SPECFLEET_CPU_ISA", isa)
        monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda f=frozenset(flags): f)
        cpu_kernels.reset()

    yield set_cpu
    cpu_kernels.reset()


def test_a_configured_dtype_stands_on_any_hardware(cpu) -> None:
    cpu(set(), "torch")
    assert choose_dtype("bf16", gpu=False) == ("bf16", "engine.model.dtype")
    assert choose_dtype("fp32", gpu=True) == ("fp32", "engine.model.dtype")


def test_auto_takes_bf16_where_our_kernels_or_bf16_arithmetic_run_and_fp32_elsewhere(cpu) -> None:
    cpu(AVX512)
    assert choose_dtype("auto", gpu=False) == ("bf16", "auto: our avx512 kernels run the weights in bf16 "
                                                       "(auto: this CPU has avx512_bf16+avx512_vnni)")
    cpu({"avx2", "fma", "f16c"})  # an AVX2-only CPU (AMD Zen 2/3): our avx2 kernels
    dtype, why = choose_dtype("auto", gpu=False)
    assert (dtype, why.split(" (")[0]) == ("bf16", "auto: our avx2 kernels run the weights in bf16")
    cpu({"avx2", "fma", "f16c"}, "torch")  # the same CPU without our kernels: torch emulates bf16 there
    assert choose_dtype("auto", gpu=False) == (
        "fp32", "auto: no bf16 kernels here (SPECFLEET_CPU_ISA=torch) and no bf16 arithmetic on this CPU")
    cpu(AVX512 | {"amx_bf16"}, "torch")  # bf16 in hardware: torch's own bf16 kernels are not emulated
    assert choose_dtype("auto", gpu=False) == ("bf16", "auto: this CPU computes in bf16 (amx_bf16+avx512_bf16)")


def test_a_gpu_fleet_computes_in_bf16() -> None:
    assert choose_dtype("auto", gpu=True)[0] == "bf16"


def test_the_resolved_engine_names_the_chosen_dtype_and_logs_why(cpu, tiny_models, caplog) -> None:
    folder = str(tiny_models["llama"])
    cpu({"avx2", "fma", "f16c"}, "torch")
    engine = EngineConfig(model=ModelConfig(target=folder, dtype="auto", device="cpu"))
    with caplog.at_level(logging.INFO, logger="deploy.serve.fleet"):
        m = resolved(engine).model
    assert (m.dtype, m.target) == ("fp32", folder)
    assert [r.getMessage() for r in caplog.records] == [
        "dtype fp32 (auto: no bf16 kernels here (SPECFLEET_CPU_ISA=torch) and no bf16 arithmetic on this CPU)"]
    cpu(AVX512)
    assert resolved(engine).model.dtype == "bf16"
    assert resolved(engine.model_copy(update={"model": engine.model.model_copy(update={"dtype": "fp32"})})
                    ).model.dtype == "fp32"


def test_the_compute_line_names_dtype_device_and_kernels(cpu) -> None:
    """What `specfleet status` prints after an instance's path (actors/serving/server.py InstanceInfo.backend)."""
    import torch

    from actors.model.device import describe_compute

    cpu({"avx2", "fma", "f16c"})
    assert describe_compute(torch.bfloat16, torch.device("cpu")) == \
        "bf16 on the CPU, our avx2 kernels (auto: this CPU has avx2+fma+f16c)"
    cpu(set(), "torch")
    assert describe_compute(torch.float32, torch.device("cpu")) == "fp32 on the CPU, torch ops (SPECFLEET_CPU_ISA=torch)"
