"""llama.cpp (llama-cpp-python) on the same GGUF file and the same prompt tokens: the anchor rows of `bench cpu`.

Optional: the `llama` extra (`pip install -e '.[llama]'`, llama-cpp-python built from its PyPI source for this CPU;
docs/benchmarks.md says how). Without it the rows are left out; nothing else in the project imports it.

`LlamaCpp` runs in this process on the installed build. `LlamaCppProcess` runs the same in a child process on
another build of the same llama.cpp source (its shared libraries in a folder, `LLAMA_CPP_LIB_PATH`), e.g. one
compiled for AVX2 only, so that an AVX512 machine also measures the anchor an AVX2-only CPU gets: a process loads
one build of the library.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import selectors
import subprocess
import sys
from pathlib import Path


def available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


class LlamaCpp:
    """Greedy completions by llama.cpp at batch 1 on `threads` threads, the prompt given as token ids; with
    `lookup`, llama-cpp-python's prompt-lookup speculation (`LlamaPromptLookupDecoding`, after Saxena's
    prompt-lookup decoding) proposing up to `lookup` tokens a step."""

    def __init__(self, gguf: Path, threads: int, n_ctx: int, lookup: int | None = None) -> None:
        from llama_cpp import Llama, llama_print_system_info
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
        self.llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx,
                         n_batch=512, draft_model=draft, verbose=False)
        self.system_info = llama_print_system_info().decode()  # the build's ISA flags, e.g. "AVX2 = 1 | ..."

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

    def close(self) -> None:
        self.llm.close()


class AnchorError(RuntimeError):
    """The child llama.cpp process failed, or did not answer within its deadline."""


class LlamaCppProcess:
    """`LlamaCpp` in a child process on the llama.cpp build in `lib` (a folder of libllama.so and libggml*.so);
    every call has a deadline."""

    def __init__(self, lib: Path, gguf: Path, threads: int, n_ctx: int, lookup: int | None = None,
                 timeout_s: float = 600.0) -> None:
        if not (Path(lib) / "libllama.so").exists():
            raise AnchorError(f"no libllama.so in {lib} (build llama.cpp's shared libraries there: docs/benchmarks.md)")
        self.timeout_s = timeout_s
        env = {**os.environ, "LLAMA_CPP_LIB_PATH": str(lib)}
        cmd = [sys.executable, "-m", "deploy.bench.llama_anchor", "--gguf", str(gguf), "--threads", str(threads),
               "--n-ctx", str(n_ctx)] + (["--lookup", str(lookup)] if lookup else [])
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.system_info = self._answer()["system_info"]

    def _answer(self) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        ready = sel.select(self.timeout_s)
        sel.close()
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.close()
            raise AnchorError(f"the llama.cpp child gave no answer within {self.timeout_s:.0f}s "
                              f"(exit code {self.proc.poll()})")
        return json.loads(line)

    def generate(self, prompt: list[int], max_tokens: int) -> list[int]:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return self._answer()["tokens"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # the child's loop ends at end of input
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)


def _serve(args: argparse.Namespace) -> None:
    """The child's loop: one JSON request per input line, one JSON answer per output line (on the original stdout;
    whatever the library prints goes to stderr)."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    llm = LlamaCpp(args.gguf, args.threads, args.n_ctx, args.lookup)
    print(json.dumps({"system_info": llm.system_info}), file=answers, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        print(json.dumps({"tokens": llm.generate(req["prompt"], req["max_tokens"])}), file=answers, flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="llama.cpp greedy completions over JSON lines (LlamaCppProcess's child)")
    p.add_argument("--gguf", type=Path, required=True)
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--n-ctx", type=int, required=True)
    p.add_argument("--lookup", type=int)
    _serve(p.parse_args())
