"""Generic path vs transformers' own decoding of one model, batch 1, interleaved in one process (issue 37).

`python -m deploy.bench.generic_decode --model gemma3-270m --tokens 24 --rounds 3`: each round decodes the same
prompt greedily on our generic-path runner (actors/model/generic_runner.py) and then on transformers' own forward
with its DynamicCache (a second copy of the model, its default attention), and prints both rates and whether the
tokens agree. `--native` adds the native path (hand-written layers) on the same prompt, its weights as stored and
dequantized. Interleaving makes drift in machine speed hit every row alike; the medians are the figures. Decode
steps only: the prompt's prefill is outside the timing.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from actors.model.loader import LoadedModel, load_model
from actors.model.metadata import SeqChunk
from actors.model.runner import ModelRunner
from cluster.config import CacheConfig
from deploy.model_store import resolve_model


def ours(model: LoadedModel, prompt: list[int], tokens: int, rid: str,
         weights: str | None = None) -> tuple[float, list[int]]:
    """Tokens per second of `tokens` greedy decode steps on a fresh runner of `model` (after the prompt)."""
    runner = ModelRunner(model, range(model.num_layers), CacheConfig(block_size=16, num_blocks=64),
                         weights=weights)  # type: ignore[arg-type]
    nxt = int(runner.forward([SeqChunk(rid, tuple(prompt))])[-1].argmax())
    out = [nxt]
    t0 = time.perf_counter()
    for _ in range(tokens):
        nxt = int(runner.forward([SeqChunk(rid, (nxt,))])[-1].argmax())
        out.append(nxt)
    return tokens / (time.perf_counter() - t0), out


@torch.inference_mode()
def theirs(hf: torch.nn.Module, prompt: list[int], tokens: int) -> tuple[float, list[int]]:
    """The same with transformers' own forward and DynamicCache."""
    step = hf(torch.tensor([prompt]), use_cache=True)
    past, nxt = step.past_key_values, int(step.logits[0, -1].argmax())
    out = [nxt]
    t0 = time.perf_counter()
    for _ in range(tokens):
        step = hf(torch.tensor([[nxt]]), past_key_values=past, use_cache=True)
        past, nxt = step.past_key_values, int(step.logits[0, -1].argmax())
        out.append(nxt)
    return tokens / (time.perf_counter() - t0), out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gemma3-270m", help="catalog name, GGUF file or folder")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--prompt", default="The capital of France is")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--native", action="store_true", help="also the native path, weights stored and dequantized")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    source = resolve_model(args.model, args.dtype)  # a catalog GGUF: converted once to a cached folder
    model = load_model(source, args.dtype, backend="generic")
    hf = AutoModelForCausalLM.from_pretrained(source, dtype=model.dtype).eval()
    native = load_model(source, args.dtype, weights="stored", backend="native") if args.native else None
    prompt = model.encode(args.prompt)
    rows = []
    print(f"load average {[round(x, 2) for x in os.getloadavg()]}", flush=True)
    for i in range(args.rounds):
        (a, ta), (b, tb) = ours(model, prompt, args.tokens, f"r{i}"), theirs(hf, prompt, args.tokens)
        row = {"generic": a, "transformers": b}
        line = f"round {i}: generic path {a:.2f} tok/s, transformers {b:.2f} tok/s, same tokens {ta == tb}"
        if native is not None:
            for weights in ("stored", "dequantized"):
                rate, tn = ours(native, prompt, args.tokens, f"n{weights}{i}", weights)
                row[f"native {weights}"] = rate
                line += f", native {weights} {rate:.2f} tok/s (same tokens as generic {tn == ta})"
        rows.append(row)
        print(line, flush=True)
    med = {name: statistics.median(r[name] for r in rows) for name in rows[0]}
    print(f"{model.plan.describe()}\nmedian: " + ", ".join(f"{n} {v:.2f} tok/s ({v / med['generic']:.2f}x generic)"
                                                          for n, v in med.items()))
    print(f"load average {[round(x, 2) for x in os.getloadavg()]}")


if __name__ == "__main__":
    main()
