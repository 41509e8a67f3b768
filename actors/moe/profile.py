"""Routing profiler: per MoE layer, which experts each token id goes to and which experts go together.

Statistics behind Speculative MoE's expert grouping and token pre-scheduling (arXiv 2503.04398), counted by
running real prompts through a ModelRunner with its MoE layers traced from outside (the layers are wrapped,
never edited). For each MoE layer l (position among the runner's MoE layers; `layers` has model indices):

    token_expert[l, t, e]  tokens with id t that chose expert e            (L, V, E)
    coact[l, e, e']        tokens that chose both e and e' (e != e')        (L, E, E)
    affinity[l, e, e']     tokens that chose e in layer l and e' in l + 1   (L-1, E, E)
    load[l, e]             tokens that chose e                              (L, E)

Saved as one versioned safetensors file (tensors plus a JSON header), so a plan can be made offline from a
dataset and again later from served traffic.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save, save_file

from actors.model.layers import MoE
from actors.model.metadata import SeqChunk
from actors.model.runner import ModelRunner

STATS_VERSION = 1


@dataclass
class ExpertRoutingStats:
    """Routing counts of one model's MoE layers (see the module docstring for each tensor's meaning)."""

    layers: tuple[int, ...]
    top_k: int
    token_expert: torch.Tensor  # (L, V, E) int64
    coact: torch.Tensor  # (L, E, E) int64
    affinity: torch.Tensor  # (L-1, E, E) int64
    load: torch.Tensor  # (L, E) int64
    tokens: int = 0

    @classmethod
    def empty(cls, layers: Sequence[int], vocab_size: int, num_experts: int, top_k: int,
              device: torch.device | str = "cpu") -> "ExpertRoutingStats":
        n = len(layers)
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.int64, device=device)  # noqa: E731
        return cls(tuple(layers), top_k, zeros(n, vocab_size, num_experts), zeros(n, num_experts, num_experts),
                   zeros(max(n - 1, 0), num_experts, num_experts), zeros(n, num_experts))

    @property
    def num_experts(self) -> int:
        return self.load.shape[1]

    def add(self, token_ids: torch.Tensor, expert_ids: Sequence[torch.Tensor]) -> None:
        """Count one forward: token_ids (N,), expert_ids[l] (N, top_k) for every MoE layer in order."""
        n_exp = self.num_experts
        onehot = [torch.zeros(len(token_ids), n_exp, dtype=torch.int64, device=ids.device).scatter_(1, ids, 1)
                  for ids in expert_ids]
        for l, hot in enumerate(onehot):  # hot (N, E): 1 where the token chose the expert
            self.token_expert[l].index_add_(0, token_ids, hot)
            self.load[l] += hot.sum(0)
            pair = hot.T @ hot  # (E, E)
            self.coact[l] += pair - torch.diag(torch.diagonal(pair))
            if l + 1 < len(onehot):
                self.affinity[l] += hot.T @ onehot[l + 1]
        self.tokens += len(token_ids)

    def usage_entropy(self) -> torch.Tensor:
        """Per MoE layer, the entropy of expert usage as a share of log E (1.0: uniform). (L,)"""
        usage = self.load.double()
        usage = usage / usage.sum(-1, keepdim=True).clamp_min(1)
        return -(usage * usage.clamp_min(1e-12).log()).sum(-1) / torch.log(torch.tensor(float(self.num_experts)))

    def merge(self, other: "ExpertRoutingStats") -> None:
        """Add another count of the same model's routing (e.g. another rank's, or a later window)."""
        if other.layers != self.layers or other.token_expert.shape != self.token_expert.shape:
            raise ValueError(f"routing statistics of layers {other.layers} {tuple(other.token_expert.shape)} do not "
                             f"match {self.layers} {tuple(self.token_expert.shape)}")
        for name in ("token_expert", "coact", "affinity", "load"):
            getattr(self, name).add_(getattr(other, name).to(getattr(self, name).device))
        self.tokens += other.tokens

    def save(self, path: Path, model: str = "") -> None:
        tensors, header = self._file(model)
        save_file(tensors, str(path), metadata=header)  # writes from any device

    def to_bytes(self, model: str = "") -> bytes:
        """The same file's bytes (what the admin API sends)."""
        tensors, header = self._file(model)
        return save(tensors, metadata=header)

    def _file(self, model: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        header = {"version": str(STATS_VERSION), "layers": json.dumps(list(self.layers)), "top_k": str(self.top_k),
                  "tokens": str(self.tokens), "model": model}
        tensors = {"token_expert": self.token_expert, "coact": self.coact, "affinity": self.affinity, "load": self.load}
        return {k: v.contiguous() for k, v in tensors.items()}, header

    @classmethod
    def load_file(cls, path: Path) -> "ExpertRoutingStats":
        from safetensors import safe_open

        with safe_open(str(path), "pt") as f:
            header = f.metadata() or {}
        if header.get("version") != str(STATS_VERSION):
            raise ValueError(f"{path}: routing statistics version {header.get('version')!r}; "
                             f"this build reads version {STATS_VERSION}")
        t = load_file(str(path))
        return cls(tuple(json.loads(header["layers"])), int(header["top_k"]), t["token_expert"], t["coact"],
                   t["affinity"], t["load"], int(header["tokens"]))


class _Traced:
    """An MoE layer seen from outside: computes the same output and hands its routing to `record`."""

    def __init__(self, moe: MoE, record) -> None:
        self.moe, self.record = moe, record

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _, ids = self.moe.route(x.reshape(-1, x.shape[-1]))  # (N, top_k)
        self.record(ids)
        return self.moe(x)


def moe_layers(runner: ModelRunner) -> list[int]:
    """Model indices of the runner's MoE layers, in order."""
    return [layer.index for layer in runner.layers if isinstance(layer.ffn, MoE)]


def profile(runner: ModelRunner, prompts: Iterable[Sequence[int]], chunk_tokens: int = 256) -> ExpertRoutingStats:
    """Routing statistics of `prompts` (token ids) run as prefills through a whole-model runner.

    Each prompt runs in chunks of `chunk_tokens` under a throwaway request id whose KV is freed afterwards.
    """
    moes = [layer for layer in runner.layers if isinstance(layer.ffn, MoE)]
    if not moes:
        raise ValueError("the model has no MoE layers to profile")
    if not runner.first:
        raise ValueError("profiling needs a runner that embeds tokens (the first stage or a whole model)")
    first = moes[0].ffn
    device = first.router.device
    stats = ExpertRoutingStats.empty([m.index for m in moes], runner.model.config.vocab_size, first.router.shape[0],
                               first.top_k, device)
    seen: list[torch.Tensor] = []
    originals = [m.ffn for m in moes]
    for m in moes:
        m.ffn = _Traced(m.ffn, seen.append)
    try:
        for i, prompt in enumerate(prompts):
            rid = f"__profile-{i}__"
            for start in range(0, len(prompt), chunk_tokens):
                piece = tuple(prompt[start:start + chunk_tokens])
                seen.clear()
                runner.forward([SeqChunk(rid, piece, 0)])
                stats.add(torch.tensor(piece, dtype=torch.long, device=device), seen)
            runner.cache.free(rid)
    finally:
        for m, ffn in zip(moes, originals):
            m.ffn = ffn
    return stats
