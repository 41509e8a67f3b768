"""The batch-invariant forward (engine.deterministic, actors/model/deterministic.py): each op the runner uses, and
then the whole forward, gives a row the same bits computed alone and among others (M = 1..16 rows, verification
shapes, other requests in the batch), in bf16 and fp32; speculation in bf16 then equals plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from actors.engine.core import Engine
from actors.model import cpu_kernels
from actors.model.deterministic import Tiled, row_invariant
from actors.model.layers import apply_rope
from actors.model.loader import load_model
from actors.model.metadata import SeqChunk
from actors.model.qlinear import Int4Linear, Int8Linear
from actors.model.quant import rtn_int4
from actors.model.runner import ModelRunner
from actors.engine.offline import generate
from cluster.config import CacheConfig, SchedulerConfig, SpeculationConfig
from cluster.request import SamplingParams
from tests.fixtures.tiny_models import DRAFT_NOISE, build_tiny_model, perturbed_copy
from tests.unit.helpers import isa_params, text_prompts

ROWS = (*range(1, 17), 40)  # every M up to 16 (k+1 = 2..9 verifications among them), 8 requests of k = 4
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# bf16 on our int4 kernels: once per ISA of ours this CPU has (the others skipped, with the reason)
OURS = [pytest.param("bf16", "int4", p.values[0], marks=p.marks, id=f"bf16-int4-{p.values[0]}") for p in isa_params()]


def not_invariant(op, x: torch.Tensor) -> list[int]:
    """The batch sizes M at which some row of op(x[:M]) differs in any bit from op of that row alone."""
    alone = torch.cat([op(x[i:i + 1]) for i in range(max(ROWS))])
    return [m for m in ROWS if not torch.equal(op(x[:m]), alone[:m])]


def pos(x: torch.Tensor) -> torch.Tensor:
    """A position (or token id) per row, from the row itself: (M, ...) -> (M,) in [0, 40)."""
    return (x[:, 0].float().abs() * 30).long() % max(ROWS)


def ops(dtype: torch.dtype, ours: bool) -> dict[str, object]:
    """Each op of the deterministic forward as the runner builds it, on widths the tiny models and SmolLM2 use:
    torch's, or (`ours`) those of our CPU kernels' chosen ISA."""
    g = torch.Generator().manual_seed(0)
    w = {shape: (torch.randn(*shape, generator=g) * 0.05).to(dtype) for shape in ((128, 256), (576, 1536))}
    table = torch.randn(100, 256, generator=g).to(dtype)
    norm = torch.randn(256, generator=g).to(dtype)
    cos, sin = (torch.randn(max(ROWS), 1, 32, generator=g).to(dtype) for _ in range(2))
    if ours:
        lib = cpu_kernels.ops()
        assert lib is not None and dtype == torch.bfloat16
        found = {"rms_norm (ours)": lambda x: lib.rms_norm(x, norm, 1e-6), "SiLU-gated product (ours)": lib.silu_mul}
        for n, k in w:
            mine = Int4Linear(rtn_int4(w[n, k].float()), None, torch.device("cpu"), dtype)
            assert mine.own is not None and row_invariant(mine) is mine  # ours runs as it is
            found[f"int4 (ours) {k} -> {n}"] = mine
        return found
    found = {
        "embedding": lambda x: F.embedding(pos(x) % 100, table),
        "rms_norm (torch)": lambda x: F.rms_norm(x, (256,), norm, 1e-6),
        "rotary": lambda x: apply_rope(x.view(-1, 8, 32), cos[pos(x)], sin[pos(x)]),
        "SiLU-gated product": lambda x: F.silu(x[:, :128]) * x[:, 128:],
        "log_softmax, argmax (of logits)": lambda x: torch.cat([torch.log_softmax(x.float(), -1),
                                                               x.argmax(-1, keepdim=True).float()], -1),
    }
    for n, k in w:
        found[f"dense {k} -> {n}, tiled"] = row_invariant(torch.nn.Linear(k, n, bias=False, dtype=dtype))
        found[f"dense {k} -> {n}, tiled"].inner.weight.data = w[n, k]
        found[f"int8 {k} -> {n}, tiled"] = row_invariant(Int8Linear.rtn(w[n, k], None, torch.device("cpu"), dtype))
        codes = rtn_int4(w[n, k].float())
        found[f"int4 (torch) {k} -> {n}, tiled"] = row_invariant(
            Int4Linear(codes, None, torch.device("cpu"), dtype, ours=False))
    return found


@pytest.mark.heavy
@pytest.mark.parametrize("dtype,kernel_isa", [("bf16", "torch"), ("fp32", "torch")] + [
    pytest.param("bf16", p.values[0], marks=p.marks, id=f"bf16-{p.values[0]}") for p in isa_params()],
    indirect=["kernel_isa"])
def test_each_op_of_the_deterministic_forward_gives_a_row_its_own_bits(dtype: str, kernel_isa: str) -> None:
    g = torch.Generator().manual_seed(1)
    bad = {}
    for name, op in ops(DTYPES[dtype], ours=kernel_isa != "torch").items():
        width = op.in_features if hasattr(op, "in_features") else 256
        x = torch.randn(max(ROWS), width, generator=g).to(DTYPES[dtype])
        with torch.inference_mode():
            if m := not_invariant(op, x):
                bad[name] = m
    assert not bad, f"not row-invariant (op: batch sizes M): {bad}"


def test_tiles_are_what_makes_a_dense_matmul_invariant() -> None:
    """The wrapper computes exactly its inner module's rows (only the shape of the calls changes)."""
    lin = torch.nn.Linear(256, 128, dtype=torch.bfloat16)
    x = torch.randn(21, 256).bfloat16()
    with torch.inference_mode():
        tiled = Tiled(lin)(x)
        assert tiled.shape == (21, 128)
        assert torch.equal(tiled[16:], lin(F.pad(x[16:], (0, 0, 0, 11)))[:5])


def model(tmp_path: Path, dtype: str, weights: str, noise: float = 0.0):
    """A tiny qwen2 whose widths our kernels take (its copy with `noise`: a draft that agrees with it partly)."""
    path = build_tiny_model("qwen2", tmp_path / "q", hidden_size=128, head_dim=32, intermediate_size=256)
    if noise:
        path = perturbed_copy(path, tmp_path / "draft", noise)
    return load_model(str(path), dtype, weights=weights)


@pytest.mark.parametrize("dtype,weights,kernel_isa", [
    *OURS, ("bf16", "dequantized", "auto"), ("fp32", "dequantized", "auto")], indirect=["kernel_isa"])
def test_a_verification_among_other_requests_gives_the_logits_of_one_token_steps(
        tmp_path: Path, dtype: str, weights: str, kernel_isa: str) -> None:
    """k+1 positions verified beside another request's decode and another's prefill chunk give, bit for bit, the
    logits of k+1 one-token steps of the same tokens alone: the property that makes speculation exact."""
    m = model(tmp_path, dtype, weights)
    runner = ModelRunner(m, range(m.num_layers), CacheConfig(block_size=4, num_blocks=256), deterministic=True)
    prompt, other = text_prompts(m, 2)
    for k in (1, 4, 8):
        a, b, c, d = (f"{name}{k}" for name in "abcd")
        for rid, p in ((a, prompt), (b, prompt), (c, other)):
            assert runner.reserve(rid, len(p) + 12)
            runner.forward([SeqChunk(rid, tuple(p), 1)])
        assert runner.reserve(d, len(other))
        drafts = tuple(range(5, 6 + k))  # k + 1 tokens
        together = runner.forward([SeqChunk(c, (3,), 1), SeqChunk(a, drafts, k + 1),
                                   SeqChunk(d, tuple(other[:7]), 0)])[1:]  # (k+1, V)
        alone = torch.cat([runner.forward([SeqChunk(b, (t,), 1)]) for t in drafts])
        assert torch.equal(together, alone), f"k = {k}: {float((together - alone).abs().max())}"


@pytest.mark.heavy
@pytest.mark.parametrize("dtype,weights,kernel_isa", [*OURS, ("bf16", "dequantized", "auto")],
                         indirect=["kernel_isa"])
def test_bf16_speculation_equals_plain_decoding_in_deterministic_mode(tmp_path: Path, dtype: str, weights: str,
                                                                      kernel_isa: str) -> None:
    """Token for token, for n-gram and model drafts, fixed and goodput policies, one request and four at once
    (8 prompts of 48 tokens: without deterministic mode these differ from plain decoding on this CPU, both models)."""
    m = model(tmp_path, dtype, weights)
    drafts = model(tmp_path, dtype, weights, DRAFT_NOISE)
    cache = CacheConfig(block_size=4, num_blocks=512)

    def run(speculation: SpeculationConfig, draft: ModelRunner | None, batch: int) -> list[list[int]]:
        engine = Engine(ModelRunner(m, range(m.num_layers), cache, deterministic=True), draft, speculation,
                        SchedulerConfig(max_batch_size=8))
        prompts = text_prompts(m, 8, offset=3)
        params = SamplingParams(temperature=0.0, max_tokens=48)
        done = [c for i in range(0, 8, batch) for c in generate(engine, prompts[i:i + batch], params)]
        if speculation.policy == "fixed" and engine.drafter is not None:  # speculation did run (goodput's k comes
            assert sum(c.stats.accepted for c in done) > 0  # from measured step times: any k, 0 included)
        return [c.token_ids for c in done]

    plain = run(SpeculationConfig(policy="off"), None, 1)
    for policy in ("fixed", "goodput"):
        for batch in (1, 4):
            ngram = SpeculationConfig(policy=policy, k=4, method="ngram", ngram={"min_n": 1, "max_n": 3})
            assert run(ngram, None, batch) == plain, (policy, batch, "ngram")
            draft = ModelRunner(drafts, range(drafts.num_layers), cache)
            assert run(SpeculationConfig(policy=policy, k=4), draft, batch) == plain, (policy, batch, "model")


def test_the_config_key_reaches_the_targets_runners_and_refuses_moe(tmp_path: Path, tiny_models) -> None:
    from actors.engine.loading import load_runners
    from cluster.config import EngineConfig

    path = build_tiny_model("qwen2", tmp_path / "q", hidden_size=128, head_dim=32, intermediate_size=256)
    cfg = EngineConfig.model_validate({"model": {"target": str(path), "dtype": "bf16"}, "deterministic": True,
                                       "speculation": {"policy": "off"}})
    (target,), _ = load_runners(cfg)
    assert target.deterministic and all(layer.attn.deterministic for layer in target.layers)
    assert isinstance(target.lm_head, Tiled) and isinstance(target.layers[0].ffn.down_proj, Tiled)  # dense here
    assert not load_runners(cfg.model_copy(update={"deterministic": False}))[0][0].layers[0].attn.deterministic
    moe = load_model(str(tiny_models["mixtral"]), "fp32")
    with pytest.raises(ValueError, match="mixture-of-experts"):
        ModelRunner(moe, range(moe.num_layers), CacheConfig(block_size=4, num_blocks=16), deterministic=True)
