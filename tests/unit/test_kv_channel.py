"""The KV channel of a migration (actors/kv/channel.py): two ends in two threads of this process, over real gloo."""

from __future__ import annotations

import threading
import time

import psutil
import pytest
import torch

from actors.kv.cache import KVExport
from actors.kv.channel import ChannelError, KVChannel, KVHeader
from actors.transport.p2p import free_address
from cluster.migration import channel_backend


def exports(n: int) -> list[KVExport]:
    g = torch.Generator().manual_seed(n)
    return [KVExport("r", (i, i + 1), 4 * i, 4 * i + 4, torch.randn(2, 4, 3, 8, generator=g),
                     torch.randn(2, 4, 3, 8, generator=g)) for i in range(n)]


def open_pair(timeout_s: float = 10.0) -> tuple[KVChannel, KVChannel]:
    address, ends = free_address("127.0.0.1"), {}
    threads = [threading.Thread(target=lambda r=r: ends.__setitem__(r, KVChannel(address, r, timeout_s)))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return ends[0], ends[1]


def test_exports_arrive_whole_and_in_order() -> None:
    src, dst = open_pair()
    sent = exports(3)
    sender = threading.Thread(target=src.send, args=(sent,))
    sender.start()
    got = dst.recv(tuple(KVHeader.of(e) for e in sent))
    sender.join(10)
    assert [(e.layer_ids, e.start, e.end) for e in got] == [(e.layer_ids, e.start, e.end) for e in sent]
    assert all(torch.equal(a.k, b.k) and torch.equal(a.v, b.v) for a, b in zip(got, sent))
    assert KVHeader.of(sent[0]).dtype == "float32" and got[0].k.dtype == torch.float32


def test_a_peer_that_never_comes_fails_within_the_timeout() -> None:
    t0 = time.monotonic()
    with pytest.raises(ChannelError, match="opening the KV channel"):
        KVChannel(free_address("127.0.0.1"), 1, timeout_s=2.0)
    assert time.monotonic() - t0 < 20


def test_a_receive_with_no_sender_times_out() -> None:
    _, dst = open_pair(timeout_s=2.0)
    with pytest.raises(ChannelError, match="receive failed"):
        dst.recv((KVHeader.of(exports(1)[0]),))


@pytest.mark.parametrize(("src", "dst", "backend"), [("cuda", "cuda", "nccl"), ("cuda", "cpu", "gloo"),
                                                     ("cpu", "cuda", "gloo"), ("cpu", "cpu", "gloo")])
def test_nccl_carries_the_kv_only_between_two_gpu_instances(src: str, dst: str, backend: str) -> None:
    assert channel_backend([src, dst]) == backend


def test_an_unknown_backend_is_refused_before_anything_opens() -> None:
    with pytest.raises(ChannelError, match="unknown KV channel backend 'mpi'"):
        KVChannel(free_address("127.0.0.1"), 0, timeout_s=1.0, backend="mpi")


def test_gloo_carries_host_tensors_without_a_copy() -> None:
    src, dst = open_pair()
    assert src.wire == dst.wire == torch.device("cpu")


def test_a_channel_listens_only_on_the_address_its_two_ends_use() -> None:
    def listening() -> set[tuple[str, int]]:
        return {(c.laddr.ip, c.laddr.port) for c in psutil.Process().net_connections("inet")
                if c.status == psutil.CONN_LISTEN}

    before = listening()
    src, dst = open_pair()  # the rendezvous store (rank 0) and gloo's pairs (both ranks) listen while it is open
    opened = listening() - before
    assert opened, "the channel opened no listening socket"
    assert {ip for ip, _ in opened} <= {"127.0.0.1", "::ffff:127.0.0.1"}, opened  # never :: or 0.0.0.0
    sent = exports(1)
    sender = threading.Thread(target=src.send, args=(sent,))
    sender.start()
    assert torch.equal(dst.recv((KVHeader.of(sent[0]),))[0].k, sent[0].k)
    sender.join(10)
