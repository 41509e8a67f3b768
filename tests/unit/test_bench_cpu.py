"""`specfleet bench cpu`'s table (deploy/bench/cpu.py): each row held to the llama.cpp build of its own ISA, each
speculative row (ours or llama.cpp's prompt lookup) to its own plain row; the AVX2 anchor's child needs its build."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.config import SpeculationConfig
from deploy.bench.cpu import Row, Setup, _isa_tag, _own_plain_name, _report
from deploy.bench.llama_anchor import AnchorError, LlamaCppProcess

SETUP = Setup("smollm2-135m-instruct", None, SpeculationConfig(method="ngram", policy="goodput", k=4), "none")


def row(name: str, tokens: int, seconds: float, outputs: list[list[int]]) -> Row:
    r = Row(name, lambda prompts, n: ([], None))  # type: ignore[arg-type, return-value]
    r.tokens, r.seconds, r.outputs = tokens, seconds, outputs
    return r


@pytest.mark.parametrize(("name", "tag", "plain"), [
    ("plain stored", "", None), ("spec stored, draft int4", "", "plain stored"),
    ("spec stored [avx2], draft int4", " [avx2]", "plain stored [avx2]"),
    ("llama.cpp lookup [avx2]", " [avx2]", "llama.cpp plain [avx2]"), ("llama.cpp plain", "", None)])
def test_a_rows_isa_and_own_plain_row_come_from_its_name(name: str, tag: str, plain: str | None) -> None:
    assert _isa_tag(name) == tag and _own_plain_name(name) == plain


def test_rows_are_held_to_the_llama_cpp_build_of_their_own_isa() -> None:
    rows = [row("llama.cpp plain", 100, 1.0, [[1, 2, 3]]), row("llama.cpp lookup", 150, 1.0, [[1, 2, 3]]),
            row("llama.cpp plain [avx2]", 50, 1.0, [[1, 2, 3]]), row("plain stored", 80, 1.0, [[1, 2, 4]]),
            row("spec stored", 120, 1.0, [[1, 2, 5]]), row("plain stored [avx2]", 40, 1.0, [[1, 2, 4]]),
            row("plain stored [torch]", 20, 1.0, [[7, 2, 4]])]
    out = _report(SETUP, rows, None)["rows"]
    assert out["plain stored"]["vs_llama_cpp"] == 0.8  # the installed (native) build
    assert out["plain stored [avx2]"]["vs_llama_cpp"] == 0.8  # the AVX2 build's 50 tok/s, not the native 100
    assert out["plain stored [torch]"]["vs_llama_cpp"] == 0.2  # no torch build of llama.cpp: the native one
    assert out["llama.cpp lookup"]["vs_own_plain"] == 1.5 and out["llama.cpp lookup"]["identical_to_own_plain"] == 1
    assert out["spec stored"]["vs_own_plain"] == 1.5 and out["spec stored"]["identical_to_own_plain"] == 0
    assert out["llama.cpp plain"]["vs_own_plain"] is None


def test_without_dequantized_rows_the_report_has_no_stored_vs_dequantized() -> None:
    report = _report(SETUP, [row("plain stored", 10, 1.0, [[1]])], None)
    assert "stored_vs_dequantized" not in report and report["rows"]["plain stored"]["vs_llama_cpp"] is None


def test_the_avx2_anchor_needs_a_built_library(tmp_path: Path) -> None:
    with pytest.raises(AnchorError, match=f"no libllama.so in {tmp_path}"):
        LlamaCppProcess(tmp_path, tmp_path / "m.gguf", threads=1, n_ctx=64)


@pytest.mark.heavy  # a tiny GGUF model loaded once per ISA path, a 300-token prefill on each
def test_time_to_first_token_prefills_the_same_ids_on_every_isa_path(tmp_path: Path) -> None:
    import gguf

    from actors.model import cpu_kernels
    from actors.model.loader import load_model
    from deploy.bench.cpu import _long_prompt, _ttft
    from deploy.bench.prompts import DATASETS, load_prompts
    from deploy.cli.flags import UsageError
    from tests.fixtures.tiny_models import build_tiny_model, write_tiny_gguf

    src = build_tiny_model("llama", tmp_path / "llama", max_position_embeddings=1024)
    path = str(write_tiny_gguf(src, tmp_path / "tiny.gguf", {"weight": gguf.GGMLQuantizationType.Q4_0}))
    isas = list(dict.fromkeys([cpu_kernels.isa(), "torch"]))  # this CPU's path, then torch's ops
    models = {}
    for isa in isas:
        with cpu_kernels.forced(isa):
            models[isa] = load_model(path, "bf16", weights="stored")
    model = models[isas[0]]
    prompt = _long_prompt(model, 300)
    first = model.encode(load_prompts([DATASETS / "mt_bench_questions.jsonl"], 1)[0], chat=False)
    assert len(prompt) == 300 and prompt[:min(len(first), 300)] == first[:300]
    with pytest.raises(UsageError, match="--ttft-tokens asked for 10000000"):
        _long_prompt(model, 10_000_000)
    out = _ttft(prompt, models, {})
    assert list(out) == [f"ours [{isa}]" for isa in isas]
    assert all(r["seconds"] > 0 and r["prefill_tok_s"] > 0 and r["x_llama_cpp"] is None for r in out.values())
    assert all(0 <= r["first_token"] < model.config.vocab_size for r in out.values())


def test_the_kernel_tables_extra_row_is_the_slope_at_the_largest_count_over_its_mean_row() -> None:
    from deploy.bench.kernels import extra_row_ratio

    assert extra_row_ratio({1: 10.0, 8: 80.0, 16: 160.0}) == pytest.approx(1.0)  # linear in rows: a row is a row
    assert extra_row_ratio({1: 60.0, 8: 60.0, 16: 60.0}) == pytest.approx(0.0)  # flat (memory-bound): rows are free
    # from 8 to 16 rows: 8 us a row, against 192 / 16 = 12 us the mean row at 16 (the counts below 8 do not matter)
    assert extra_row_ratio({1: 50.0, 8: 128.0, 16: 192.0}) == pytest.approx(8 / 12)
    assert extra_row_ratio({5: 40.0}) is None
