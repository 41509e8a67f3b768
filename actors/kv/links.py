"""A migration's KV going stage to stage: each process's ends of the links (KVPorts) and what crosses them.

A migration (cluster/migration.py) opens one link per pair of a source stage and a destination stage that
share layers (`plan_links`): a two-rank KVChannel (actors/kv/channel.py) between the processes that hold the
two stages' caches (shard actors, or an instance's own process for the stages it runs itself). A source stage
copies a token range out of its cache, cuts it by link, and hands each part to that link's sender thread (so
the step loop goes on at once); the coordinator carries only the parts' headers (LinkedKV). A destination
stage receives its parts into a mailbox off its step loop, then, between two steps, takes them, joins them
into its own layers and writes them into its cache.

    ports = KVPorts()
    ports.open(links, Side.SRC, timeout_s=10, backend="gloo")    # both ends at once
    parts = send_stage(cache, ports, "r0", 0, 256, my_links)      # source
    ports.receive(parts); import_stage(cache, ports, ...)         # destination
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from actors.kv.cache import KVCache, KVExport, reshard
from actors.kv.channel import ChannelError, KVChannel, KVHeader
from cluster.migration_messages import Link, Side

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkPart:
    """What one link carried of a token range: the source stage's KV of the layers it shares with `dst`."""

    link_id: str
    src: int
    dst: int
    header: KVHeader


@dataclass(frozen=True)
class LinkedKV:
    """A token range of a request's KV that went stage to stage: the coordinator carries this instead of tensors."""

    request_id: str
    start: int
    end: int
    parts: tuple[LinkPart, ...]


# a migration's KV payload: exports through the object store, or the headers of what went over links
MigratedKV = list[KVExport] | LinkedKV


def kv_span(kv: Sequence[KVExport] | LinkedKV) -> tuple[str, int, int]:
    """(request, start, end) of a payload, whichever way it travelled (a list of exports is never empty here)."""
    if isinstance(kv, LinkedKV):
        return kv.request_id, kv.start, kv.end
    return kv[0].request_id, kv[0].start, kv[0].end


class KVPorts:
    """This process's ends of open links: a channel and (at a source) a sender thread each, and a mailbox of
    received parts. Thread-safe: a shard actor opens and receives on one thread while it steps on another."""

    def __init__(self) -> None:
        self._channels: dict[str, KVChannel] = {}
        self._senders: dict[str, ThreadPoolExecutor] = {}  # one thread per link: its sends go in order
        self._mail: dict[tuple[str, int], KVExport] = {}  # (link, start) -> what arrived
        self._lock = threading.Lock()

    def open(self, links: Sequence[Link], side: Side, timeout_s: float, backend: str) -> None:
        """Join `links` (`side` SRC: rank 0, hosting each at its address; DST: rank 1), all at once: the other
        ends may come in any order. A link that fails raises ChannelError after the others are through."""
        if not links:
            return
        if not isinstance(side, Side):
            raise TypeError(f"a link's side must be a Side (SRC or DST), not {side!r}")
        rank = side.rank
        with ThreadPoolExecutor(len(links), thread_name_prefix="kv-open") as pool:
            futures = [pool.submit(KVChannel, link.address, rank, timeout_s, backend) for link in links]
        errors = []
        with self._lock:
            for link, future in zip(links, futures):
                try:
                    self._channels[link.link_id] = future.result()
                except ChannelError as e:
                    errors.append(e)
                    continue
                if side is Side.SRC:
                    self._senders[link.link_id] = ThreadPoolExecutor(1, thread_name_prefix="kv-send")
        if errors:
            raise errors[0]

    def send(self, link: Link, export: KVExport) -> LinkPart:
        """Queue `export` (this stage's KV of `link.layers`) behind what went over the link before; returns at once."""
        with self._lock:
            channel, sender = self._channels[link.link_id], self._senders[link.link_id]
        future = sender.submit(channel.send, [export])
        future.add_done_callback(lambda f: _log_failure(f, link.link_id))
        return LinkPart(link.link_id, link.src, link.dst, KVHeader.of(export))

    def receive(self, parts: Sequence[LinkPart]) -> None:
        """Receive each part over its link (blocking, bounded by the link's timeout) into the mailbox."""
        for p in parts:
            with self._lock:
                channel = self._channels.get(p.link_id)
            if channel is None:
                raise ChannelError(f"no open KV link {p.link_id}")
            [export] = channel.recv((p.header,))
            with self._lock:
                self._mail[(p.link_id, p.header.start)] = export

    def take(self, link_id: str, start: int) -> KVExport:
        """The part received over `link_id` for the range starting at `start`, out of the mailbox."""
        with self._lock:
            export = self._mail.pop((link_id, start), None)
        if export is None:
            raise ChannelError(f"nothing received over {link_id} from token {start}")
        return export

    def close(self, prefix: str) -> None:
        """Forget every link whose id starts with `prefix` (a migration's channel) and what arrived on them. A send
        still under way ends with its channel's timeout and is logged."""
        with self._lock:
            for link_id in [i for i in self._channels if i.startswith(prefix)]:
                del self._channels[link_id]
                sender = self._senders.pop(link_id, None)
                if sender is not None:
                    sender.shutdown(wait=False)
            for key in [k for k in self._mail if k[0].startswith(prefix)]:
                del self._mail[key]

    @property
    def open_links(self) -> list[str]:
        with self._lock:
            return sorted(self._channels)


def _log_failure(future: Future, link_id: str) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("a KV send over %s failed: %s", link_id, future.exception())


def send_stage(cache: KVCache, ports: KVPorts, request_id: str, start: int, end: int,
               links: Sequence[Link]) -> list[LinkPart]:
    """A source stage's share of a range: its KV of tokens [start, end), cut by link and sent over each."""
    export = cache.export(request_id, start, end)  # (L, T, kvh, hd) per k and v, copied out of the cache
    return [ports.send(link, reshard([export], [link.layers])[0]) for link in links]


def import_stage(cache: KVCache, ports: KVPorts, request_id: str, start: int, parts: Sequence[LinkPart]) -> bool:
    """A destination stage's share of a range: the parts it received, joined into its own layers and appended
    to the request's KV in its cache; False if out of blocks."""
    got = [ports.take(p.link_id, start) for p in parts]
    [mine] = reshard(got, [tuple(cache.layer_ids)])
    return cache.import_(mine)
