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
