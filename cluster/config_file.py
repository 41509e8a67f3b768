"""Reading a YAML file and naming what is wrong in it, key by key: shared by the config tree and the inventory."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import yaml
from pydantic import ValidationError


class ConfigError(ValueError):
    """A configuration file or value is wrong; the message names the file and the key."""


def read_yaml(path: str | Path, kind: str) -> object:
    """The parsed content of the YAML file `path` (a `kind` file: "config", "inventory"); a missing file or bad YAML is
    a ConfigError naming it."""
    path = Path(path)
    try:
        return yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such {kind} file") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None


def describe(e: ValidationError, source: str, prefix: str = "", moved: Mapping[str, str] | None = None) -> str:
    """One line per problem, `source: key: what`; `prefix` goes before each key, and a key named in `moved` (an old
    place) that is not allowed any more says where it went."""
    problems = []
    for err in e.errors():
        key = prefix + ".".join(str(p) for p in err["loc"]) or "<root>"
        if err["type"] != "extra_forbidden":
            msg = err["msg"]
        elif moved and key in moved:
            msg = f"moved to {moved[key]}: write it there"
        else:
            msg = "unknown key"
        problems.append(f"{source}: {key}: {msg}")
    return "\n".join(problems)
