"""Loading a config's model pair into runners in this process: the target's stages and the draft (quantized and
split into EasySpec groups as the config asks)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from actors.model.device import resolve_device
from actors.model.loader import load_model
from actors.model.quant import quantize_runner
from actors.model.runner import ModelRunner
from actors.speculation import easyspec
from actors.start_phases import phase
from cluster.config import ConfigError, EngineConfig


def load_runners(cfg: EngineConfig, stages: Sequence[tuple[int, int]] | None = None,
                 device: torch.device | str | None = None) -> tuple[list[ModelRunner], ModelRunner | None]:
    """Load `cfg`'s model pair in this process onto `device` (default: the config's `model.device`, resolved
    here): one runner per target stage (layer ranges [start, end); None: one stage of every layer) and the
    draft's runner (None when speculation is off or there is no draft).

    A self-speculative draft (`draft_layers`) shares the target's weights; a draft re-quantized at load
    (`draft_quantization`) is quantized here.
    """
    m = cfg.model
    device = resolve_device(m.device) if device is None else torch.device(device)
    target_model = load_model(m.target, m.dtype, device, m.weights, m.activations, m.backend)
    n = target_model.num_layers
    bounds = list(stages) if stages is not None else [(0, n)]
    last = len(bounds) - 1
    with phase("layout"):  # each linear map laid out for its kernel (our CPU kernels load on the first)
        target = [ModelRunner(target_model, range(a, b), cfg.cache, first=i == 0, last=i == last,
                              deterministic=cfg.deterministic)
                  for i, (a, b) in enumerate(bounds)]
    if cfg.speculation.policy == "off" or cfg.speculation.method != "model":
        return target, None  # no draft model: plain decoding, or a model-free (lookup) drafter
    if m.draft is not None:
        draft_model = load_model(m.draft, m.dtype, device, m.weights, m.activations, m.backend)
        with phase("layout"):
            draft = ModelRunner(draft_model, range(draft_model.num_layers), cfg.cache)
    elif m.draft_layers is not None:
        if any(not 0 <= i < n for i in m.draft_layers):
            raise ConfigError(f"model.draft_layers: {list(m.draft_layers)} not within the target's {n} layers")
        draft = ModelRunner(target_model, m.draft_layers, cfg.cache)
    else:
        return target, None
    if m.draft_quantization != "none":
        quantize_runner(draft, m.draft_quantization)
    easyspec.enable(draft, cfg.speculation.draft_parallel)
    return target, draft
