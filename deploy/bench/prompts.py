"""The benchmarks' prompts: real MT-Bench and HumanEval questions from ../shared/datasets."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from deploy.cli.flags import UsageError

DATASETS = Path(__file__).resolve().parents[2].parent / "shared" / "datasets"


def load_prompts(files: list[Path], n: int | None = None) -> list[str]:
    """Prompts taken in turn from the files (an MT-Bench first turn, or a HumanEval completion task): the
    first n, or all of them."""
    per_file = []
    for f in files:
        opener = gzip.open if f.suffix == ".gz" else open
        with opener(f, "rt") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
        per_file.append([
            r["turns"][0] if "turns" in r else f"Complete this Python function:\n```python\n{r['prompt']}```"
            for r in rows
        ])
    longest = max((len(p) for p in per_file), default=0)
    prompts = [p[i] for i in range(longest) for p in per_file if i < len(p)]
    if n is not None and n > len(prompts):
        raise UsageError(f"asked for {n} prompts; the prompt files hold {len(prompts)}")
    return prompts[:n]
