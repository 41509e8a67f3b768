"""Building our C++ kernels is bounded: a build lock left by a killed process does not hang the next start."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.heavy

SOURCE = "int twice(int x) { return 2 * x; }\n"


def _load(tmp_path: Path, guarded: bool, timeout_s: float) -> subprocess.CompletedProcess | None:
    """Load a one-line extension in a fresh process whose build folder holds a stale torch lock (the `lock` file a
    build killed mid-way leaves behind); None if the process did not end within `timeout_s`."""
    tmp_path.mkdir(parents=True)
    (tmp_path / "twice.cpp").write_text(SOURCE)
    code = textwrap.dedent(f"""
        import contextlib, os
        from torch.utils.cpp_extension import load
        from actors.model.kernel_build import build_lock
        guard = build_lock("specfleet_twice") if {guarded} else contextlib.nullcontext()
        with guard:
            load(name="specfleet_twice", sources=[{str(tmp_path / "twice.cpp")!r}], is_python_module=False)
        print("built")
    """)
    build = tmp_path / "ext" / "specfleet_twice"
    build.mkdir(parents=True)
    (build / "lock").write_text("")  # the stale baton
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "PYTHONPATH": os.getcwd()}
    try:
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout_s,
                              env=env, cwd=os.getcwd())
    except subprocess.TimeoutExpired:
        return None


def test_a_stale_build_lock_is_cleared_under_our_own_lock(tmp_path: Path) -> None:
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        pytest.skip("no ninja: torch's extension builder cannot build anything here")
    out = _load(tmp_path / "guarded", guarded=True, timeout_s=240)
    assert out is not None and out.returncode == 0 and "built" in out.stdout, out and out.stderr[-2000:]
    assert "stale" in out.stderr  # said, not silent
    assert _load(tmp_path / "plain", guarded=False, timeout_s=10) is None  # torch alone waits on it forever


def test_our_lock_is_bounded_in_time(tmp_path: Path) -> None:
    """A live build holding the lock longer than the bound is waited for that long, then TimeoutError (an OSError:
    cpu_kernels falls back to torch's ops with a warning)."""
    from actors.model.file_lock import file_lock

    path = tmp_path / "x.lock"
    with file_lock(path):
        with pytest.raises(TimeoutError, match=str(path)):
            with file_lock(path, timeout_s=0.3):
                pass


def test_the_ninja_package_is_found_without_an_activated_venv(tmp_path: Path) -> None:
    """The `ninja` dependency installs its executable beside the interpreter; a process started without the venv on
    PATH (`.venv/bin/specfleet`, a Ray worker) still finds it, so the kernels build."""
    pytest.importorskip("ninja", reason="the ninja package is not installed here (pip install -e .)")
    code = ("from torch.utils.cpp_extension import is_ninja_available; from actors.model.kernel_build import "
            "ninja_on_path; a = is_ninja_available(); ninja_on_path(); print(a, is_ninja_available())")
    env = {**os.environ, "PATH": str(tmp_path), "PYTHONPATH": os.pathsep.join([os.getcwd()] + sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.split() == ["False", "True"], out.stderr[-2000:]


def test_a_finished_build_loads_without_builder_or_ninja(tmp_path: Path) -> None:
    """The warm path: a build marked done is loaded as a plain library, even from a process that has no ninja and
    whose sources moved (another checkout: torch's builder would rebuild); a marker for another build or torch is
    not trusted (then the caller builds)."""
    from torch.utils.cpp_extension import is_ninja_available

    if not is_ninja_available():
        pytest.skip("no ninja: torch's extension builder cannot build anything here")
    (tmp_path / "twice.cpp").write_text(SOURCE)
    build = textwrap.dedent(f"""
        from pathlib import Path
        from torch.utils.cpp_extension import load
        from actors.model.kernel_build import build_lock, load_built, mark_built
        assert not load_built("specfleet_twice")  # nothing built yet
        with build_lock("specfleet_twice"):
            lib = load(name="specfleet_twice", sources=[{str(tmp_path / "twice.cpp")!r}], is_python_module=False)
            mark_built("specfleet_twice", Path(lib))
        print("built")
    """)
    warm = textwrap.dedent("""
        import sys, torch
        from actors.model.kernel_build import load_built
        print(load_built("specfleet_twice"), load_built("specfleet_other"),
              any("specfleet_twice" in p for p in torch.ops.loaded_libraries))
    """)
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "PYTHONPATH": os.getcwd()}
    out = subprocess.run([sys.executable, "-c", build], capture_output=True, text=True, env=env, timeout=240)
    assert out.returncode == 0 and "built" in out.stdout, out.stderr[-2000:]
    (tmp_path / "twice.cpp").unlink()  # the sources are gone, and no ninja is on PATH: only the library is used
    no_ninja = {**env, "PATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", warm], capture_output=True, text=True, env=no_ninja, timeout=120)
    assert out.stdout.split() == ["True", "False", "True"], out.stderr[-2000:]
    marker = tmp_path / "ext" / "specfleet_twice" / "specfleet-built.json"
    marker.write_text(marker.read_text().replace('"torch": "', '"torch": "0.0-'))  # built against another torch
    out = subprocess.run([sys.executable, "-c", warm], capture_output=True, text=True, env=no_ninja, timeout=120)
    assert out.stdout.split() == ["False", "False", "False"], out.stderr[-2000:]
