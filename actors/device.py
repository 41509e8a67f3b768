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
