"""Turning logits into a sampling distribution (temperature, top-k, top-p) and drawing from it."""

from __future__ import annotations

import secrets

import torch

from cluster.request import SamplingParams


def make_generator(params: SamplingParams, device: torch.device | str = "cpu") -> torch.Generator:
    """A per-request generator on `device` (where its request's distributions are): seeded requests repeat
    exactly, unseeded ones draw a fresh seed."""
    g = torch.Generator(device=device)
    g.manual_seed(params.seed if params.seed is not None else secrets.randbits(63))
    return g


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from: softmax(logits / T) restricted to top-k, then top-p.

    logits: (N, V) fp32 -> probs (N, V) fp32, each row summing to 1. Not for temperature 0 (greedy).
    top-p keeps the smallest set of most likely tokens whose mass reaches top_p (Holtzman et al. 2020),
    computed after top-k, as vLLM and transformers do.
    """
    assert params.temperature > 0, "greedy requests take the argmax, not a distribution"
    # shifted by the row's maximum first (softmax does not change it) so that a tiny temperature cannot overflow to
    # inf, and that temperature at least the dtype's least normal number (1e-300 would be 0 in fp32: 0 / 0)
    temperature = max(params.temperature, torch.finfo(logits.dtype).tiny)
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]  # (N, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)  # (N, V)
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= params.top_p  # mass before this token already enough
        drop_sorted[..., 0] = False  # the most likely token always stays (a top_p below fp32's least is 0 here)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One token per row of probs (N, V) -> (N,)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
