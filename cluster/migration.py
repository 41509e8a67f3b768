"""Live migration of one running request between instances, staged as in Llumnix (Sun et al., OSDI '24, arXiv 2406.03243).

    result = await migrate(request_id, source, destination, MigrationConfig())

Handshake: the destination reserves KV blocks for what the request holds now, or refuses; with prefix caching it
starts the request with the full blocks its cache already holds under the same names (the source sends the names
of the request's blocks), and the copy starts after them (docs/prefix_caching.md). Stages: copy the
request's target KV produced so far while the source keeps decoding (in chunks of at most `chunk_tokens`, each
between two of the source's steps, so that no copy stalls its decoding for long); copy again what it produced
meanwhile;
once what is left is at most `stop_copy_tokens` (or after `max_stages`), stop the request at the source, copy
the rest (the only downtime), commit at the destination (the request resumes there with its tokens, streamed
text, sampler state and stats), and release it at the source (its KV freed, its stream told where it went).
The draft's KV moves in chunks beside the target's, the rest just before the stop (`draft_kv: move`), or the
destination's draft rebuilds it by catching up on its first drafting round (`draft_kv: rebuild`,
actors/speculation/drafters.py). Any failure before the
commit leaves the request running at the source, nothing lost, and frees what the destination reserved.

An `Endpoint` is an instance as the coordinator sees it: actors/serving/server.py implements it as Ray
methods (wrapped by `RayEndpoint`), tests with engines in this process. The KV travels as an opaque payload
(KV exports, or the headers of what went over the migration's links) with the token position it reaches:
the coordinator only sequences the calls, so it lives beside the router that runs it and imports nothing from
actors/.

**Links** (`transfer: torch`): the KV goes stage to stage, from the process that holds a source stage's cache
to the one that holds each destination stage whose layers overlap it (a shard actor, or the instance's own
process for stages it runs itself), over one two-rank torch.distributed group per such pair (`plan_links`):
an instance's engine process never holds another instance's KV on the way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from cluster.config import MigrationConfig
from cluster.migration_endpoint import (BlockNames, Deadlined, Endpoint, Link, RayEndpoint, Reservation,
                                        StepTimeout)

__all__ = ["BlockNames", "Deadlined", "Endpoint", "Link", "MigrationProgress", "MigrationResult", "MigrationStatus",
           "RayEndpoint", "Reservation", "StepTimeout", "channel_backend", "migrate", "plan_links"]

log = logging.getLogger(__name__)


class MigrationStatus(str, enum.Enum):
    FINISHED = "finished"  # committed at the destination, released at the source
    ABORTED_SRC = "aborted_src"  # the source could not go on (request ended there first, source failed)
    ABORTED_DST = "aborted_dst"  # the destination refused or failed; the request runs on at the source


@dataclass(frozen=True)
class MigrationProgress:
    """Where a migration under way stands (the router shows it; fault tests wait on it)."""

    request_id: str
    phase: str  # "reserved", "copying" (a chunk landed), "stopped", "committed"
    stages: int
    tokens_copied: int


@dataclass(frozen=True)
class MigrationResult:
    request_id: str
    status: MigrationStatus
    reason: str = ""
    stages: int = 0  # copies made while the source kept decoding
    tokens_copied: int = 0  # target KV tokens moved, all stages
    tokens_skipped: int = 0  # target KV tokens not moved: the destination's prefix cache held them
    bytes_copied: int = 0  # of target KV moved (every layer, K and V)
    bytes_skipped: int = 0
    downtime_s: float = 0.0  # from the request's stop at the source (its last step there done) to its commit
    total_s: float = 0.0
    transfer: str = "object_store"  # how the KV went: "object_store" or "torch" (a torch.distributed channel)
    draft_tokens: int = 0  # tokens of draft KV moved (draft_kv: move); the destination's draft catches up on the rest
    draft_tokens_skipped: int = 0  # draft KV tokens its prefix cache held
    links: int = 0  # stage-to-stage links the KV went over (transfer "torch"; target and draft)


def plan_links(src_stages: list[tuple[int, ...]], dst_stages: list[tuple[int, ...]]
               ) -> list[tuple[int, int, tuple[int, ...]]]:
    """(source stage, destination stage, the layers they share) for every pair that shares any, in source order:
    the links that carry a request's KV between two splits of one model's layers (every layer exactly once)."""
    if sorted(i for ids in src_stages for i in ids) != sorted(i for ids in dst_stages for i in ids):
        raise ValueError(f"the two instances split different layers: {src_stages} and {dst_stages}")
    out = []
    for i, a in enumerate(src_stages):
        for j, b in enumerate(dst_stages):
            shared = tuple(layer for layer in a if layer in set(b))
            if shared:
                out.append((i, j, shared))
    return out


async def migrate(request_id: str, src: Endpoint, dst: Endpoint, cfg: MigrationConfig = MigrationConfig(),
                  destination: object = None, ids: tuple[str, str] | None = None,
                  progress: Callable[[MigrationProgress], None] = lambda p: None) -> MigrationResult:
    """Move a running request from `src` to `dst`; `destination` is what the source's stream is told (the
    destination instance's id and handle, for the client's stream to follow). With `cfg.transfer == "torch"`
    and the two instances' `ids`, the KV goes over a torch.distributed channel between them, opened for this
    migration alone (the object store if it cannot be opened): migrations between the same two instances may
    run side by side, each over its own channel. Every call to either end answers within `cfg.step_timeout_s`,
    or the migration aborts (Deadlined)."""
    t0 = time.perf_counter()
    src, dst = Deadlined(src, "source", cfg.step_timeout_s), Deadlined(dst, "destination", cfg.step_timeout_s)
    try:
        length = await src.migrate_length(request_id)
    except Exception as e:  # noqa: BLE001 - the source failed: nothing was reserved anywhere
        length, reason = None, f"source: {type(e).__name__}: {e}"
    else:
        reason = "the request does not run at the source"
    if length is None:
        return MigrationResult(request_id, MigrationStatus.ABORTED_SRC, reason, total_s=time.perf_counter() - t0)
    # a queued request holds no KV (length 0): a channel would carry nothing
    via, links = None, 0
    if cfg.transfer == "torch" and ids and length:
        via, links = await _open_channel(src, dst, ids, request_id, cfg)
    try:
        result = await _migrate(request_id, length, src, dst, cfg, destination, via, progress)
    finally:
        if via is not None:
            await _close_channel(src, dst, via)
    return dataclasses.replace(result, transfer="torch" if via else "object_store", links=links,
                               total_s=time.perf_counter() - t0)


class _Failed(Exception):
    """A call of a side task failed: which end it was (for the migration's status) and the error."""

    def __init__(self, side: str, error: Exception) -> None:
        super().__init__(f"{side}: {type(error).__name__}: {error}")
        self.side, self.error = side, error


class _DraftCopy:
    """The draft's KV (`draft_kv: move`), copied in chunks beside the target's (each pair in one window between two
    of the source's steps), then whatever the draft added meanwhile just before the stop. The draft KV between
    steps is a prefix of the accepted tokens that never changes, so a copy made at any window stays right."""

    def __init__(self, request_id: str, src: Endpoint, dst: Endpoint, cfg: MigrationConfig, via: str | None) -> None:
        self.request_id, self.src, self.dst, self.cfg, self.via = request_id, src, dst, cfg, via
        self.tokens = 0  # copied so far
        self.open = cfg.draft_kv == "move"  # closed once the destination cannot take more (its draft catches up)

    async def chunk(self) -> int:
        """Copy the next chunk, if the draft has more KV than was copied; the tokens it moved."""
        if not self.open:
            return 0
        side = "source"
        try:
            exported = await self.src.migrate_export_draft(self.request_id, self.tokens,
                                                           self.tokens + self.cfg.chunk_tokens, self.via)
            if exported is None:
                return 0
            side = "destination"
            kv, end = exported
            if not await self.dst.migrate_import_draft(kv):
                self.open = False
                return 0
        except Exception as e:  # noqa: BLE001 - reported as that end's failure
            raise _Failed(side, e) from e
        moved, self.tokens = end - self.tokens, end
        return moved

    async def rest(self) -> None:
        """Copy until a chunk comes back short: the draft's end as it stands."""
        while await self.chunk() == self.cfg.chunk_tokens:
            pass


async def _migrate(request_id: str, length: int, src: Endpoint, dst: Endpoint, cfg: MigrationConfig,
                   destination: object, via: str | None, progress: Callable[[MigrationProgress], None]
                   ) -> MigrationResult:
    """The migration of a request whose source holds `length` tokens of its KV now."""
    t0 = time.perf_counter()
    stages = copied = 0
    draft = _DraftCopy(request_id, src, dst, cfg, via)
    held = Reservation()

    def reached(phase: str) -> None:
        progress(MigrationProgress(request_id, phase, stages, copied - held.cached_tokens))

    def result(status: MigrationStatus, reason: str = "", downtime: float = 0.0) -> MigrationResult:
        moved, bpt = max(0, copied - held.cached_tokens), held.kv_bytes_per_token
        return MigrationResult(request_id, status, reason, stages, moved, held.cached_tokens, moved * bpt,
                               held.cached_tokens * bpt, downtime, time.perf_counter() - t0,
                               draft_tokens=draft.tokens - held.draft_cached_tokens,
                               draft_tokens_skipped=held.draft_cached_tokens)

    lease_s = 2 * cfg.step_timeout_s  # what either end holds for this migration, it lets go of on its own after
    try:
        names = await src.migrate_names(request_id)
    except Exception as e:  # noqa: BLE001 - the source failed: nothing was reserved anywhere
        return result(MigrationStatus.ABORTED_SRC, f"source: {type(e).__name__}: {e}")
    try:
        reservation = await dst.migrate_reserve(request_id, length + cfg.stop_copy_tokens, lease_s, names)
        if reservation is None:
            return result(MigrationStatus.ABORTED_DST, "the destination has no room")
        held = reservation
        copied, draft.tokens = held.cached_tokens, held.draft_cached_tokens  # the copies start after what it holds
        reached("reserved")
    except Exception as e:  # noqa: BLE001 - a reservation that timed out is dropped, there or by its lease
        await _drop(dst, request_id)
        return result(MigrationStatus.ABORTED_DST, f"destination: {type(e).__name__}: {e}")
    stopped = stop_sent = False
    side = "source"
    try:
        now = length
        while stages < cfg.max_stages:  # copy while the source keeps decoding: what it held at the stage's start,
            while copied < now:  # in chunks, each between two of its steps (with the draft's next chunk)
                side = "source"
                exported, _ = await asyncio.gather(
                    src.migrate_export(request_id, copied, min(now, copied + cfg.chunk_tokens), via), draft.chunk())
                if exported is None:
                    await _drop(dst, request_id)
                    return result(MigrationStatus.ABORTED_SRC, "the request ended at the source first")
                side = "destination"
                kv, end = exported
                if not await dst.migrate_import(kv):
                    await _drop(dst, request_id)
                    return result(MigrationStatus.ABORTED_DST, "the destination ran out of KV blocks")
                copied = end
                reached("copying")
            stages += 1
            side = "source"
            now = await src.migrate_length(request_id)
            if now is None:
                await _drop(dst, request_id)
                return result(MigrationStatus.ABORTED_SRC, "the request ended at the source first")
            if now - copied <= cfg.stop_copy_tokens:
                break
        await draft.rest()  # before the stop: what the draft added since its last chunk
        side = "source"
        t_stop = time.perf_counter()
        stop_sent = True
        stopped_at = await src.migrate_stop(request_id, copied, via, lease_s)
        if stopped_at is None:
            await _drop(dst, request_id)
            return result(MigrationStatus.ABORTED_SRC, "the request ended at the source first")
        stopped = True
        reached("stopped")
        request, rest, end, waited = stopped_at
        side = "destination"
        if not await dst.migrate_import(rest) or not await dst.migrate_commit(request):
            raise RuntimeError("the destination refused the request's last KV or its commit")
        copied = end
        reached("committed")
        downtime = time.perf_counter() - t_stop - waited
        try:
            released = await src.migrate_release(request_id, True, destination)
        except Exception as e:  # noqa: BLE001 - the source died after the commit: its client's stream fails over
            return await _cancel_committed(request_id, dst, result, f"source failed before its release: "
                                           f"{type(e).__name__}: {e}; the committed copy was cancelled and the "
                                           "stream fails over")
        if released is False:  # nothing follows the copy: the client left, or the source's lease ran out
            return await _cancel_committed(request_id, dst, result, "the request ended at the source while it moved "
                                           "(its client left); the committed copy was cancelled")
        return result(MigrationStatus.FINISHED, downtime=downtime)
    except Exception as e:  # noqa: BLE001 - any failure before the commit: the request stays at the source
        if isinstance(e, _Failed):
            side, e = e.side, e.error
        await _drop(dst, request_id)  # also cancels a commit that timed out here and landed after all
        # a stop that timed out may have stopped the request all the same: resume it (a no-op if it did not)
        if stopped and side == "destination" or stop_sent and isinstance(e, StepTimeout):
            try:
                await src.migrate_release(request_id, False, None)
            except Exception:  # noqa: BLE001 - the source is gone or hung too: failover, or its lease, takes over
                log.exception("resuming %s at its source failed", request_id)
                return result(MigrationStatus.ABORTED_SRC, f"source lost after {side} failed: {e}")
        status = MigrationStatus.ABORTED_DST if side == "destination" else MigrationStatus.ABORTED_SRC
        return result(status, f"{side}: {type(e).__name__}: {e}")


async def _cancel_committed(request_id: str, dst: Endpoint, result, reason: str) -> MigrationResult:
    """A copy was committed at the destination but the client's stream will not follow it there (the source
    failed before its release and the stream fails over from its own tokens, or the request ended at the source
    meanwhile), so the copy would run for nobody, or twice. Cancel it."""
    log.warning("migration of %s: %s", request_id, reason)
    try:
        await dst.migrate_cancel(request_id)
    except Exception as e:  # noqa: BLE001 - a dead destination runs nothing; a live one aborts a copy nobody follows
        log.warning("cancelling %s at the destination failed (%s: %s)", request_id, type(e).__name__, e)
    return result(MigrationStatus.ABORTED_SRC, reason)


async def _open_channel(src: Endpoint, dst: Endpoint, ids: tuple[str, str], request_id: str,
                        cfg: MigrationConfig) -> tuple[str | None, int]:
    """Open this migration's links between the two instances' stages, for the target's KV and (moving it) the
    draft's, all at once; the channel's id (what the source sends `via`) and the number of links, or (None, 0) to
    send the KV through the object store. A draft whose KV cannot go stage to stage takes the object store alone."""
    src_id, dst_id = ids
    channel = f"{src_id}->{dst_id}/{request_id}"
    pipelines = ("target", "draft") if cfg.draft_kv == "move" else ("target",)
    try:
        planned = await asyncio.gather(*(_plan_links(src, dst, channel, p) for p in pipelines))
        if planned[0] is None:
            raise RuntimeError("an instance's target KV cannot go stage to stage")
        opening = []
        for pipeline, got in zip(pipelines, planned):
            if got is not None:
                links, backend = got
                opening += [end.links_open(channel, pipeline, links, side, cfg.channel_timeout_s, backend)
                            for end, side in ((src, "src"), (dst, "dst"))]
        # every end to its end (each bounded by the timeout), so that none is still opening when they are closed
        ends = await asyncio.wait_for(asyncio.gather(*opening, return_exceptions=True), cfg.channel_timeout_s + 5)
        for failed in (e for e in ends if isinstance(e, BaseException)):
            raise failed
        return channel, sum(len(got[0]) for got in planned if got is not None)
    except Exception as e:  # noqa: BLE001 - the object store still carries the KV
        log.warning("no KV links for %s (%s: %s); the KV goes through the object store", channel, type(e).__name__, e)
        await _close_channel(src, dst, channel)
        return None, 0


async def _plan_links(src: Endpoint, dst: Endpoint, channel: str, pipeline: str) -> tuple[list[Link], str] | None:
    """The links of `pipeline` between the two instances' stages, with their addresses, and their backend; None if
    either has no such pipeline or its KV cannot go stage to stage."""
    a, b = await asyncio.gather(src.kv_stages(pipeline), dst.kv_stages(pipeline))
    if a is None or b is None:
        return None
    pairs = plan_links(a, b)
    addresses, backend = await asyncio.gather(src.link_addresses(pipeline, [i for i, _, _ in pairs]),
                                              channel_backend(src, dst, pipeline))
    return [Link(f"{channel}/{pipeline}/{i}->{j}", i, j, layers, address)
            for (i, j, layers), address in zip(pairs, addresses, strict=True)], backend


async def channel_backend(src: Endpoint, dst: Endpoint, pipeline: str = "target") -> str:
    """NCCL when both instances keep `pipeline`'s KV on GPUs (device to device), gloo otherwise (host memory)."""
    devices = await asyncio.gather(src.kv_device(pipeline), dst.kv_device(pipeline))
    return "nccl" if all(d == "cuda" for d in devices) else "gloo"


async def _close_channel(src: Endpoint, dst: Endpoint, channel: str) -> None:
    for end in (src, dst):
        try:
            await end.channel_close(channel)
        except Exception as e:  # noqa: BLE001 - a dead end holds no channel; a send that failed was already reported
            log.warning("closing the KV channel %s failed (%s: %s)", channel, type(e).__name__, e)


async def _drop(dst: Endpoint, request_id: str) -> None:
    try:
        await dst.migrate_drop(request_id)
    except Exception as e:  # noqa: BLE001 - a dead destination holds nothing; a live one that missed this (hung,
        # or its answer lost) frees the reservation when its lease runs out (actors/serving/server.py)
        log.warning("dropping %s at the destination failed (%s: %s)", request_id, type(e).__name__, e)
