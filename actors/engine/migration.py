"""Live migration at one engine: what cluster/migration.py's coordinator asks of a source and of a destination.

Every operation runs between two steps (on the serving loop's thread, through the Instance facade in
actors/serving/instance.py), over the engine's parts: its target and draft runners, its scheduler and its drafter. A source
says how much KV a request holds and the names of its full blocks, exports it (the target's or the draft's, one
`Pipeline` at a time) in ranges while it keeps decoding, then stops it (`stop_out`: the rest of its KV, the request taken out of the step loop with its KV kept) and either
frees it (`release_detached`, committed elsewhere) or takes it back (`reattach`, the migration aborted). A
destination reserves room (`reserve_incoming`, starting from what its prefix cache holds), imports, and drops what
it holds if the request is not committed there (`drop_incoming`).
"""

from __future__ import annotations

import copy
import functools
from typing import TYPE_CHECKING

from actors.kv.links import MigratedKV, kv_span
from actors.engine.sequence import EngineSequence, SeqStatus
from actors.speculation.drafters import ModelDrafter
from cluster.migration_messages import BlockNames, Link, Pipeline, Reservation
from cluster.request import Resume

if TYPE_CHECKING:
    from actors.engine.core import Engine


class EngineMigration:
    """A migration's operations on `engine` (it holds no state of its own: every call reads the engine as it is)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    # ---- what a request holds ---------------------------------------------------------------
    def holds(self, request_id: str) -> bool:
        """Whether the request is queued or running here."""
        return self.engine.sequence(request_id) is not None

    def kv_length(self, request_id: str) -> int:
        """Tokens of a request whose target KV this engine holds."""
        return self.engine.target.cache.length(request_id)

    def block_names(self, request_id: str) -> BlockNames:
        """A migration's source: the names of the full blocks of the request's target and draft KV (none without
        prefix caching), for the destination to reuse those it caches."""
        e = self.engine
        seq = e.sequence(request_id)
        if seq is None or seq.target_names is None:
            return BlockNames()
        draft = e.draft.cache.length(request_id) if seq.draft_names is not None else 0
        return BlockNames(tuple(seq.target_names.upto(seq.token_ids, self.kv_length(request_id))),
                          tuple(seq.draft_names.upto(seq.token_ids, draft)) if draft else ())

    @functools.cached_property
    def kv_bytes_per_token(self) -> int:
        """Bytes of one token's target KV over every layer, K and V (what a migration moves per token)."""
        target = self.engine.target
        c = target.model.config
        heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        return 2 * c.num_hidden_layers * heads * head_dim * target.model.dtype.itemsize

    # ---- the source -------------------------------------------------------------------------
    def export_kv(self, request_id: str, start: int, end: int | None = None,
                  links: list[Link] | None = None) -> MigratedKV:
        """The request's target KV from token `start` to `end` (default: what it holds now), one export per stage, or
        with `links` (a migration's) sent by the stages over them; none for a request that holds no KV (queued,
        never started)."""
        target = self.engine.target
        if not target.cache.has(request_id):
            return []
        have = target.cache.length(request_id)
        return target.export_kv(request_id, start, have if end is None else min(end, have), links)

    def export(self, pipeline: Pipeline, request_id: str, start: int, end: int | None = None,
               links: list[Link] | None = None) -> tuple[MigratedKV, int] | None:
        """A migration's copy of the request's KV of `pipeline` from `start` to `end` (or to what it holds; over
        `links` if given), and where that ends. None for the target if the request is not here, or holds less than
        `start` (preempted since its copy began: its KV was freed); for the draft, without a draft model whose KV
        can move (an EasySpec group's is rebuilt at the destination), or without draft KV beyond `start`. The
        draft's KV is copied as it stands between two steps: its view of the accepted tokens, a prefix of the
        request that never changes."""
        match pipeline:
            case Pipeline.TARGET:
                if not self.holds(request_id) or self.kv_length(request_id) < start:
                    return None
                have = self.kv_length(request_id)
                end = have if end is None else min(end, have)
                return self.export_kv(request_id, start, end, links), end
            case Pipeline.DRAFT:
                draft = self.engine.draft
                if (draft is None or not draft.exports_kv or not self.holds(request_id)
                        or not draft.cache.has(request_id)):
                    return None
                n = draft.cache.length(request_id)
                if n <= start:
                    return None
                got = draft.export_kv(request_id, start, n if end is None else min(end, n), links)
                return got, kv_span(got)[2]
        raise TypeError(f"not a Pipeline: {pipeline!r}")

    def stop_out(self, request_id: str, start: int, links: list[Link] | None = None
                 ) -> tuple[EngineSequence, Resume, MigratedKV, int] | None:
        """A migration's stop: the rest of the request's KV from `start` (over `links` if given), then the request
        taken out of the step loop (KV kept until released); None, and the request left running, if `export`
        would give None."""
        exported = self.export(Pipeline.TARGET, request_id, start, None, links)
        if exported is None:
            return None
        seq, resume = self.detach(request_id)
        return seq, resume, *exported

    def detach(self, request_id: str) -> tuple[EngineSequence, Resume] | None:
        """Take a request out of the step loop, keeping its KV, and say where it stands; None if not here."""
        seq = self.engine.scheduler.remove(request_id)
        if seq is None:
            return None
        state = seq.generator.get_state().numpy().tobytes() if seq.generator is not None else None
        return seq, Resume(tuple(seq.output.token_ids), seq.output.emitted, state, copy.deepcopy(seq.stats))

    def reattach(self, seq: EngineSequence) -> None:
        """A detached request carries on here (its migration was aborted): its KV never left."""
        seq.status = SeqStatus.WAITING
        self.engine.scheduler.add(seq)

    def release_detached(self, seq: EngineSequence) -> None:
        """A detached request now runs elsewhere: free its KV here."""
        self.engine.free(seq)

    # ---- the destination --------------------------------------------------------------------
    def reserve_incoming(self, request_id: str, tokens: int, names: BlockNames = BlockNames()) -> Reservation | None:
        """The migration handshake: hold KV blocks for `tokens` tokens of a request about to arrive, starting it with
        the cached blocks its leading `names` find (the copy then starts after them), or refuse (None)."""
        e = self.engine
        if self.holds(request_id):
            return None
        cached = e.target.cache.match(request_id, names.target) if e.prefix_caching and names.target else 0
        if not e.target.reserve(request_id, tokens):
            e.target.cache.free(request_id)
            return None
        draft = 0
        if e.prefix_caching and names.draft and isinstance(e.drafter, ModelDrafter) and e.draft.exports_kv:
            draft = e.draft.cache.match(request_id, names.draft)
            e.drafter.imported(request_id, draft)
        return Reservation(cached, draft, self.kv_bytes_per_token)

    def import_kv(self, pipeline: Pipeline, exports: MigratedKV) -> bool:
        """Append an arriving request's KV of `pipeline` (exported by any split of the same model, or received over a
        migration's links). The target: False if out of blocks; a request that held no KV at its source (queued
        there) arrives with none. The draft (it then catches up only on the tokens after it): False, changing
        nothing, without a draft model whose KV can move, if it does not continue what came before, or without
        room (the draft catches up from what it has)."""
        e = self.engine
        match pipeline:
            case Pipeline.TARGET:
                return e.target.import_kv(exports) if exports else True
            case Pipeline.DRAFT:
                rid, start, _ = kv_span(exports)
                if e.draft is None or not e.draft.exports_kv or self.holds(rid):
                    return False
                if start != (e.draft.cache.length(rid) if e.draft.cache.has(rid) else 0):
                    return False
                if not e.draft.import_kv(exports):
                    return False
                if isinstance(e.drafter, ModelDrafter):
                    e.drafter.imported(rid, e.draft.cache.length(rid))
                return True
        raise TypeError(f"not a Pipeline: {pipeline!r}")

    def drop_incoming(self, request_id: str) -> None:
        """An arriving request was not committed: free what was reserved and imported for it."""
        e = self.engine
        if not self.holds(request_id):
            e.target.cache.free(request_id)
            if e.draft is not None:
                e.draft.cache.free(request_id)
