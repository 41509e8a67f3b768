"""The migration protocol as typed messages: what cluster/migration.py's coordinator sends an instance, one frozen
dataclass per operation, with `Pipeline` and `Side` enums where strings and `_draft` twins used to be.

An instance answers each message with one handler that dispatches with `match` (actors/serving/server.py,
`InstanceServer.migration`), the way its serving loop applies its commands (actors/serving/loop.py). A message checks
its own fields when it is built, so an ill-formed one fails at its sender, with the field named, not mid-migration.

Who receives what (docs/migration.md draws the stages):

    source        Length, Names, Export, Stop, Release
    destination   Reserve, Import, Commit, Drop
    both          KVLayout, OpenLinks, CloseChannel; LinkAddresses at the source (only with `transfer: torch`)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from cluster.request import Request


class Pipeline(enum.StrEnum):
    """Which model's KV a message is about: the target's, or the draft model's (their values name them in links)."""

    TARGET = "target"
    DRAFT = "draft"


class Side(enum.StrEnum):
    """Which end of a migration an instance is: the source (rank 0 of each link) or the destination (rank 1)."""

    SRC = "src"
    DST = "dst"

    @property
    def word(self) -> str:
        """How a reason or an error names it."""
        return "source" if self is Side.SRC else "destination"

    @property
    def rank(self) -> int:
        """Its rank in each link's two-rank group: the source hosts the group."""
        return 0 if self is Side.SRC else 1

    def stage(self, link: Link) -> int:
        """The stage at this end of `link`."""
        return link.src if self is Side.SRC else link.dst


@dataclass(frozen=True)
class Link:
    """One pair of stages whose layers overlap: source stage `src` sends its KV of `layers` to destination stage
    `dst` over a two-rank group that the source end hosts at `address` (on its node)."""

    link_id: str  # unique among every open link: the migration's channel, the pipeline, the pair
    src: int
    dst: int
    layers: tuple[int, ...]
    address: str = ""


@dataclass(frozen=True)
class BlockNames:
    """The names of a request's full KV blocks at its source (cluster/prefix.py), the target's and the draft's: the
    destination starts the request with those its prefix cache holds, and they are not copied."""

    target: tuple[int, ...] = ()
    draft: tuple[int, ...] = ()


@dataclass(frozen=True)
class Reservation:
    """The destination's yes to a migration's handshake: room is held for the request, and the KV of its first
    `cached_tokens` tokens (`draft_cached_tokens` of the draft's) is already here, in its prefix cache."""

    cached_tokens: int = 0
    draft_cached_tokens: int = 0
    kv_bytes_per_token: int = 0  # of the target's KV, every layer, K and V: what a token copied moves


class Exported(NamedTuple):
    """A range of a request's KV as the source sent it (exports, or the headers of what went over the links), and
    the token position it reaches."""

    kv: object
    end: int


class Stopped(NamedTuple):
    """The source's answer to `Stop`: the request as it resumes elsewhere, the rest of its KV and where that ends,
    and the seconds the stop waited for the step under way (the request still decoded meanwhile)."""

    request: Request
    kv: object
    end: int
    waited_s: float


def _need(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _pipeline(msg: object) -> None:
    if not isinstance(msg.pipeline, Pipeline):
        raise TypeError(f"{type(msg).__name__}.pipeline must be a Pipeline (TARGET or DRAFT), not {msg.pipeline!r}")


def _request_id(msg: object) -> None:
    _need(isinstance(msg.request_id, str) and bool(msg.request_id),
          f"{type(msg).__name__}.request_id must be a non-empty string, not {msg.request_id!r}")


def _lease(msg: object) -> None:
    _need(msg.lease_s > 0, f"{type(msg).__name__}.lease_s must be positive, not {msg.lease_s!r}")


# ---- the migration ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Length:
    """Source: tokens of the request's target KV now (int); None if it does not run there."""

    request_id: str

    def __post_init__(self) -> None:
        _request_id(self)


@dataclass(frozen=True)
class Names:
    """Source: the names of the full blocks of the request's KV now (BlockNames; none without prefix caching)."""

    request_id: str

    def __post_init__(self) -> None:
        _request_id(self)


@dataclass(frozen=True)
class Reserve:
    """Destination: hold blocks for `tokens` tokens of the request, starting it with the cached blocks of the leading
    `names` (Reservation); None: it refuses. If no message of this migration comes for `lease_s` while it is not
    committed, the destination drops what it holds for it on its own."""

    request_id: str
    tokens: int
    lease_s: float
    names: BlockNames = BlockNames()

    def __post_init__(self) -> None:
        _request_id(self)
        _need(self.tokens >= 0, f"Reserve.tokens must be >= 0, not {self.tokens!r}")
        _lease(self)


@dataclass(frozen=True)
class Export:
    """Source: the request's KV of `pipeline` from `start` to `end` (or to what it holds, if less) as Exported; None
    if it ended meanwhile (the target), or holds no KV beyond `start` (the draft; also without a draft model whose
    KV can move). With `via` (this migration's channel) its tensors go over that channel's links."""

    request_id: str
    pipeline: Pipeline
    start: int
    end: int
    via: str | None = None

    def __post_init__(self) -> None:
        _request_id(self)
        _pipeline(self)
        _need(0 <= self.start <= self.end, f"Export needs 0 <= start <= end, not [{self.start!r}, {self.end!r})")


@dataclass(frozen=True)
class Import:
    """Destination: append KV of `pipeline` (what an Export gave); False if out of blocks (the target: the migration
    aborts) or if it cannot take it (the draft: its draft catches up on the rest instead)."""

    pipeline: Pipeline
    kv: object

    def __post_init__(self) -> None:
        _pipeline(self)


@dataclass(frozen=True)
class Stop:
    """Source: take the request out of its step loop (KV kept) and return it as Stopped, with its target KV from
    `start`; None if it ended meanwhile. If no Release comes within `lease_s`, the source resumes the request on its
    own (the coordinator is gone)."""

    request_id: str
    start: int
    via: str | None = None
    lease_s: float = 60.0

    def __post_init__(self) -> None:
        _request_id(self)
        _need(self.start >= 0, f"Stop.start must be >= 0, not {self.start!r}")
        _lease(self)


@dataclass(frozen=True)
class Commit:
    """Destination: the request resumes there on the KV imported for it (True); its stream waits for its client for
    the lease given at the reservation (a copy nobody follows is aborted, its KV freed)."""

    request: Request

    def __post_init__(self) -> None:
        if not isinstance(self.request, Request):
            raise TypeError(f"Commit.request must be a Request, not {type(self.request).__name__}")


@dataclass(frozen=True)
class Release:
    """Source: committed: free the request's KV and end its stream pointing at `destination`; else resume it. False
    if the source no longer holds the request stopped (its client left meanwhile, or its lease ran out and it
    resumed there): then nothing follows a committed copy, which must be dropped."""

    request_id: str
    committed: bool
    destination: object = None

    def __post_init__(self) -> None:
        _request_id(self)


@dataclass(frozen=True)
class Drop:
    """Destination: forget the request, whatever it holds of it: what was reserved and imported for it, and a copy
    committed there (its waiting stream dropped: its client's stream fails over instead, or has left)."""

    request_id: str

    def __post_init__(self) -> None:
        _request_id(self)


# ---- the migration's links (only with `transfer: torch`) -----------------------------------------------------
@dataclass(frozen=True)
class KVLayout:
    """Both: where `pipeline` keeps its KV, as StagesKV; None if the instance has no such pipeline, or its KV cannot
    go stage to stage (then it goes through the object store)."""

    pipeline: Pipeline

    def __post_init__(self) -> None:
        _pipeline(self)


class StagesKV(NamedTuple):
    """The layers of each stage of a pipeline, and the device type ("cuda" or "cpu") its stages keep their KV on."""

    stages: list[tuple[int, ...]]
    device: str


@dataclass(frozen=True)
class LinkAddresses:
    """Source: a rendezvous address for each of `stages` of `pipeline` (one per link it will host), on its node."""

    pipeline: Pipeline
    stages: tuple[int, ...]

    def __post_init__(self) -> None:
        _pipeline(self)


@dataclass(frozen=True)
class OpenLinks:
    """Both: join every link of `pipeline` the instance's stages take part in, as `side`'s end, over `backend` (gloo
    or nccl); both ends are sent this at once, and each waits up to `timeout_s` for the other. Afterwards an Export
    with `via=channel` sends over them."""

    channel: str
    pipeline: Pipeline
    links: tuple[Link, ...]
    side: Side
    timeout_s: float
    backend: str

    def __post_init__(self) -> None:
        _pipeline(self)
        if not isinstance(self.side, Side):
            raise TypeError(f"OpenLinks.side must be a Side (SRC or DST), not {self.side!r}")
        _need(self.backend in ("gloo", "nccl"), f"OpenLinks.backend must be gloo or nccl, not {self.backend!r}")
        _need(self.timeout_s > 0, f"OpenLinks.timeout_s must be positive, not {self.timeout_s!r}")


@dataclass(frozen=True)
class CloseChannel:
    """Both: forget every link of the migration's channel (and anything received on them and not imported)."""

    channel: str


MigrationMessage = (Length | Names | Reserve | Export | Import | Stop | Commit | Release | Drop | KVLayout
                    | LinkAddresses | OpenLinks | CloseChannel)
MESSAGES = MigrationMessage.__args__  # every message type, in the order above
