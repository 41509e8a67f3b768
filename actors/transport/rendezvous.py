"""Rendezvous for torch.distributed groups that listen only on the addresses their two ends use.

A TCPStore host listens on every interface (`::`) whatever address it is given, and gloo's default device binds
the address the machine's hostname resolves to: anyone who reaches the machine could then connect to a KV link
or a pipeline group while it is open. Here the store's host binds its listening socket to the given address
itself and hands it to the store (`master_listen_fd`), and gloo's pairs bind the address this end reaches the
other one from (`source_address`): 127.0.0.1 for a local cluster, the node's own address across hosts. (NCCL
opens its own bootstrap sockets; NCCL_SOCKET_IFNAME picks their interface.)

Binding narrows who can reach a group; it does not say who joined it. So every group proves, right after it
forms and before anything else crosses it, that each of its ranks holds the cluster's link secret (`authenticate`):
each rank draws a fresh 32-byte nonce, the ranks all-gather them, each sends HMAC-SHA256(secret, the transcript
of every nonce and its own rank) and checks every other rank's against the one it computes (hmac.compare_digest).
A rank that cannot prove it (a neighbour who reached the port first, or a process of another cluster) fails the
handshake or its timeout: the caller tears the group down and sends nothing. The secret (`link_secret`) is
derived from Ray's auth token, which every process of the cluster has (token auth is always on: a local cluster's
nodes get RAY_AUTH_TOKEN_PATH, KubeRay's pods RAY_AUTH_TOKEN), or given as SPECFLEET_LINK_SECRET.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
LINK_SECRET_ENV = "SPECFLEET_LINK_SECRET"
_PURPOSE = b"specfleet link secret v1"  # the link secret is the Ray token's HMAC for this purpose, not the token
_NONCE_BYTES = 32


class LinkRefused(RuntimeError):
    """A rank of a new group did not prove the cluster's link secret: the group was torn down, nothing was sent."""


def link_secret() -> bytes | None:
    """This cluster's link secret: SPECFLEET_LINK_SECRET if set, else derived from Ray's auth token as Ray finds it
    (RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, ~/.ray/auth_token) when token auth is on; None otherwise
    (a cluster started with `--auth disabled`: its links are not authenticated, and say so)."""
    if explicit := os.environ.get(LINK_SECRET_ENV):
        return hashlib.sha256(_PURPOSE + explicit.encode()).digest()
    if os.environ.get("RAY_AUTH_MODE", "").lower() != "token":
        return None
    token = os.environ.get("RAY_AUTH_TOKEN", "").strip()
    if not token:
        path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
        token = path.read_text().strip() if path.is_file() else ""
    return hmac.new(token.encode(), _PURPOSE, hashlib.sha256).digest() if token else None


def authenticate(group: dist.ProcessGroup, rank: int, world_size: int, secret: bytes | None, timeout: timedelta,
                 device: torch.device, what: str) -> None:
    """Check that every rank of `group` (just formed, nothing sent yet) holds `secret`; LinkRefused naming `what`
    if one does not, RuntimeError if the exchange fails or times out. With no secret: a warning, no check."""
    if secret is None:
        log.warning("%s is not authenticated: no link secret (Ray token auth is off and %s is not set)",
                    what, LINK_SECRET_ENV)
        return
    nonces = _all_gather(group, torch.frombuffer(bytearray(secrets.token_bytes(_NONCE_BYTES)), dtype=torch.uint8),
                         world_size, timeout, device)
    transcript = b"specfleet link v1|" + world_size.to_bytes(4, "big") + b"".join(nonces)
    mac = lambda r: hmac.new(secret, transcript + r.to_bytes(4, "big"), hashlib.sha256).digest()  # noqa: E731
    macs = _all_gather(group, torch.frombuffer(bytearray(mac(rank)), dtype=torch.uint8), world_size, timeout, device)
    bad = [r for r in range(world_size) if r != rank and not hmac.compare_digest(macs[r], mac(r))]
    if bad:
        raise LinkRefused(f"{what}: rank(s) {bad} did not prove the cluster's link secret; the link is closed and "
                          f"nothing was sent (a process of another cluster, or someone who reached its port)")


def _all_gather(group: dist.ProcessGroup, x: torch.Tensor, world_size: int, timeout: timedelta,
                device: torch.device) -> list[bytes]:
    """Every rank's `x` (a (B,) uint8 tensor), as bytes, in rank order."""
    x = x.to(device)
    out = [torch.empty_like(x) for _ in range(world_size)]
    group.allgather([out], [x]).wait(timeout)
    return [bytes(t.tolist()) for t in out]  # a handshake's few bytes, once per link


def store(host: str, port: int, world_size: int, is_master: bool, timeout: timedelta) -> dist.TCPStore:
    """A TCPStore at host:port; its host (`is_master`) listens on `host` only."""
    if not is_master:
        return dist.TCPStore(host, port, world_size, False, timeout)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
        listener.listen(128)
    except OSError:
        listener.close()
        raise
    # the store owns the socket from here (detach: Python no longer closes it)
    return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=listener.detach())


def source_address(peer_host: str) -> str:
    """The local address this machine reaches `peer_host` from (no packet is sent)."""
    family = socket.AF_INET6 if ":" in peer_host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((peer_host, 9))  # UDP connect only picks the route
        return s.getsockname()[0]


def gloo_options(local_host: str, timeout: timedelta) -> "dist.ProcessGroupGloo._Options":
    """Options for a gloo group whose pairs listen on `local_host` only."""
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=local_host)]
    return options
