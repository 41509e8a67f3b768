"""actors/ is layered: no module imports from a folder above its own (actors.LAYERS), at any depth of the code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import actors

ROOT = Path(actors.__file__).parent
BASE = -1  # the modules at actors/ itself, below every folder


def layer_of(module: str) -> int:
    """The layer of a module under actors (its folder's index in actors.LAYERS; BASE for actors/ itself)."""
    parts = module.split(".")
    if len(parts) == 1 or (ROOT / f"{parts[1]}.py").is_file():
        return BASE
    if parts[1] not in actors.LAYERS:
        raise AssertionError(f"{module}: folder actors/{parts[1]}/ is not in actors.LAYERS; place it in the order")
    return actors.LAYERS.index(parts[1])


def imported(tree: ast.AST, module: str, is_package: bool) -> list[tuple[int, str]]:
    """(line, module) for every import in the tree, top-level or inside a function, relative ones resolved."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(package + ([node.module] if node.module else []))
            found.append((node.lineno, base))
            # `from actors import engine` imports the folder itself
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names
                      if (ROOT.parent / (base + "." + alias.name).replace(".", "/")).is_dir()]
    return found


def upward_imports(source: str, module: str, is_package: bool = False) -> list[str]:
    """Each import in `source` (the text of `module`) of a folder above the module's own, named with its line."""
    own = layer_of(module)
    bad = []
    for line, name in imported(ast.parse(source), module, is_package):
        if name != "actors" and not name.startswith("actors."):
            continue
        if layer_of(name) > own:
            bad.append(f"{module}:{line} imports {name} (layer {actors.LAYERS[layer_of(name)]} is above "
                       f"{'actors/' if own == BASE else actors.LAYERS[own]})")
    return bad


def modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT.parent).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        out.append((".".join(parts), path))
    return out


def test_every_folder_is_placed():
    folders = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").is_file()}
    assert folders == set(actors.LAYERS), "actors.LAYERS must name every folder of actors/, once"
    assert len(actors.LAYERS) == len(set(actors.LAYERS))


def test_no_import_goes_up():
    bad = []
    for module, path in modules():
        bad += upward_imports(path.read_text(), module, path.name == "__init__.py")
    assert not bad, "imports from a higher folder of actors/:\n" + "\n".join(bad)


@pytest.mark.parametrize("source", [
    "from actors.engine.core import Engine\n",  # top level
    "def f():\n    import actors.serving.build\n",  # inside a function
    "from actors import engine\n",  # the folder itself
    "from ..engine import core\n",  # relative
    "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from actors.engine.sequence import EngineSequence\n",
])
def test_an_upward_import_is_named(source):
    """The check can fail: a model module importing the engine (any spelling) is reported with its line."""
    bad = upward_imports(source, "actors.model.runner")
    assert len(bad) == 1 and "actors.model.runner:" in bad[0] and ("engine" in bad[0] or "serving" in bad[0]), bad


def test_downward_and_base_imports_pass():
    assert upward_imports("from actors.kv.cache import KVCache\nfrom actors.start_phases import phase\n"
                          "import actors\nfrom actors.model.layers import MoE\n", "actors.moe.ep") == []
