"""`specfleet train-moe`: train a small Mixtral-style MoE language model on CPU, for the expert-parallel figures.

No real small MoE checkpoint can be downloaded here, so the MoE benchmarks use a model the project trains
itself: a few decoder layers with 8 or more experts, top-2 routing, a real tokenizer (SmolLM2's, from the
catalog's GGUF), trained for a bounded time on text every machine has: the Python standard library's source
and the prompts in ../shared/datasets. It is saved in Hugging Face format (MixtralConfig, safetensors,
tokenizer), so it loads through the normal path (actors/model/loader.py). Routing must be learned, not
uniform, or expert grouping has nothing to find: the report gives the routing entropy (mean per-token
entropy of the router's distribution, as a share of log E; 1.0 is uniform) and the usage entropy per layer.

    specfleet train-moe --out ~/.cache/specfleet-models/moe-mixtral-8x --minutes 20
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sysconfig
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import GenerationConfig, MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerBase

from deploy.bench.prompts import DATASETS, load_prompts


@dataclass(frozen=True)
class MoEShape:
    """The trained model's size (defaults: 4 layers, 8 experts, top-2, hidden 256)."""

    hidden_size: int = 256
    num_layers: int = 4
    num_experts: int = 8
    top_k: int = 2
    intermediate_size: int = 512
    num_heads: int = 4
    num_kv_heads: int = 2


@dataclass
class TrainReport:
    """What `train` did: steps, losses, time, and how far routing is from uniform."""

    steps: int
    seconds: float
    tokens_seen: int
    train_loss: float
    heldout_loss: float
    routing_entropy: float  # mean per-token router entropy / log E (1.0: uniform)
    usage_entropy: list[float] = field(default_factory=list)  # per layer: entropy of expert usage / log E
    corpus_tokens: int = 0


def corpus(tokenizer: PreTrainedTokenizerBase, max_files: int = 400) -> tuple[list[int], list[int]]:
    """Token streams (train, held-out) from the standard library's source and the shared datasets' prompts.

    Files are taken in sorted order (the same corpus on every machine with the same Python); every tenth
    document goes to the held-out stream.
    """
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py"))[:max_files]
    docs = [p.read_text(errors="replace") for p in files]
    prompt_files = [f for f in (DATASETS / "mt_bench_questions.jsonl", DATASETS / "HumanEval.jsonl.gz") if f.exists()]
    if prompt_files:
        docs += load_prompts(prompt_files)
    train, heldout = [], []
    eos = tokenizer.eos_token_id
    for i, doc in enumerate(docs):
        ids = tokenizer.encode(doc) + ([eos] if eos is not None else [])
        (heldout if i % 10 == 9 else train).extend(ids)
    return train, heldout


def build_model(vocab_size: int, shape: MoEShape, seed: int) -> MixtralForCausalLM:
    torch.manual_seed(seed)
    config = MixtralConfig(
        vocab_size=vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, num_local_experts=shape.num_experts,
        num_experts_per_tok=shape.top_k, max_position_embeddings=2048, tie_word_embeddings=True,
        router_aux_loss_coef=0.01, output_router_logits=False, sliding_window=None,
    )
    return MixtralForCausalLM(config)


def _batch(stream: list[int], rng: random.Random, batch: int, seq_len: int) -> torch.Tensor:
    starts = [rng.randrange(0, len(stream) - seq_len - 1) for _ in range(batch)]
    return torch.tensor([stream[s:s + seq_len] for s in starts], dtype=torch.long)  # (B, T)


@torch.no_grad()
def routing_entropy(model: MixtralForCausalLM, tokens: torch.Tensor) -> tuple[float, list[float]]:
    """(mean per-token router entropy, per-layer usage entropy), each divided by log E. tokens (B, T)."""
    out = model(tokens, output_router_logits=True)
    n_exp = model.config.num_local_experts
    per_token, usage = [], []
    for logits in out.router_logits:  # (B*T, E) per layer
        p = torch.softmax(logits.float(), dim=-1)
        per_token.append(float(-(p * p.clamp_min(1e-12).log()).sum(-1).mean()) / math.log(n_exp))
        top = torch.topk(p, model.config.num_experts_per_tok, dim=-1).indices.flatten()
        u = torch.bincount(top, minlength=n_exp).float()
        u = u / u.sum()
        usage.append(float(-(u * u.clamp_min(1e-12).log()).sum()) / math.log(n_exp))
    return sum(per_token) / len(per_token), usage


def train(tokenizer: PreTrainedTokenizerBase, out: Path, *, shape: MoEShape = MoEShape(), minutes: float = 20.0,
          max_steps: int | None = None, batch: int = 8, seq_len: int = 128, lr: float = 3e-3, seed: int = 0,
          max_files: int = 400, log=print) -> TrainReport:
    """Train for `minutes` (or `max_steps`) and save the model, tokenizer and report under `out`."""
    train_ids, heldout_ids = corpus(tokenizer, max_files)
    model = build_model(len(tokenizer), shape, seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    rng = random.Random(seed)
    started, step, loss = time.monotonic(), 0, float("nan")
    budget = minutes * 60
    while (max_steps is None or step < max_steps) and time.monotonic() - started < budget:
        warm = min(1.0, (step + 1) / 50)
        decay = 0.5 * (1 + math.cos(math.pi * min(1.0, (time.monotonic() - started) / budget)))
        for g in opt.param_groups:
            g["lr"] = lr * warm * (0.1 + 0.9 * decay)
        x = _batch(train_ids, rng, batch, seq_len)
        result = model(x, labels=x, output_router_logits=True)  # LM loss + the router's load-balancing loss
        opt.zero_grad(set_to_none=True)
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss, step = float(result.loss.detach()), step + 1
        if step % 20 == 0:
            log(f"step {step}: loss {loss:.3f} ({time.monotonic() - started:.0f} s)")
    model.eval()
    held = _batch(heldout_ids, random.Random(seed + 1), batch, seq_len)
    with torch.no_grad():
        heldout_loss = float(model(held, labels=held).loss)
    entropy, usage = routing_entropy(model, held)
    report = TrainReport(step, time.monotonic() - started, step * batch * seq_len, loss, heldout_loss, entropy,
                         usage, len(train_ids))
    out.mkdir(parents=True, exist_ok=True)
    model.config.output_router_logits = False
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    GenerationConfig(eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id).save_pretrained(out)
    (out / "train_report.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report


# ---- CLI ------------------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="folder to save the model in (Hugging Face format)")
    p.add_argument("--tokenizer", default="smollm2-135m-instruct",
                   help="a model (catalog name, GGUF file or folder) whose tokenizer to use (default: SmolLM2's)")
    p.add_argument("--minutes", type=float, default=20.0, help="training time budget (default 20)")
    p.add_argument("--max-steps", type=int, help="stop after this many steps (default: the time budget decides)")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> int:
    from actors.model.loader import load_metadata
    from deploy.model_store import resolve_model

    tokenizer = load_metadata(resolve_model(args.tokenizer)).tokenizer
    shape = MoEShape(hidden_size=args.hidden, num_layers=args.layers, num_experts=args.experts,
                     intermediate_size=2 * args.hidden)
    report = train(tokenizer, args.out.expanduser(), shape=shape, minutes=args.minutes, max_steps=args.max_steps,
                   seed=args.seed)
    print(json.dumps(asdict(report)))
    return 0
