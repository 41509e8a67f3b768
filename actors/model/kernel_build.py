"""One build of a C++ extension at a time per machine, bounded in time, and never stuck on a dead build's lock.

torch's extension builder (torch.utils.cpp_extension.load) marks a build in progress with a `lock` file in the
build folder and makes every other loader wait, without a time limit, until that file is gone; a build killed
mid-way (a pod evicted, a ^C) leaves the file behind, and every later start waits forever. `build_lock` takes our
own flock beside the folder first: the kernel drops a flock with its holder, so whoever holds ours knows no live
process of ours is building, and a `lock` file still there is stale: it is removed, with a warning.

The builder runs `ninja` from PATH; the package's dependency (PyPI's `ninja`) installs it beside the interpreter,
which is not on PATH when the venv is not activated (`.venv/bin/specfleet`, Ray's workers): `ninja_on_path` adds
the package's folder where no `ninja` is found.

Built once per machine, loaded at every start: torch's `load` hashes the sources and runs `ninja` at every call, and
`ninja` rebuilds whenever the build's command line changed, which it does when the same sources are loaded from
another folder (another checkout or worktree of the project, another venv): a start then took 66 s on 2 cores
instead of 0.1 s. Our build's name already holds the digest of its sources, headers and flags
(cpu_kernels.build_id), so once a build finished, `mark_built` records it beside the library (with the torch
version it was built against) and later starts `load_built` the library directly, with no hash, no lock and no
ninja: a plain `dlopen`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch

from actors.model.file_lock import file_lock

log = logging.getLogger(__name__)

BUILD_TIMEOUT_S = 900.0  # how long a start waits for another process's build (ours take minutes on 2 cores)


def ninja_on_path() -> None:
    """Put the `ninja` package's executable on this process's PATH if PATH has none (a no-op where it has one, or
    where the package is not installed)."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR] + [p for p in [os.environ.get("PATH")] if p])


def build_folder(name: str) -> Path:
    """Where torch builds the extension `name` (its TORCH_EXTENSIONS_DIR, or its per-Python, per-accelerator
    folder under its cache), created if missing."""
    from torch.utils.cpp_extension import _get_build_directory  # torch's own rule; no public equivalent

    return Path(_get_build_directory(name, verbose=False))


@contextlib.contextmanager
def build_lock(name: str, timeout_s: float = BUILD_TIMEOUT_S) -> Iterator[None]:
    """Hold the build of `name` (wrap torch's `load` in it): TimeoutError (an OSError) if another process builds it
    for longer than `timeout_s`; a stale torch lock file found under our lock is removed."""
    folder = build_folder(name)
    with file_lock(folder.parent / f".{name}.specfleet-build.lock", timeout_s=timeout_s):
        stale = folder / "lock"
        if stale.exists():
            log.warning("removing a stale build lock %s (left by a build that did not finish)", stale)
            stale.unlink(missing_ok=True)
        yield


MARKER = "specfleet-built.json"  # beside a finished build's library: what it was built from


def _marker(build: str) -> dict:
    return {"build": build, "torch": torch.__version__}


def mark_built(build: str, library: Path) -> None:
    """Record that `library` is the finished build `build` (written atomically, after the library is whole)."""
    folder = library.parent
    tmp = folder / f".{MARKER}.{os.getpid()}"
    tmp.write_text(json.dumps({**_marker(build), "library": library.name}))
    os.replace(tmp, folder / MARKER)


def load_built(build: str) -> bool:
    """Load the finished build `build` (`torch.ops.load_library`) if one is marked for this torch; False where there
    is none (or its marker or library is missing or damaged: the caller builds it)."""
    folder = build_folder(build)
    try:
        marked = json.loads((folder / MARKER).read_text())
        library = folder / marked["library"]
        if {k: marked.get(k) for k in ("build", "torch")} != _marker(build) or not library.is_file():
            return False
    except (OSError, ValueError, KeyError, TypeError):
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError as e:  # a library truncated on disk: build it again
        log.warning("the built kernels %s did not load (%s); building them again", library, e)
        return False
    return True
