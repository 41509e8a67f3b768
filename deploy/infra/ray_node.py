"""Ray kept private: nodes and clients pinned to the address they are given, no client server unless asked, token auth.

Ray turns a loopback address into the machine's network address, both for `ray start --node-ip-address=127.0.0.1`
and for a client's `ray.init(address="127.0.0.1:PORT")` (`ray._private.services.resolve_ip_for_localhost`), and
its GCS, raylets, workers and agents then listen on that network address: anyone who can reach the machine can
join the cluster or run code in it. `keep_address` makes Ray keep the address it was given. The local cluster
(deploy/infra/local_cluster.py) starts each node through this module's `main` (which applies it, then runs Ray's
own `ray start`), and every local client connects through `connect` (which applies it, then calls `ray.init`).

Ray's client server (port 10001 on a head by default) runs arbitrary code for whoever connects: `main` starts a
head without it unless `--client-server` is given. Every cluster runs with Ray token auth (`RAY_AUTH_MODE=token`,
the token in a file of mode 600, `auth_env`), as Ray documents for clusters on a network, and on loopback too:
every user of this machine reaches 127.0.0.1, and a driver runs code as the server's user.

    python -m deploy.infra.ray_node [--client-server] start --block --head ...   # what local_cluster runs
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import sys
from pathlib import Path

AUTH_OFF = {"RAY_AUTH_MODE": "disabled"}


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def keep_address() -> None:
    """Make this process's Ray keep loopback addresses as given (idempotent)."""
    from ray._private import services

    services.resolve_ip_for_localhost = _as_given


def _as_given(host: str) -> str:
    if not host:
        raise ValueError(f"Malformed host: {host}")
    return host


def auth_env(token_path: str | None) -> dict[str, str]:
    """The environment that makes Ray processes and clients use token auth with the token in `token_path` (None:
    auth off)."""
    if token_path is None:
        return dict(AUTH_OFF)
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": token_path}


def new_token(path: Path) -> Path:
    """Write a fresh random token (as `ray get-auth-token --generate` makes) into `path`, readable by its owner only."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def connect(address: str, env: dict[str, str], **init_kwargs) -> None:
    """`ray.init` against a cluster this machine started: its client environment (auth, see local_cluster.client_env)
    in this process's environment, and the loopback address kept."""
    import ray

    os.environ.update(env)
    reload_auth()
    keep_address()
    ray.init(address=address, **init_kwargs)


def reload_auth() -> None:
    """Make this process's Ray read its auth settings (RAY_AUTH_MODE, RAY_AUTH_TOKEN_PATH) from the environment
    again: Ray reads them once, when its config is first loaded, so a process that imported Ray before it knew
    which cluster (and token) it joins would connect with the old ones. The reset Ray's own tests use between
    auth modes (ray/_private/authentication_test_utils.py): the config first, then the token cache."""
    from ray._raylet import AuthenticationTokenLoader, Config

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def main(argv: list[str]) -> int:
    """`ray start` with the address kept, and (without `--client-server`) no Ray client server on a head."""
    client_server = "--client-server" in argv
    args = [a for a in argv if a != "--client-server"]
    keep_address()
    from ray.scripts import scripts

    if not client_server:  # Ray starts it whenever its dependencies are importable; the CLI has no switch
        scripts.get_ray_client_dependency_error = lambda: "off (specfleet cluster up --client-server turns it on)"
    sys.argv = ["ray", *args]
    return scripts.main()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
