"""Each stage of a migration (cluster/migration.py) on plain data: ends that answer each message as scripted, so every
failure path's status, reason and undo (what is dropped at the destination, what resumes at the source) is checked
stage by stage, and the whole protocol's order of messages once. The same paths between real engines and instance
servers: tests/unit/test_migration.py and test_migration_faults.py."""

from __future__ import annotations

import asyncio
import inspect

import pytest

from cluster.config import MigrationConfig
from cluster.migration import (MigrationRun, MigrationStatus, StageStatus, copy_stage, handshake, migrate, probe,
                               release, stop_and_commit)
from cluster.migration_endpoint import Deadlined
from cluster.migration_messages import Drop, Exported, Pipeline, Release, Reservation, Side, Stopped
from cluster.request import Request, SamplingParams

CFG = MigrationConfig(max_stages=3, stop_copy_tokens=2, chunk_tokens=8, step_timeout_s=0.2)
REQUEST = Request("r0", (1, 2, 3), SamplingParams(temperature=0.0, max_tokens=8))


class Scripted:
    """An end that answers each message type as `answers` says (a value; a function of the message, plain or async;
    an exception to raise) and records every message it was sent."""

    def __init__(self, **answers) -> None:
        self.answers, self.sent = answers, []

    async def migration(self, msg):
        self.sent.append(msg)
        answer = self.answers.get(type(msg).__name__)
        if isinstance(answer, BaseException):
            raise answer
        if inspect.iscoroutinefunction(answer):
            return await answer(msg)
        return answer(msg) if callable(answer) else answer

    def kinds(self) -> list[str]:
        return [type(m).__name__ for m in self.sent]


async def hang(_msg) -> None:
    await asyncio.sleep(3600)


def exported(msg) -> Exported | None:
    """The source's KV as asked, the draft holding none."""
    return Exported(f"kv[{msg.start}:{msg.end}]", msg.end) if msg.pipeline is Pipeline.TARGET else None


def run_of(src: Scripted, dst: Scripted, cfg: MigrationConfig = CFG, **state) -> MigrationRun:
    run = MigrationRun("r0", Deadlined(src, Side.SRC, cfg.step_timeout_s), Deadlined(dst, Side.DST, cfg.step_timeout_s),
                       cfg)
    for k, v in state.items():
        setattr(run, k, v)
    return run


def stage(fn, run: MigrationRun) -> StageStatus:
    return asyncio.run(fn(run))


# ---- probe -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("answer", "reason"), [
    (None, "the request does not run at the source"),
    (ConnectionError("gone"), "source: ConnectionError: gone"),
])
def test_probe_aborts_at_the_source_before_anything_is_held(answer, reason) -> None:
    src, dst = Scripted(Length=answer), Scripted()
    run = run_of(src, dst)
    assert stage(probe, run) is StageStatus.ABORTED_SRC and run.reason == reason
    assert dst.sent == []


def test_probe_reads_what_the_source_holds() -> None:
    run = run_of(Scripted(Length=40), Scripted())
    assert stage(probe, run) is StageStatus.RUNNING and run.length == 40


# ---- handshake ---------------------------------------------------------------------------------------------------
def test_a_refused_reservation_aborts_at_the_destination_with_nothing_to_drop() -> None:
    dst = Scripted(Reserve=None)
    run = run_of(Scripted(Names=None), dst, length=40)
    assert stage(handshake, run) is StageStatus.ABORTED_DST and run.reason == "the destination has no room"
    assert dst.kinds() == ["Reserve"]
    assert dst.sent[0].tokens == 40 + CFG.stop_copy_tokens and dst.sent[0].lease_s == 2 * CFG.step_timeout_s


@pytest.mark.parametrize("failure", [ConnectionError("cut"), hang], ids=["fails", "hangs"])
def test_a_reservation_that_fails_or_times_out_is_dropped(failure) -> None:
    dst = Scripted(Reserve=failure, Drop=None)
    run = run_of(Scripted(Names=None), dst, length=40)
    assert stage(handshake, run) is StageStatus.ABORTED_DST and run.reason.startswith("destination: ")
    assert dst.kinds() == ["Reserve", "Drop"]


def test_a_source_that_cannot_name_its_blocks_aborts_before_the_reservation() -> None:
    dst = Scripted()
    run = run_of(Scripted(Names=ConnectionError("gone")), dst, length=40)
    assert stage(handshake, run) is StageStatus.ABORTED_SRC and dst.sent == []


def test_the_copies_start_after_what_the_destination_caches() -> None:
    run = run_of(Scripted(Names=None), Scripted(Reserve=Reservation(8, 4, 100)), length=40)
    assert stage(handshake, run) is StageStatus.RUNNING
    assert (run.copied, run.draft_tokens, run.held.kv_bytes_per_token) == (8, 4, 100)


# ---- copy_stage ------------------------------------------------------------------------------------------------
def test_a_stage_copies_in_chunks_then_reads_what_the_source_holds_now() -> None:
    src, dst = Scripted(Export=exported, Length=23), Scripted(Import=True)
    run = run_of(src, dst, length=20)
    assert stage(copy_stage, run) is StageStatus.RUNNING
    assert (run.stages, run.copied, run.length, run.ready_to_stop) == (1, 20, 23, False)
    target = [(m.start, m.end) for m in src.sent if type(m).__name__ == "Export" and m.pipeline is Pipeline.TARGET]
    assert target == [(0, 8), (8, 16), (16, 20)]


@pytest.mark.parametrize(("src", "dst", "status", "reason"), [
    (Scripted(Export=None), Scripted(Drop=None), StageStatus.ABORTED_SRC, "the request ended at the source first"),
    (Scripted(Export=exported), Scripted(Import=False, Drop=None), StageStatus.ABORTED_DST,
     "the destination ran out of KV blocks"),
    (Scripted(Export=ConnectionError("gone")), Scripted(Drop=None), StageStatus.ABORTED_SRC,
     "source: ConnectionError: gone"),
    (Scripted(Export=exported), Scripted(Import=hang, Drop=None), StageStatus.ABORTED_DST,
     "destination: StepTimeout: the destination's Import did not answer within 0.2 s"),
    (Scripted(Export=exported, Length=None), Scripted(Import=True, Drop=None), StageStatus.ABORTED_SRC,
     "the request ended at the source first"),
], ids=["request ended", "no blocks", "source fails", "destination hangs", "ended after the stage"])
def test_a_stage_that_fails_drops_what_the_destination_holds(src, dst, status, reason) -> None:
    run = run_of(src, dst, length=20)
    assert stage(copy_stage, run) is status and run.reason == reason
    assert dst.kinds()[-1] == "Drop" and all(type(m).__name__ != "Release" for m in src.sent)


def test_a_failed_draft_copy_is_the_destinations_failure() -> None:
    def draft_cut(msg) -> bool:
        if msg.pipeline is Pipeline.DRAFT:
            raise ConnectionError("draft cut")
        return True
    dst = Scripted(Import=draft_cut, Drop=None)
    run = run_of(Scripted(Export=lambda m: Exported("kv", m.end)), dst, length=8)
    assert stage(copy_stage, run) is StageStatus.ABORTED_DST and run.reason == "destination: ConnectionError: draft cut"


def test_a_draft_the_destination_cannot_take_stops_moving() -> None:
    dst = Scripted(Import=lambda m: m.pipeline is Pipeline.TARGET)
    run = run_of(Scripted(Export=lambda m: Exported("kv", m.end), Length=8), dst, length=8)
    assert stage(copy_stage, run) is StageStatus.RUNNING and not run.draft_open and run.draft_tokens == 0


# ---- stop_and_commit ---------------------------------------------------------------------------------------------
def stopped(msg) -> Stopped:
    return Stopped(REQUEST, f"kv[{msg.start}:]", msg.start + 2, 0.0)


def test_the_stop_copies_the_rest_and_commits() -> None:
    src, dst = Scripted(Export=None, Stop=stopped), Scripted(Import=True, Commit=True)
    run = run_of(src, dst, length=22, copied=20)
    assert stage(stop_and_commit, run) is StageStatus.RUNNING
    assert run.copied == 22 and run.stopped and run.downtime_s >= 0
    assert dst.kinds() == ["Import", "Commit"] and dst.sent[1].request is REQUEST


def test_a_request_that_ended_before_its_stop_aborts_at_the_source() -> None:
    src, dst = Scripted(Export=None, Stop=None), Scripted(Drop=None)
    run = run_of(src, dst, length=22, copied=20)
    assert stage(stop_and_commit, run) is StageStatus.ABORTED_SRC
    assert run.reason == "the request ended at the source first" and dst.kinds() == ["Drop"]
    assert src.kinds() == ["Export", "Stop"]  # nothing to resume: it is not stopped


@pytest.mark.parametrize("refusal", ["Import", "Commit"])
def test_a_destination_that_refuses_the_commit_resumes_the_request_at_its_source(refusal) -> None:
    src = Scripted(Export=None, Stop=stopped, Release=True)
    dst = Scripted(Import=refusal != "Import", Commit=False, Drop=None)
    run = run_of(src, dst, length=22, copied=20)
    assert stage(stop_and_commit, run) is StageStatus.ABORTED_DST
    assert run.reason == "destination: RuntimeError: the destination refused the request's last KV or its commit"
    assert dst.kinds()[-1] == "Drop"
    assert src.sent[-1] == Release("r0", False, None)


def test_a_stop_that_timed_out_is_undone_at_the_source_as_it_may_have_landed() -> None:
    src, dst = Scripted(Export=None, Stop=hang, Release=True), Scripted(Drop=None)
    run = run_of(src, dst, length=22, copied=20)
    assert stage(stop_and_commit, run) is StageStatus.ABORTED_SRC
    assert run.reason == "source: StepTimeout: the source's Stop did not answer within 0.2 s"
    assert src.sent[-1] == Release("r0", False, None) and dst.kinds() == ["Drop"]


def test_a_source_lost_while_it_resumes_the_request_is_named() -> None:
    src = Scripted(Export=None, Stop=stopped, Release=ConnectionError("gone"))
    run = run_of(src, Scripted(Import=ConnectionError("cut"), Drop=None), length=22, copied=20)
    assert stage(stop_and_commit, run) is StageStatus.ABORTED_SRC
    assert run.reason == "source lost after destination failed: cut"


# ---- release ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("answer", "reason"), [
    (ConnectionError("gone"), "source failed before its release: ConnectionError: gone"),
    (False, "the request ended at the source while it moved (its client left)"),
])
def test_a_release_that_fails_drops_the_committed_copy(answer, reason) -> None:
    src, dst = Scripted(Release=answer), Scripted(Drop=None)
    run = run_of(src, dst, destination=("dst", None))
    assert stage(release, run) is StageStatus.ABORTED_SRC and run.reason.startswith(reason)
    assert src.sent == [Release("r0", True, ("dst", None))] and dst.kinds() == ["Drop"]


def test_a_release_that_lands_finishes_the_migration() -> None:
    src, dst = Scripted(Release=True), Scripted()
    run = run_of(src, dst)
    assert stage(release, run) is StageStatus.FINISHED and dst.sent == []


def test_a_running_migration_has_no_result() -> None:
    with pytest.raises(ValueError, match="still running"):
        run_of(Scripted(), Scripted()).result(StageStatus.RUNNING)


# ---- the whole protocol ------------------------------------------------------------------------------------------
def test_the_stages_in_order_send_the_protocols_messages() -> None:
    lengths = iter([20, 21])
    src = Scripted(Length=lambda _: next(lengths), Names=None, Export=exported, Stop=stopped, Release=True)
    dst = Scripted(Reserve=Reservation(0, 0, 10), Import=True, Commit=True)
    result = asyncio.run(migrate("r0", src, dst, CFG))
    assert result.status is MigrationStatus.FINISHED and result.stages == 1, result
    assert result.tokens_copied == 22 and result.bytes_copied == 220  # 20 in the stage, 2 at the stop
    # each target chunk goes with the draft's (which holds none here), and the draft's last just before the stop
    assert src.kinds() == ["Length", "Names"] + ["Export"] * 6 + ["Length", "Export", "Stop", "Release"]
    assert dst.kinds() == ["Reserve", "Import", "Import", "Import", "Import", "Commit"]
    assert not any(isinstance(m, Drop) for m in dst.sent)
