"""Which torch device a shard computes on, from the config's `engine.model.device` (auto | cpu | cuda)."""

from __future__ import annotations

import torch


class DeviceError(RuntimeError):
    """The config asks for a device this process does not have."""


def resolve_device(setting: str) -> torch.device:
    """The device for `setting`: "cpu"; "cuda" (the first GPU this process sees: under Ray, the one it was
    assigned, since Ray sets CUDA_VISIBLE_DEVICES per actor); "auto": that GPU if there is one, else the CPU.

    An actor that asked Ray for no GPU sees none (Ray hides them), so "auto" follows the plan's `num_gpus`.
    """
    if setting == "cpu":
        return torch.device("cpu")
    if setting not in ("auto", "cuda"):
        raise ValueError(f"unknown device {setting!r}; expected auto, cpu or cuda")
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    if setting == "cuda":
        raise DeviceError("engine.model.device is cuda, but this process sees no GPU (did its actor ask Ray for one?)")
    return torch.device("cpu")


def device_name(device: torch.device) -> str:
    """A device as calibration keys and benchmarks name it: "cpu", or the GPU's model ("cuda:NVIDIA H200")."""
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


def choose_dtype(asked: str, gpu: bool | None = None, device: str = "auto") -> tuple[str, str]:
    """(dtype, why) for `engine.model.dtype` = `asked` on a fleet that computes on GPUs (`gpu`; None: whether the
    `engine.model.device` setting `device`, or this machine where it is auto, says so) or on this CPU.

    "fp32" / "bf16" stand as configured. "auto" (vLLM's `--dtype auto`, resolved for the hardware): bf16 on a GPU
    that computes in it, and on a CPU where our int4 kernels run (their bf16 path reads the stored 4-bit weights:
    on the AVX2 path measured 2.3x fp32's decoding and 1.7x its prefill, docs/benchmarks.md) or that has bf16
    arithmetic (AVX512-BF16, AMX); fp32 elsewhere, where torch emulates bf16 and dense fp32 runs faster.
    """
    if asked != "auto":
        return asked, "engine.model.dtype"
    if gpu is None:
        gpu = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    if gpu:
        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            return "fp32", "auto: this GPU has no bf16"
        return "bf16", "auto: GPUs compute in bf16"
    from actors.model import cpu_kernels  # here: a CUDA-only caller never builds or probes the CPU kernels

    isa, why = cpu_kernels.choice()
    if isa != "torch":
        return "bf16", f"auto: our {isa} kernels run the weights in bf16 ({why})"
    native = sorted(f for f in cpu_kernels.cpu_flags() if f in ("avx512_bf16", "amx_bf16"))
    if native:
        return "bf16", f"auto: this CPU computes in bf16 ({'+'.join(native)})"
    return "fp32", f"auto: no bf16 kernels here ({why}) and no bf16 arithmetic on this CPU"


def describe_compute(dtype: torch.dtype, device: torch.device) -> str:
    """How a model computes, as `specfleet status` and the start-up line say it: its dtype, its device and, on the
    CPU, which of our kernel builds runs (or torch's ops) and why, e.g. "bf16 on the CPU, our avx2 kernels (auto:
    this CPU has avx2+fma+f16c)"."""
    name = {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype).removeprefix("torch."))
    if device.type != "cpu":
        return f"{name} on {device_name(device)}"
    from actors.model import cpu_kernels  # here: a CUDA-only caller never probes the CPU kernels

    isa, why = cpu_kernels.choice()
    return f"{name} on the CPU, {f'our {isa} kernels' if isa != 'torch' else 'torch ops'} ({why})"
