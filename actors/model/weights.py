"""A layer's linear maps as the runner calls them: fused QKV and gate-up projections, in the chosen weight mode.

Modes (`engine.model.weights`):
- `dequantized`: dense weights in the model's dtype (a GGUF file's blocks expanded by transformers' loader). The
  fused projections are new tensors and the transformers modules' weights become views into them: no copy.
- `stored`: a GGUF file's quantized tensors computed as stored (actors/model/qlinear.py `stored_linear`: int4
  kernel, exact; Q6_K on int8, not exact); tensors the file keeps dense (and every weight of a safetensors
  model) stay dense.
- `int8` / `int4`: dense weights quantized at load, round to nearest (actors/model/quant.py): int8 per output row,
  int4 per group of 32 weights, as gpt-fast does.
Projections are built once per (layer, device, mode) and kept on the LoadedModel, so runners of one model (a
target and its self-speculative draft) share them. MoE experts and routers stay dense in every mode.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from actors.model.gguf_blocks import GroupedInts, concat_rows
from actors.model.layout_cache import LayoutCache
from actors.model.qlinear import (Activations, CpuInt4Linear, Int4Linear, dense_linear, int4_unsupported, int8_linear,
                                   stored_linear)
from actors.model.quant import rtn_int4

WeightMode = Literal["stored", "dequantized", "int8", "int4"]
WEIGHT_MODES: tuple[WeightMode, ...] = ("stored", "dequantized", "int8", "int4")


@dataclass(frozen=True)
class Projections:
    """One decoder layer's linear maps: qkv (H -> (nh + 2 kvh) hd), o, and for a dense MLP gate_up (H -> 2I), down."""

    qkv: nn.Module
    o: nn.Module
    gate_up: nn.Module | None
    down: nn.Module | None


class Concat(nn.Module):
    """Outputs of several linear maps of one input side by side: a fused projection whose parts cannot share one
    kernel call (different formats in a GGUF file)."""

    def __init__(self, parts: Sequence[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


# a weight's source: the transformers module (dense weight and bias) and its name in the checkpoint
@dataclass(frozen=True)
class Part:
    name: str
    module: nn.Linear


def fuse(parts: Sequence[Part], device: torch.device, dtype: torch.dtype, mode: WeightMode,
         stored: Callable[[str], GroupedInts | None], activations: Activations = "int8",
         layout: LayoutCache | None = None) -> nn.Module:
    """One module computing every part's outputs side by side (N = sum of the parts' N); `activations`: how our
    CPU int4 kernel, where it runs, takes the input (actors/model/qlinear.py); `layout`: the stored weights packed
    by an earlier start, read from and added to (actors/model/layout_cache.py)."""
    bias = _bias(parts, device, dtype)
    if mode in ("int8", "int4"):  # quantized at load: int4 where its kernel takes the shape, else int8
        dense = torch.cat([p.module.weight for p in parts])  # (N, K)
        codes = rtn_int4(dense) if mode == "int4" else None
        if codes is not None and int4_unsupported(codes, device, dtype) is None:
            return Int4Linear(codes, bias, device, dtype, activations=activations)
        return int8_linear(dense, bias, device, dtype, activations)
    layout = layout if mode == "stored" and device.type == "cpu" else None
    key = "+".join(p.name for p in parts)
    if layout is not None and (kept := _from_layout(layout.get(key), bias, dtype, activations)) is not None:
        return kept  # packed by an earlier start (actors/model/layout_cache.py)
    groups = [stored(p.name) for p in parts] if mode == "stored" else [None] * len(parts)
    runs: list[list[tuple[Part, GroupedInts | None]]] = []  # parts that stack into one matrix: one kernel call
    for p, g in zip(parts, groups):
        if runs and _stackable(runs[-1][-1][1], g):
            runs[-1].append((p, g))
        else:
            runs.append([(p, g)])
    modules, start = [], 0
    for run in runs:
        n = sum(p.module.out_features for p, _ in run)
        b = None if bias is None else bias[start:start + n]
        start += n
        if run[0][1] is None:
            modules.append(_dense([p for p, _ in run], b, device, dtype))
        else:
            modules.append(stored_linear(concat_rows([g for _, g in run]), b, device, dtype,  # type: ignore[misc]
                                         activations))
    if layout is not None and all(isinstance(m, CpuInt4Linear) for m in modules):
        layout.keep(key, [m.packed() for m in modules])  # the next start maps them instead of packing again
    return modules[0] if len(modules) == 1 else Concat(modules)


def _from_layout(packed: list[dict] | None, bias: torch.Tensor | None, dtype: torch.dtype,
                 activations: Activations) -> nn.Module | None:
    """A fused projection rebuilt from its packed modules (each over its rows of `bias`); None if there are none, or
    if our kernel does not run here now."""
    if packed is None:
        return None
    modules, start = [], 0
    for p in packed:
        n = p["out_features"]
        m = CpuInt4Linear.from_packed(p, None if bias is None else bias[start:start + n], dtype, activations)
        if m is None:
            return None
        modules.append(m)
        start += n
    return modules[0] if len(modules) == 1 else Concat(modules)


def _stackable(a: GroupedInts | None, b: GroupedInts | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.group == b.group and (a.bits <= 4) == (b.bits <= 4)


def _bias(parts: Sequence[Part], device: torch.device, dtype: torch.dtype) -> torch.Tensor | None:
    """The fused bias (zeros for parts without one), or None if no part has a bias."""
    if all(p.module.bias is None for p in parts):
        return None
    return torch.cat([p.module.bias if p.module.bias is not None else torch.zeros(p.module.out_features)
                      for p in parts]).to(device, dtype)


def _dense(parts: Sequence[Part], bias: torch.Tensor | None, device: torch.device, dtype: torch.dtype) -> nn.Linear:
    """A dense fused linear; each part's transformers module then holds a view of its rows (no second copy)."""
    if len(parts) == 1:
        m = parts[0].module
        if m.weight.device != device or m.weight.dtype != dtype:
            m.to(device, dtype)
        return m
    weight = torch.cat([p.module.weight.detach() for p in parts]).to(device, dtype)  # (sum N, K)
    start = 0
    for p in parts:
        n = p.module.out_features
        p.module.weight = nn.Parameter(weight[start:start + n], requires_grad=False)
        if p.module.bias is not None and bias is not None:
            p.module.bias = nn.Parameter(bias[start:start + n], requires_grad=False)
        start += n
    return dense_linear(weight, bias)


def layer_projections(model, index: int, device: torch.device, mode: WeightMode,
                      activations: Activations) -> Projections:
    """Layer `index`'s projections of a LoadedModel on `device` in `mode`, built on first use and then shared."""
    key = ("layer", index, str(device), mode, activations)
    if key not in model.prepared:
        hf = model.hf_model.model.layers[index]
        prefix = f"model.layers.{index}."
        stored = _stored_lookup(model)

        def parts(owner: nn.Module, names: Sequence[str], where: str) -> list[Part]:
            return [Part(f"{prefix}{where}.{n}", getattr(owner, n)) for n in names]

        a, mlp = hf.self_attn, hf.mlp
        fused = (lambda ps: fuse(ps, device, model.dtype, mode, stored, activations, _layout(model)))
        dense_mlp = not hasattr(mlp, "experts")
        model.prepared[key] = Projections(
            qkv=fused(parts(a, ("q_proj", "k_proj", "v_proj"), "self_attn")),
            o=fused(parts(a, ("o_proj",), "self_attn")),
            gate_up=fused(parts(mlp, ("gate_proj", "up_proj"), "mlp")) if dense_mlp else None,
            down=fused(parts(mlp, ("down_proj",), "mlp")) if dense_mlp else None,
        )
    return model.prepared[key]


def head_projection(model, device: torch.device, mode: WeightMode, activations: Activations) -> nn.Module:
    """The LM head (H -> V) of a LoadedModel on `device` in `mode`, built on first use and then shared."""
    key = ("head", str(device), mode, activations)
    if key not in model.prepared:
        head = model.hf_model.lm_head
        if mode == "dequantized" or (mode == "stored" and model.stored is None):
            head.to(device)  # a tied head moves with the embedding it shares
            model.prepared[key] = head
        else:
            model.prepared[key] = fuse([Part("lm_head", head)], device, model.dtype, mode, _stored_lookup(model),
                                       activations, _layout(model))
    return model.prepared[key]


def _stored_lookup(model) -> Callable[[str], GroupedInts | None]:
    """name -> the GGUF file's quantized matrix (None without a file, or where it holds the tensor dense)."""
    stored = model.stored
    return (lambda name: None) if stored is None else stored.get


def _layout(model) -> LayoutCache | None:
    """The GGUF file's packed weights kept between starts (None without a file)."""
    return None if model.stored is None else model.stored.layout
