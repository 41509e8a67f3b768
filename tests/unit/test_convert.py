"""The GGUF -> safetensors conversion cache: one parse per conversion, no GGUF read when warm, bad entries rebuilt."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import gguf
import pytest
import torch

from actors.model.convert import MANIFEST, CacheEntryInvalid, converted, verify
from actors.model.loader import load_model
from cluster.config import EngineConfig, ModelConfig
from deploy import model_store
from deploy.serve.fleet import resolved


@pytest.fixture
def gguf_copy(tiny_gguf: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny GGUF file (tests below overwrite it)."""
    dst = tmp_path / "src" / tiny_gguf.name
    dst.parent.mkdir()
    shutil.copy2(tiny_gguf, dst)
    return dst


@pytest.fixture
def parses(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every real GGUFReader construction (the full parse of a file), by path: the real reader still runs."""
    seen: list[str] = []
    real_init = gguf.GGUFReader.__init__

    def counting(self, path, *args, **kwargs) -> None:  # noqa: ANN001
        seen.append(str(path))
        real_init(self, path, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFReader, "__init__", counting)
    return seen


def logits(source: str, ids: list[int]) -> torch.Tensor:
    model = load_model(source, "fp32")
    with torch.no_grad():
        return model.hf_model(torch.tensor([ids])).logits  # (1, T, V)


def test_conversion_parses_once_and_a_warm_load_reads_no_gguf(gguf_copy: Path, tmp_path: Path,
                                                               parses: list[str]) -> None:
    cache = tmp_path / "cache"
    folder = converted(gguf_copy, cache, "fp32")
    assert len(parses) == 1, parses
    manifest = json.loads((folder / MANIFEST).read_text())
    assert manifest["meta"]["gguf_parses"] == 1
    assert any(name.endswith(".safetensors") for name in manifest["files"])

    # Overwrite the GGUF with garbage of the same size and mtime: a warm load that read it would fail.
    st = gguf_copy.stat()
    gguf_copy.write_bytes(b"\xde\xad" * (st.st_size // 2) + b"\x00" * (st.st_size % 2))
    os.utime(gguf_copy, ns=(st.st_atime_ns, st.st_mtime_ns))
    again = converted(gguf_copy, cache, "fp32")
    assert again == folder
    assert len(parses) == 1
    model = load_model(str(again), "fp32")
    assert model.config.model_type == "llama" and model.hf_model is not None
    assert len(parses) == 1


def test_converted_folder_loads_like_the_gguf_file(gguf_copy: Path, tmp_path: Path) -> None:
    folder = str(converted(gguf_copy, tmp_path / "cache", "fp32"))
    original, copy = load_model(str(gguf_copy), "fp32"), load_model(folder, "fp32")
    texts = ["hello world", "def f(x):\n    return x + 1"]
    assert [copy.encode(t) for t in texts] == [original.encode(t) for t in texts]
    assert copy.tokenizer.chat_template == original.tokenizer.chat_template
    assert copy.eos_token_ids == original.eos_token_ids
    ids = original.encode(texts[1])
    torch.testing.assert_close(logits(folder, ids), logits(str(gguf_copy), ids), rtol=0, atol=0)


def test_bf16_is_its_own_entry(gguf_copy: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    fp32, bf16 = converted(gguf_copy, cache, "fp32"), converted(gguf_copy, cache, "bf16")
    assert fp32 != bf16
    assert next(load_model(str(bf16), "bf16").hf_model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("damage", ["flip_a_weight_byte", "truncate_weights", "drop_manifest", "drop_tokenizer"])
def test_a_damaged_entry_is_detected_and_rebuilt(gguf_copy: Path, tmp_path: Path, parses: list[str],
                                                 damage: str) -> None:
    cache = tmp_path / "cache"
    folder = converted(gguf_copy, cache, "fp32")
    ids = load_model(str(folder), "fp32").encode("a test of the cache")
    want = logits(str(folder), ids)
    digest = json.loads((folder / MANIFEST).read_text())["meta"]["source_sha256"]
    weights = next(folder.glob("*.safetensors"))
    if damage == "flip_a_weight_byte":
        with open(weights, "r+b") as f:
            f.seek(weights.stat().st_size - 100)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
    elif damage == "truncate_weights":
        os.truncate(weights, weights.stat().st_size // 2)
    elif damage == "drop_manifest":
        (folder / MANIFEST).unlink()  # as if the process died before committing the entry
    else:
        (folder / "tokenizer.json").unlink()
    with pytest.raises(CacheEntryInvalid):
        verify(folder, digest, "fp32")

    rebuilt = converted(gguf_copy, cache, "fp32")
    assert len(parses) == 2  # converted again from the GGUF file, not loaded as it was
    assert verify(rebuilt, digest, "fp32") == rebuilt
    torch.testing.assert_close(logits(str(rebuilt), ids), want, rtol=0, atol=0)


def test_model_store_resolves_a_gguf_to_its_converted_folder(gguf_copy: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECFLEET_MODELS", str(tmp_path / "models"))
    assert model_store.resolve_model(str(gguf_copy)) == str(gguf_copy)  # no dtype: the file itself
    folder = Path(model_store.resolve_model(str(gguf_copy), "fp32"))
    assert folder.parent == model_store.converted_dir()
    assert (folder / "config.json").is_file() and (folder / MANIFEST).is_file()
    with pytest.raises(ValueError, match="dtype"):
        model_store.resolve_model(str(gguf_copy), "fp16")


def test_a_resolved_engine_keeps_the_name_clients_use(gguf_copy: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECFLEET_MODELS", str(tmp_path / "models"))
    engine = resolved(EngineConfig(model=ModelConfig(target=str(gguf_copy), draft_layers=(0,))))
    assert Path(engine.model.target).parent == model_store.converted_dir()
    assert engine.model.served_name == gguf_copy.stem  # not the cache folder's "<sha256>-fp32"
