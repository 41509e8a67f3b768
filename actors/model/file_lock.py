"""An exclusive lock on a file across processes (fcntl.flock), for caches that several processes fill.

The kernel drops a flock when its holder exits, killed or not, so a lock never outlives a dead process (unlike a
lock *file*, such as torch's extension-build baton: actors/model/kernel_build.py).
"""

from __future__ import annotations

import contextlib
import fcntl
import time
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def file_lock(lock_path: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Hold an exclusive lock on `lock_path` (created if missing) for the duration of the block; TimeoutError if
    another process holds it for longer than `timeout_s` (None: wait as long as it takes)."""
    with open(lock_path, "a") as f:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | (0 if deadline is None else fcntl.LOCK_NB))
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{lock_path} is held by another process for over {timeout_s:g} s") from None
                time.sleep(0.1)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
