"""llama.cpp (llama-cpp-python) on the same GGUF file and the same prompt tokens: the anchor row of `bench cpu`.

Optional: `pip install llama-cpp-python` (built from its PyPI source; docs/benchmarks.md). Without it the row is
left out; nothing else in the project imports it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCpp:
    """Greedy completions by llama.cpp at batch 1 on `threads` threads, the prompt given as token ids."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int) -> None:
        from llama_cpp import Llama

        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         verbose=False)

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        """Exactly `max_tokens` new tokens (EOS does not stop them: every row of the benchmark decodes as many). The
        cache starts empty for every request, as ours does: llama-cpp-python would otherwise reuse the previous
        prompt's matching prefix."""
        self.llm.reset()
        out: list[int] = []
        for token in self.llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(token)
            if len(out) == max_tokens:
                break
        return out
