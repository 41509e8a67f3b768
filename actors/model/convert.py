"""Convert a GGUF checkpoint once into a verified safetensors folder (config, tokenizer, generation config).

Loading a GGUF file through transformers dequantizes every tensor and parses the file's metadata four times
(config twice, tokenizer, weights); a safetensors folder loads by memory mapping. `converted()` turns a GGUF
file into such a folder the first time it is asked for, in a cache keyed by the file's sha256 and the dtype,
and returns the folder on every later call without reading the GGUF file again.

A cache entry is trusted only when its manifest (written last, inside the temporary folder that is renamed
into place) lists every file with the size and sha256 that are on disk; anything else (a partial copy, a
truncated or flipped file, a missing manifest) is removed and rebuilt. The entry is keyed by the sha256 of the
GGUF file's content (a catalog file's, verified when it was fetched: deploy/model_store.py), so an entry made
from a damaged file is never the one a repaired file finds. Checking an entry and building it happen under
the entry's lock, so no process loads an entry another is replacing. The cache location is given by the
caller (deploy/model_store.py), so this module knows nothing of where models are stored.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from actors.model.file_lock import file_lock

log = logging.getLogger(__name__)

MANIFEST = "specfleet-manifest.json"
FORMAT = 2  # bump when the folder layout changes: older entries are then rebuilt (2: sha256 in the manifest)
_CHUNK = 16 << 20  # bytes per read while checksumming
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class CacheEntryInvalid(Exception):
    """A cache entry that must not be loaded; the message says why (it is rebuilt)."""


def converted(gguf: Path, cache_root: Path, dtype: str, sha256: str | None = None) -> Path:
    """The safetensors folder of `gguf` in `dtype` under `cache_root`, converting it on first use.

    `sha256` is the file's verified checksum (a catalog file's, deploy/model_store.py); without it the file is
    hashed, once per (path, size, mtime) thanks to a small memo under `cache_root`. Concurrent callers serialise
    on the entry's lock file, so one process converts and the others then load its result.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    gguf = Path(gguf).expanduser().resolve()
    cache_root.mkdir(parents=True, exist_ok=True)
    digest = sha256 or file_sha256(gguf, cache_root / "digests")
    key = f"{digest[:32]}-{dtype}"
    dest = cache_root / key
    with file_lock(cache_root / f".{key}.lock"):
        try:
            return verify(dest, digest, dtype)  # converted before, or by another process while we waited
        except CacheEntryInvalid as why:
            if dest.exists():
                log.warning("conversion cache %s is invalid (%s): rebuilding it", dest, why)
                shutil.rmtree(dest)
        tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cache_root))
        tmp.chmod(0o755)  # mkdtemp makes it 0700; the cache may be shared by users of one machine
        try:
            t0 = time.perf_counter()
            parses = convert_gguf(gguf, tmp, dtype)
            write_manifest(tmp, {"format": FORMAT, "source": str(gguf), "source_sha256": digest, "dtype": dtype,
                                 "gguf_parses": parses, "convert_s": round(time.perf_counter() - t0, 2)})
            os.rename(tmp, dest)  # atomic: a reader sees no entry or a complete one
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        return verify(dest, digest, dtype)


def convert_gguf(gguf: Path, out: Path, dtype: str) -> int:
    """Write `gguf`'s model (weights in `dtype`, safetensors), config, tokenizer and generation config into
    `out`; returns how many times the GGUF file was parsed (1)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    where, name = str(gguf.parent), gguf.name
    with _one_parse(gguf) as parses:
        config = AutoConfig.from_pretrained(where, gguf_file=name)
        tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(where, gguf_file=name, config=config, dtype=DTYPES[dtype])
    if hasattr(model.config, "quantization_config"):  # the GGUF loader's marker: the folder is plain weights
        del model.config.quantization_config
    model.config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    save_weights(model.state_dict(), out)
    return parses[0]


def save_weights(state: dict[str, torch.Tensor], out: Path, shard_bytes: int = 1 << 30) -> None:
    """Write `state` as safetensors shards of about `shard_bytes` with transformers' index file.

    A tensor sharing storage with an earlier one (tied embeddings) is left out: the model re-ties it on load.
    """
    from safetensors.torch import save_file

    seen: set[tuple[int, int]] = set()
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        ident = (t.untyped_storage().data_ptr(), t.storage_offset())
        if ident in seen:
            continue
        seen.add(ident)
        if size and size + t.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += t.nbytes
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.nbytes for shard in shards for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def verify(entry: Path, sha256: str, dtype: str) -> Path:
    """`entry` if its manifest matches what was asked and every listed file has its size and sha256;
    CacheEntryInvalid otherwise."""
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
    except FileNotFoundError:
        raise CacheEntryInvalid("no manifest" if entry.exists() else "absent") from None
    except (OSError, ValueError) as e:
        raise CacheEntryInvalid(f"unreadable manifest: {e}") from None
    meta = manifest.get("meta", {})
    if (meta.get("format"), meta.get("source_sha256"), meta.get("dtype")) != (FORMAT, sha256, dtype):
        raise CacheEntryInvalid(f"manifest is for {meta}, not format {FORMAT}, sha256 {sha256}, {dtype}")
    files = manifest.get("files", {})
    for rel, want in files.items():
        size = (entry / rel).stat().st_size if (entry / rel).is_file() else None
        if size != want["size"]:
            raise CacheEntryInvalid(f"{rel}: {size} bytes on disk, manifest says {want['size']}")
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:  # hashlib releases the GIL
        sums = dict(zip(files, pool.map(lambda rel: _sha256(entry / rel), files)))
    bad = [rel for rel, want in files.items() if sums[rel] != want.get("sha256")]
    if bad:
        raise CacheEntryInvalid(f"checksum mismatch in {', '.join(bad)}")
    return entry


def write_manifest(folder: Path, meta: dict) -> None:
    """List every file of `folder` with its size and sha256, written last (the entry's commit record)."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
    listing = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps({"meta": meta, "files": listing}, indent=1))


def file_sha256(path: Path, memo_dir: Path) -> str:
    """sha256 of `path`, remembered per (resolved path, size, mtime, inode) so a file is hashed once."""
    st = path.stat()
    ident = f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}"
    memo = memo_dir / hashlib.sha256(ident.encode()).hexdigest()[:32]
    with contextlib.suppress(OSError):
        known = memo.read_text().strip()
        if len(known) == 64:
            return known
    digest = _sha256(path)
    memo_dir.mkdir(parents=True, exist_ok=True)
    tmp = memo.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(digest)
    os.replace(tmp, memo)
    return digest


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _one_parse(gguf: Path) -> Iterator[list[int]]:
    """While open, every `gguf.GGUFReader(gguf)` that transformers makes returns one shared reader, so
    the config, the tokenizer and the weights come from a single parse. Yields [number of parses]."""
    import gguf as gguf_pkg

    real = gguf_pkg.GGUFReader
    readers: dict[str, object] = {}
    parses = [0]

    def shared(path, *args, **kwargs):  # noqa: ANN001, ANN202 - GGUFReader's own signature
        key = str(Path(path).resolve())
        if key != str(gguf) or args or kwargs:
            return real(path, *args, **kwargs)
        if key not in readers:
            readers[key] = real(path)
            parses[0] += 1
        return readers[key]

    gguf_pkg.GGUFReader = shared
    try:
        yield parses
    finally:
        gguf_pkg.GGUFReader = real
