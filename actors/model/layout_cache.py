"""Our CPU kernels' weight layout kept on disk: a GGUF model's matrices packed once per machine, memory-mapped after.

With `weights: stored` every linear map of a GGUF model is decoded from the file's blocks and packed into the layout
our int4 kernel reads (cpu_kernels.pack: nibbles interleaved per 16-row block, scales side by side): the default
app's model spent most of its start there (docs/benchmarks.md, issue 40). The packing is a pure function of the
file's blocks, so it is done once: the packed operands of each fused projection are written to one safetensors
file beside the GGUF file (`NAME.gguf.layout-DIGEST.safetensors`), and later starts map that file and hand its
tensors to the kernel as they are (Int4Linear.from_packed): no decoding, no packing, no copy. The digest names the
file's size and mtime and the layout's FORMAT (bumped whenever `pack` changes what it writes), so a replaced
file or a new layout gets a new cache, never a stale one; delete the files to pack again.

Only projections computed on our kernel are kept (those a CPU without it computes another way are built as before),
and the cache is written after a runner's layers are built (`flush`), atomically (a temporary file renamed into
place): a reader sees the previous file or the new one, whole.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from actors.model import cpu_kernels

log = logging.getLogger(__name__)

FORMAT = 1  # bump when cpu_kernels.pack (or what Int4Linear keeps of it) changes
FIELDS = ("weight", "scale", "offset", "scale_mult", "offset_mult")  # Int4Linear's packed operands


class LayoutCache:
    """The packed projections of one GGUF file: `get` those saved by an earlier start, `keep` new ones, `flush`."""

    def __init__(self, gguf: Path) -> None:
        st = gguf.stat()
        ident = json.dumps([FORMAT, cpu_kernels.ROWS, cpu_kernels.GROUP, st.st_size, st.st_mtime_ns])
        self.path = gguf.with_name(f"{gguf.name}.layout-{hashlib.sha256(ident.encode()).hexdigest()[:12]}"
                                   ".safetensors")
        self._saved: dict[str, list[dict]] | None = None  # key -> each module's shape and operands, read lazily
        self._new: dict[str, list[dict]] = {}

    def get(self, key: str) -> list[dict] | None:
        """The packed modules of projection `key` (each: out_features, in_features, planes, group and the operands
        in FIELDS, None for an absent one), or None if this projection was not kept."""
        if self._saved is None:
            self._saved = self._read()
        return self._new.get(key) or self._saved.get(key)

    def keep(self, key: str, modules: list[dict]) -> None:
        self._new[key] = modules

    def flush(self) -> None:
        """Write what was kept since the last flush, with what the file held (nothing to write: no file touched)."""
        if not self._new:
            return
        everything = {**(self._saved if self._saved is not None else self._read()), **self._new}
        tensors, meta = {}, {}
        for key, modules in everything.items():
            meta[key] = []
            for i, m in enumerate(modules):
                present = [f for f in FIELDS if m[f] is not None]
                meta[key].append({k: m[k] for k in ("out_features", "in_features", "planes", "group")} |
                                 {"fields": present})
                tensors.update({f"{key}/{i}/{f}": m[f].contiguous() for f in present})
        from safetensors.torch import save_file

        fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}-", dir=self.path.parent)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"specfleet-layout": json.dumps(meta)})
            os.chmod(tmp, 0o644)  # as the model file beside it (mkstemp makes it private)
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        log.info("packed weights kept for the next start: %s (%d projections)", self.path, len(everything))
        self._saved, self._new = None, {}  # read back (mapped) at the next get

    def _read(self) -> dict[str, list[dict]]:
        """The file's projections, their tensors memory-mapped; {} without a usable file (a damaged one is said)."""
        if not self.path.is_file():
            return {}
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(self.path), framework="pt") as f:
                meta = json.loads(f.metadata()["specfleet-layout"])
                return {key: [{k: m[k] for k in ("out_features", "in_features", "planes", "group")} |
                              {field: f.get_tensor(f"{key}/{i}/{field}") if field in m["fields"] else None
                               for field in FIELDS}
                              for i, m in enumerate(modules)]
                        for key, modules in meta.items()}
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, SafetensorError) as e:
            log.warning("packed weights %s are not usable (%s): packing again", self.path, e)
            return {}
