"""API keys: the sets of keys that open `/v1` (and gRPC) and `/admin`, each key with its tenant, and a constant-time check.

Keys come from the config, environment variables and files (cluster/config.py, AuthConfig). They are held only
here and never logged: errors name where keys were looked for, never a key. A key's `Tenant` carries its name
(the config's name for a key of `keys`, else `key-` and a prefix of the key's sha256, which does not reveal it)
and its limits (deploy/serve/admission.py).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from cluster.config import AuthConfig, KeyLimits

ANONYMOUS = "anonymous"  # the tenant of every request when no keys are required and none are set


@dataclass(frozen=True)
class Tenant:
    """Who a request comes from, as far as limits and caches are concerned."""

    name: str
    limits: KeyLimits


class KeySet:
    """A set of accepted keys, each with its tenant; `match` compares in constant time against each."""

    def __init__(self, keys: dict[str, Tenant], source: str, required: bool = True,
                 default: KeyLimits = KeyLimits()) -> None:
        self._keys = tuple(sorted((k.encode(), t) for k, t in keys.items() if k))
        self.source = source  # where the keys came from, for messages
        self.required = required  # an empty set refuses everything, unless keys are not required
        self._anonymous = Tenant(ANONYMOUS, default)

    @classmethod
    def load(cls, cfg: AuthConfig, admin: bool = False) -> "KeySet":
        env = cfg.admin_keys_env if admin else cfg.api_keys_env
        file = cfg.admin_keys_file if admin else cfg.api_keys_file
        keys = set(listed_keys(cfg, admin))
        tenants = {k: Tenant(_anonymous_name(k), cfg.limits) for k in keys}
        sources = [f"${env}"] + ([file] if file else [])
        if not admin:
            for entry in cfg.keys:  # named keys with their own limits
                found = ([os.environ.get(entry.key_env, "").strip()] if entry.key_env
                         else _read_keys(entry.key_file, f"key {entry.name!r}")[:1])
                if not found or not found[0]:
                    raise ValueError(f"key {entry.name!r}: no key in {'$' + entry.key_env if entry.key_env else entry.key_file}")
                limits = KeyLimits(**entry.model_dump(include=set(KeyLimits.model_fields)))
                tenants[found[0]] = Tenant(entry.name, limits)
                sources.append(entry.name)
        return cls(tenants, "config, " + ", ".join(sources), cfg.required, cfg.limits)

    def __len__(self) -> int:
        return len(self._keys)

    def match(self, authorization: str | None) -> Tenant | None:
        """The tenant of an `Authorization: Bearer KEY` header (or gRPC metadata value), or None if no key is
        accepted; with no keys at all and `required` off, anything passes as the anonymous tenant."""
        if not self._keys and not self.required:
            return self._anonymous
        if not authorization or not authorization.startswith("Bearer "):
            return None
        given = authorization[len("Bearer "):].strip().encode()
        found = None
        for key, tenant in self._keys:  # no early exit: the time taken does not tell which key matched
            if hmac.compare_digest(given, key):
                found = tenant
        return found

    def check(self, authorization: str | None) -> bool:
        return self.match(authorization) is not None


class KeyFileError(ValueError):
    """A key file the config names cannot be read."""


class KeyFileExposed(KeyFileError):
    """A key file other users may read or write (refused by the app and the CLI alike)."""


def listed_keys(cfg: AuthConfig, admin: bool = False) -> Iterator[str]:
    """The keys of the API set (or the admin set) that `cfg` lists without a name, in lookup order: the environment
    variable's (comma-separated), the config's own, then the key file's (one a line, or commas; read only when
    reached, KeyFileError if it cannot be). The app accepts them all (KeySet.load); the CLI sends the first."""
    env = cfg.admin_keys_env if admin else cfg.api_keys_env
    yield from (k.strip() for k in os.environ.get(env, "").split(",") if k.strip())
    yield from (k.get_secret_value() for k in (cfg.admin_keys if admin else cfg.api_keys))
    file = cfg.admin_keys_file if admin else cfg.api_keys_file
    if file:
        yield from _read_keys(file, "admin" if admin else "API")


def read_key_file(file: str, what: str) -> list[str]:
    """The keys of a key file (one a line, or commas); KeyFileError if it cannot be read or others may read it."""
    return _read_keys(file, what)


def _read_keys(file: str, what: str) -> list[str]:
    path = Path(file).expanduser()
    try:
        _check_private(path, what)
        text = path.read_text()
    except OSError as e:
        raise KeyFileError(f"cannot read the {what} key file {file}: {e.strerror}") from None
    return [k.strip() for k in text.replace(",", "\n").splitlines() if k.strip()]  # one per line, or commas


def _check_private(path: Path, what: str) -> None:
    """KeyFileError if users other than the file's owner may read or write it (mode wider than 0600), as ssh refuses
    such a private key. Group read is allowed on a file someone else owns: a Kubernetes Secret mounted read-only
    (root's, mode 0440, readable by the pod's fsGroup: docs/security.md)."""
    st = path.stat()
    loose = st.st_mode & 0o077
    if st.st_uid != os.getuid():
        loose &= ~0o040
    if loose:
        raise KeyFileExposed(f"the {what} key file {path} has mode {st.st_mode & 0o777:o}: other users of this machine "
                           f"may read or change it; run `chmod 600 {path}` (and make new keys if others read it)")


def _anonymous_name(key: str) -> str:
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:12]
