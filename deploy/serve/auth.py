"""API keys: the sets of keys that open `/v1` (and gRPC) and `/admin`, and a constant-time check.

Keys come from the config, an environment variable and a file (cluster/config.py, AuthConfig). They are
held as SecretStr and never logged: errors name where keys were looked for, never a key.
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from cluster.config import AuthConfig


class KeySet:
    """A set of accepted keys; `check` compares in constant time against each."""

    def __init__(self, keys: set[str], source: str, required: bool = True) -> None:
        self._keys = tuple(sorted(k for k in keys if k))
        self.source = source  # where the keys came from, for messages
        self.required = required  # an empty set refuses everything, unless keys are not required

    @classmethod
    def load(cls, cfg: AuthConfig, admin: bool = False) -> "KeySet":
        literal = cfg.admin_keys if admin else cfg.api_keys
        env = cfg.admin_keys_env if admin else cfg.api_keys_env
        file = cfg.admin_keys_file if admin else cfg.api_keys_file
        keys = {k.get_secret_value() for k in literal}
        keys |= {k.strip() for k in os.environ.get(env, "").split(",") if k.strip()}
        if file:
            try:
                keys |= {line.strip() for line in Path(file).expanduser().read_text().splitlines() if line.strip()}
            except OSError as e:
                raise ValueError(f"cannot read the {'admin' if admin else 'API'} key file {file}: {e.strerror}") from None
        return cls(keys, f"config, ${env}" + (f", {file}" if file else ""), cfg.required)

    def __len__(self) -> int:
        return len(self._keys)

    def check(self, authorization: str | None) -> bool:
        """Whether an `Authorization: Bearer KEY` header (or gRPC metadata value) carries an accepted key; with
        no keys at all and `required` off, anything passes."""
        if not self._keys and not self.required:
            return True
        if not authorization or not authorization.startswith("Bearer "):
            return False
        given = authorization[len("Bearer "):].strip().encode()
        ok = False
        for key in self._keys:  # no early exit: the time taken does not tell which key matched
            ok |= hmac.compare_digest(given, key.encode())
        return ok
