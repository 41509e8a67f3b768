"""Contiguous layer split of one model over pipeline stages: the smallest bottleneck time under each device's memory."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from placement.model_size import ModelSize


@dataclass(frozen=True)
class Device:
    """One accelerator, a stage slot: `speed` is TFLOPS-like (1.0 runs 1e9 FLOPs a ms), `order` its node's index."""

    node: str
    index: int
    capacity_bytes: int
    speed: float
    order: int

    @property
    def label(self) -> str:
        return f"{self.node}:{self.index}"


@dataclass(frozen=True)
class Stage:
    """Layers [start, end) of a model on `device`; `first` holds the embedding, `last` the final norm and LM head."""

    device: Device
    start: int
    end: int
    first: bool
    last: bool

    @property
    def num_layers(self) -> int:
        return self.end - self.start


def stage_time_ms(model: ModelSize, device: Device, num_layers: int, last: bool, step_tokens: int) -> float:
    """Compute time of one forward of `step_tokens` tokens through `num_layers` layers (and the LM head if last)."""
    flops = num_layers * model.layer_flops_per_token + (model.head_flops_per_token if last else 0)
    return flops * step_tokens / (device.speed * 1e9)


def split_layers(
    devices: Sequence[Device],
    model: ModelSize,
    num_stages: int,
    *,
    kv_tokens: int,
    step_tokens: int = 1,
    reserved: Mapping[Device, int] | None = None,
) -> list[Stage] | None:
    """The split of `model` over `num_stages` of `devices` with the smallest bottleneck stage time, or None.

    Method: for a bottleneck time T, each device can take at most cap(T) = min(layers it runs within T,
    layers that fit its free memory with their KV) layers, less for the stage that also holds the
    embedding or the head. T is feasible when `num_stages` devices' caps sum to at least the layer count
    with every cap >= 1; the smallest feasible T is found by bisection over the finitely many stage
    times. At that T each chosen device takes its cap, and the surplus is taken back one layer at a time
    from the slowest stage. With memory to spare this is the speed-proportional split (a 2:1 speed ratio
    gives 2:1 layers, within one); a memory-poor device stops at its memory cap and the others take the
    rest. `reserved` holds bytes already promised on a device (e.g. to the draft).
    At each T the devices and the first/last roles are chosen to maximise the caps' sum exactly (every
    pair of first and last devices, the largest middle caps beside them; ties go to faster devices), so
    the result is the optimal bottleneck over all choices of devices, orders and contiguous splits.
    """
    layers = model.num_layers
    if num_stages < 1 or num_stages > min(len(devices), layers):
        return None
    reserved = reserved or {}
    free = {dev: dev.capacity_bytes - reserved.get(dev, 0) for dev in devices}
    per_layer = model.stage_bytes(1, kv_tokens, first=False, last=False)

    def cap(dev: Device, first: bool, last: bool, t: float) -> int:
        room = free[dev] - model.stage_bytes(0, kv_tokens, first=first, last=last)
        if room < per_layer:
            return 0
        by_time = int(t * dev.speed * 1e9 / (model.layer_flops_per_token * step_tokens))
        by_time = max(0, min(by_time, layers))
        while by_time < layers and stage_time_ms(model, dev, by_time + 1, last, step_tokens) <= t:
            by_time += 1
        while by_time > 0 and stage_time_ms(model, dev, by_time, last, step_tokens) > t:
            by_time -= 1
        return min(room // per_layer, by_time)

    def choose(t: float) -> list[tuple[Device, bool, bool, int]] | None:
        """(device, first, last, cap) of the chosen stages at bottleneck `t`, if their caps cover every layer."""
        if num_stages == 1:
            best = max(devices, key=lambda d: (cap(d, True, True, t), d.speed, free[d], -d.order))
            c = cap(best, True, True, t)
            return [(best, True, True, c)] if c >= layers else None
        mid = {d: cap(d, False, False, t) for d in devices}
        ranked = sorted(devices, key=lambda d: (-mid[d], -d.speed, -free[d], d.order))
        position = {d: i for i, d in enumerate(ranked)}
        prefix = [0]
        for d in ranked:
            prefix.append(prefix[-1] + mid[d])
        usable = sum(1 for d in ranked if mid[d] >= 1)  # a prefix of `ranked`
        others = num_stages - 2
        firsts = [(d, c) for d in ranked if (c := cap(d, True, False, t)) >= 1]
        lasts = [(d, c) for d in ranked if (c := cap(d, False, True, t)) >= 1]
        best: tuple[int, Device, Device, int] | None = None  # (total, first, last, end of the others in ranked)
        for f, first_cap in firsts:
            for last, last_cap in lasts:
                if f == last:
                    continue
                ends = (position[f], position[last])
                if usable - sum(p < usable for p in ends) < others:
                    continue  # not enough devices left to give every middle stage a layer
                end = others
                while end < others + sum(p < end for p in ends):  # skip f and l inside the prefix
                    end += 1
                total = first_cap + last_cap + prefix[end] - sum(mid[ranked[p]] for p in ends if p < end)
                if best is None or total > best[0]:
                    best = (total, f, last, end)
        if best is None or best[0] < layers:
            return None
        _, f, last, end = best
        middle = sorted((d for d in ranked[:end] if d not in (f, last)), key=lambda d: d.order)
        stages = [(f, True, False, cap(f, True, False, t))] + [(d, False, False, mid[d]) for d in middle]
        return stages + [(last, False, True, cap(last, False, True, t))]

    times = sorted({
        stage_time_ms(model, d, c, last, step_tokens)
        for d in devices for c in range(1, layers + 1) for last in (False, True)
    })
    if choose(times[-1]) is None:
        return None
    lo, hi = 0, len(times) - 1
    while lo < hi:  # invariant: times[hi] is feasible
        probe = (lo + hi) // 2
        if choose(times[probe]) is not None:
            hi = probe
        else:
            lo = probe + 1
    picked = choose(times[hi])
    assert picked is not None
    counts = [c for *_, c in picked]
    while sum(counts) > layers:  # give back surplus layers, slowest stage first
        i = max(
            (i for i in range(len(picked)) if counts[i] > 1),
            key=lambda i: (stage_time_ms(model, picked[i][0], counts[i], picked[i][2], step_tokens),
                           -picked[i][0].speed, picked[i][0].order),
        )
        counts[i] -= 1
    stages, start = [], 0
    for (dev, first, last, _), count in zip(picked, counts):
        stages.append(Stage(dev, start, start + count, first, last))
        start += count
    return stages
