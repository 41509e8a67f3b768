"""The matmuls behind `weights: stored | dequantized`, side by side: microseconds per call of one weight matrix at
1 and 5 input rows by default (a decode step, a k = 4 verification; `--kernel-rows` picks others, e.g. 1 8 16 for a
batch of 8 and its drafts), streaming through enough copies that the weights come from memory, not cache, as in a
real forward; ours once per ISA path this CPU runs. Part of `specfleet bench cpu --kernels`.

With more than two row counts the table adds what decides whether a draft row pays in a full batch: the cost of one
more row at the largest count against the mean row's there (a verified row at batch 8 pays only when its acceptance
is above that ratio, for this matrix's share of the forward)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from actors.model import cpu_kernels
from actors.model.gguf_blocks import GroupedInts
from actors.model.qlinear import Int4Linear, Int8Linear, int8_linear

SHAPES = {"135M gate_up (3072 x 576)": (3072, 576), "1.5B down (1536 x 8960)": (1536, 8960)}
BYTES = 48 << 20  # each variant cycles through this much weight data, above the 32 MiB L3 of this machine


def _variants(n: int, k: int) -> dict[str, Callable[[], Callable[[torch.Tensor], torch.Tensor]]]:
    """name -> a builder of one fresh module (random weights) of that kind, bf16 in and out."""
    cpu, bf16 = torch.device("cpu"), torch.bfloat16

    def int4(own: bool, activations: str = "int8") -> Callable:
        def build() -> Callable:
            codes = torch.randint(0, 16, (n, k), dtype=torch.uint8)
            w = GroupedInts(codes, torch.rand(n, k // 32) / 64, -torch.rand(n, k // 32) / 8, bits=4, group=32)
            return Int4Linear(w, None, cpu, bf16, ours=own, activations=activations)
        return build

    out = {
        "dense bf16 (dequantized)": lambda: torch.nn.Linear(k, n, bias=False, dtype=bf16),
        "int8 per row, torch's _weight_int8pack_mm": lambda: Int8Linear.rtn(torch.randn(n, k), None, cpu, bf16),
        "int4 groups of 32, torch's _weight_int4pack_mm_for_cpu": int4(own=False),
    }
    for isa in cpu_kernels.ISAS:  # ours, on each ISA path this CPU runs (a module keeps the build it was made on)
        if cpu_kernels.unavailable(isa) is not None:
            continue

        def on(isa: str, build: Callable) -> Callable:
            def built() -> Callable:
                with cpu_kernels.forced(isa):
                    return build()
            return built
        out[f"int4 groups of 32, ours [{isa}], bf16 inputs"] = on(isa, int4(own=True, activations="bf16"))
        out[f"int4 groups of 32, ours [{isa}], int8 inputs"] = on(isa, int4(own=True))
        out[f"int8 per row as two int4 planes, ours [{isa}], bf16 inputs"] = on(
            isa, lambda: int8_linear(torch.randn(n, k), None, cpu, bf16, "bf16"))
        out[f"int8 per row as two int4 planes, ours [{isa}], int8 inputs"] = on(
            isa, lambda: int8_linear(torch.randn(n, k), None, cpu, bf16))
    return out


ROWS = (1, 5)


def measure(repeats: int = 5, rows: tuple[int, ...] = ROWS) -> dict[str, dict[str, dict[int, float]]]:
    """shape -> variant -> input rows (each of `rows`) -> microseconds per call (wall time, median of `repeats`
    passes)."""
    report: dict = {}
    for label, (n, k) in SHAPES.items():
        report[label] = {}
        for name, build in _variants(n, k).items():
            first = build()
            copies = max(2, BYTES // max(1, _bytes(first)))
            mods = [first] + [build() for _ in range(copies - 1)]
            report[label][name] = {}
            for m in rows:
                x = torch.randn(m, k, dtype=torch.bfloat16)
                with torch.inference_mode():
                    for mod in mods:
                        mod(x)
                    times = []
                    for _ in range(repeats):
                        t = time.perf_counter()
                        for mod in mods:
                            mod(x)
                        times.append((time.perf_counter() - t) / len(mods))
                report[label][name][m] = round(sorted(times)[len(times) // 2] * 1e6, 1)
            del mods
    return report


def _bytes(module: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in vars(module).values() if isinstance(t, torch.Tensor)) + sum(
        p.numel() * p.element_size() for p in module.parameters())


def extra_row_ratio(times: dict[int, float]) -> float | None:
    """One more row's cost at the largest row count (the slope from the count below it) over the mean row's there;
    None with fewer than two counts."""
    ms = sorted(times)
    if len(ms) < 2:
        return None
    lo, hi = ms[-2], ms[-1]
    return (times[hi] - times[lo]) / (hi - lo) / (times[hi] / hi)


def print_table(report: dict) -> None:
    from rich.console import Console
    from rich.markup import escape  # "[avx2]" is text, not markup
    from rich.table import Table

    for label, variants in report.items():
        rows = sorted({m for r in variants.values() for m in r}, key=int)
        first, last = rows[0], rows[-1]
        t = Table(title=f"matmul, {label}: microseconds per call")
        cols = ["kernel", *(f"{m} row{'s' if int(m) > 1 else ''}" for m in rows), f"{last} / {first}"]
        if len(rows) > 2:
            cols.append(f"one more row at {last} / mean row")
        for col in cols:
            t.add_column(col, justify="left" if col == "kernel" else "right")
        for name, r in variants.items():
            cells = [f"{r[m]:.0f}" for m in rows] + [f"{r[last] / r[first]:.2f}"]
            if len(rows) > 2:
                cells.append(f"{extra_row_ratio({int(m): v for m, v in r.items()}):.2f}")
            t.add_row(escape(name), *cells)
        Console(width=160).print(t)
