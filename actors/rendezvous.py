"""Rendezvous for torch.distributed groups that listen only on the addresses their two ends use.

A TCPStore host listens on every interface (`::`) whatever address it is given, and gloo's default device binds
the address the machine's hostname resolves to: anyone who reaches the machine could then connect to a KV link
or a pipeline group while it is open. Here the store's host binds its listening socket to the given address
itself and hands it to the store (`master_listen_fd`), and gloo's pairs bind the address this end reaches the
other one from (`source_address`): 127.0.0.1 for a local cluster, the node's own address across hosts. (NCCL
opens its own bootstrap sockets; NCCL_SOCKET_IFNAME picks their interface.)
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


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
