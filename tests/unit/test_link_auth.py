"""KV links and pipeline groups prove the cluster's link secret before anything crosses (actors/transport/rendezvous.py): a
peer with the wrong secret gets the link torn down on both ends with a clear error; the right one carries KV. Real
gloo over loopback: a KV channel's two ends in two threads, a pipeline group's two ranks in two processes."""

from __future__ import annotations

import multiprocessing
import threading

import pytest
import torch

from actors.transport import rendezvous
from actors.kv.cache import KVExport
from actors.kv.channel import ChannelError, KVChannel, KVHeader
from actors.transport.p2p import P2P, TransferError, free_address

RIGHT, WRONG = b"r" * 32, b"w" * 32


def open_ends(secrets: tuple[bytes, bytes], timeout_s: float = 10.0) -> dict[int, KVChannel | Exception]:
    """Both ends of a channel, each with its secret: its KVChannel, or the exception its opening raised."""
    address, ends = free_address("127.0.0.1"), {}

    def end(rank: int) -> None:
        try:
            ends[rank] = KVChannel(address, rank, timeout_s, secret=secrets[rank])
        except Exception as e:  # noqa: BLE001 - what the test inspects
            ends[rank] = e

    threads = [threading.Thread(target=end, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return ends


def test_a_kv_link_with_the_right_secret_carries_kv() -> None:
    ends = open_ends((RIGHT, RIGHT))
    assert all(isinstance(e, KVChannel) for e in ends.values()), ends
    sent = [KVExport("r", (0, 1), 0, 4, torch.randn(2, 4, 3, 8), torch.randn(2, 4, 3, 8))]
    sender = threading.Thread(target=ends[0].send, args=(sent,))
    sender.start()
    got = ends[1].recv(tuple(KVHeader.of(e) for e in sent))
    sender.join(10)
    assert torch.equal(got[0].k, sent[0].k) and torch.equal(got[0].v, sent[0].v)


@pytest.mark.parametrize("impostor", [0, 1])
def test_a_kv_link_whose_peer_has_another_secret_is_refused_on_both_ends(impostor: int) -> None:
    """An impostor at either end (one who reached the store's port first, or hosts a store a destination was sent
    to): neither end gets a channel, so no KV is sent or taken in."""
    ends = open_ends((WRONG, RIGHT) if impostor == 0 else (RIGHT, WRONG))
    for rank, e in ends.items():
        assert isinstance(e, ChannelError), (rank, e)
        assert "did not prove the cluster's link secret" in str(e) and "nothing was sent" in str(e)


def _pipeline_rank(address: str, rank: int, secret: bytes, out) -> None:  # noqa: ANN001
    try:
        p2p = P2P(address, rank, 2, timeout_s=20.0, secret=secret)
    except TransferError as e:
        out.put((rank, f"refused: {e}"))
        return
    if rank == 0:
        p2p.send(torch.arange(6.0).reshape(2, 3), 1)
        out.put((rank, "sent"))
    else:
        x, _ = p2p.recv((2, 3), torch.float32, 0)
        out.put((rank, f"got {x.sum().item():g}"))
    p2p.close()


@pytest.mark.heavy  # two spawned processes importing torch: several seconds
@pytest.mark.parametrize("second", [RIGHT, WRONG], ids=["right", "wrong"])
def test_a_pipeline_group_checks_every_rank(second: bytes) -> None:
    ctx = multiprocessing.get_context("spawn")
    out, address = ctx.Queue(), free_address("127.0.0.1")
    procs = [ctx.Process(target=_pipeline_rank, args=(address, r, s, out)) for r, s in ((0, RIGHT), (1, second))]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    if second == RIGHT:
        assert results == {0: "sent", 1: "got 15"}
    else:
        assert all(r.startswith("refused") and "did not prove the cluster's link secret" in r
                   for r in results.values()), results


def test_the_link_secret_is_the_clusters_ray_token_s_not_the_token(tmp_path, monkeypatch) -> None:
    monkeypatch.delenv(rendezvous.LINK_SECRET_ENV, raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    (tmp_path / "a").write_text("a" * 64 + "\n")
    (tmp_path / "b").write_text("b" * 64)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "a"))
    a = rendezvous.link_secret()
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "b"))
    b = rendezvous.link_secret()
    monkeypatch.setenv("RAY_AUTH_TOKEN", "a" * 64)  # KubeRay's pods: the token itself in the environment
    assert rendezvous.link_secret() == a != b and len(a) == 32 and b"a" * 32 not in a
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    assert rendezvous.link_secret() is None
    monkeypatch.setenv(rendezvous.LINK_SECRET_ENV, "operator-chosen")
    assert rendezvous.link_secret() not in (None, a, b)
