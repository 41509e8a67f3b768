"""`specfleet status|instances|requests|abort|drain|undrain|models`: the operator's commands over AdminClient.

    specfleet status                      # nodes, instances, load, speculation; exit 1 if anything is unhealthy
    specfleet requests --status running --json
    specfleet drain inst-1a2b3c4d --abort

The app's URL and keys come from flags, else the environment, else the config (`--config`, default the
embedded one): its serve.http_port and its key files. Keys are never printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cluster.config import AuthConfig, load_config
from cluster.instances import InstancePlace, InstanceRow
from cluster.stats import MoEStats, PrefixCacheStats
from deploy import DEFAULT_CONFIG, model_store
from deploy.cli.admin_client import AdminClient, Autoscaling, Dispatch, Instances, ServerError
from deploy.cli.flags import UsageError
from deploy.cli.tables import show, table
from deploy.infra import local_cluster
from deploy.infra.local_cluster import ClusterError
from deploy.serve.auth import KeyFileError, KeyFileExposed, listed_keys, read_key_file

REQUEST_STATUSES = ("running", "finished", "aborted", "failed")


# ---- where the app is and which keys open it --------------------------------------------------------------
@dataclass(frozen=True)
class AppEndpoint:
    """Where the app answers and the keys that open it (not the migration's `Endpoint`)."""

    url: str
    admin_key: str | None
    api_key: str | None


def add_endpoint_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("app")
    g.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                   help="the app's config: default port and key files (default: the embedded one)")
    g.add_argument("--url", help="the app's base URL (default: http://127.0.0.1:<serve.http_port of --config>)")
    g.add_argument("--admin-key", help="admin key (default: $SPECFLEET_ADMIN_KEYS, else the config's admin keys); "
                                       "on the command line every user sees it in `ps`: prefer --admin-key-file")
    g.add_argument("--admin-key-file", type=Path, help="a file (mode 600) whose first line is the admin key")
    g.add_argument("--api-key", help="API key for /v1 (default: $SPECFLEET_API_KEYS, else the config's API keys)")
    g.add_argument("--api-key-file", type=Path, help="a file (mode 600) whose first line is the API key")
    g.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each answer")


def first_key(auth: AuthConfig, admin: bool) -> str | None:
    """The first key the app would accept, looked up as the app does (deploy/serve/auth.py listed_keys): env, then
    config, then key file; None without any, or when it would come from a key file that is not readable here
    (the app's files may be on another machine: the request then goes without a key)."""
    keys = listed_keys(auth, admin)
    try:
        return next(keys, None)
    except KeyFileExposed as e:  # readable here, and by others: say so rather than use it
        raise UsageError(str(e)) from None
    except KeyFileError:
        return None


def endpoint(args: argparse.Namespace) -> AppEndpoint:
    cfg = load_config(args.config)
    url = args.url or f"http://127.0.0.1:{cfg.serve.http_port}"
    if not url.startswith(("http://", "https://")):
        raise UsageError(f"--url must start with http:// or https://, got {url!r}")
    admin_file, api_file = getattr(args, "admin_key_file", None), getattr(args, "api_key_file", None)
    return AppEndpoint(url, args.admin_key or _key_file(admin_file, "admin") or first_key(cfg.serve.auth, admin=True),
                       args.api_key or _key_file(api_file, "API") or first_key(cfg.serve.auth, admin=False))


def _key_file(path: Path | None, what: str) -> str | None:
    """The first key of a --*-key-file (UsageError if it cannot be read, is empty or others can read it)."""
    if path is None:
        return None
    try:
        keys = read_key_file(str(path), what)
    except KeyFileError as e:
        raise UsageError(str(e)) from None
    if not keys:
        raise UsageError(f"the {what} key file {path} holds no key")
    return keys[0]


def client(args: argparse.Namespace) -> AdminClient:
    e = endpoint(args)
    return AdminClient(e.url, e.admin_key, e.api_key, timeout=args.timeout)


Command = Callable[[argparse.Namespace], int]


def _guard(run: Command) -> Command:
    """Server errors (5xx) exit 1 with the message; user errors propagate to cli.main (exit 2)."""
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except ServerError as e:
            print(f"specfleet: error: {e}", file=sys.stderr)
            return 1
    return wrapped


# ---- registration (deploy/cli/main.py) -------------------------------------------------------------------------
def add_status(p: argparse.ArgumentParser) -> None:
    add_endpoint_flags(p)
    p.add_argument("--state", type=Path, default=local_cluster.DEFAULT_STATE,
                   help="the local cluster's state file; its nodes are shown if it exists")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.set_defaults(run=_guard(run_status))


def add_instances(p: argparse.ArgumentParser) -> None:
    add_endpoint_flags(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_guard(run_instances))


def add_requests(p: argparse.ArgumentParser) -> None:
    add_endpoint_flags(p)
    p.add_argument("--status", choices=REQUEST_STATUSES, help="only requests in this state")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_guard(run_requests))


def add_abort(p: argparse.ArgumentParser) -> None:
    add_endpoint_flags(p)
    p.add_argument("request_id", metavar="ID")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_guard(run_abort))


def add_drain(p: argparse.ArgumentParser, undo: bool = False) -> None:
    add_endpoint_flags(p)
    p.add_argument("instance_id", metavar="INSTANCE")
    if not undo:
        how = p.add_mutually_exclusive_group()
        how.add_argument("--abort", action="store_true", help="abort the requests running there instead of "
                         "migrating them")
        how.add_argument("--wait", action="store_true", help="leave the requests running there to finish")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_guard(run_undrain if undo else run_drain))


def add_migrate(p: argparse.ArgumentParser) -> None:
    add_endpoint_flags(p)
    p.add_argument("request_id", metavar="REQUEST")
    p.add_argument("--to", metavar="INSTANCE", help="the destination (default: where dispatch would send it)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_guard(run_migrate))


def add_undrain(p: argparse.ArgumentParser) -> None:
    add_drain(p, undo=True)


def add_models(p: argparse.ArgumentParser) -> None:
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    ls = actions.add_parser("list", help="the model catalog and what is already downloaded")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(run=run_models_list)
    fetch = actions.add_parser("fetch", help="download and verify a catalog model (progress on stderr)")
    fetch.add_argument("name", metavar="NAME", help=f"one of: {', '.join(sorted(model_store.CATALOG))}")
    fetch.set_defaults(run=run_models_fetch)


# ---- commands -------------------------------------------------------------------------------------------
def run_status(args: argparse.Namespace) -> int:
    with client(args) as c:
        health = c.health()
        inst = c.instances()
        moves = c.migrations()
        dispatch = c.dispatch()
        scaling = c.autoscaler()
    nodes, node_problem = _nodes(args.state)
    names = {n["node_id"]: n["name"] for n in nodes or [] if n.get("name")}
    problems = [f"/health: {health.status}"] if not health.ok else []
    problems += [f"{i.instance_id}: unhealthy: {i.error}" for i in inst.instances if not i.healthy]
    problems += [node_problem] if node_problem else []
    problems += [f"node {n['name']}: not alive" for n in nodes or [] if not n["alive"]]
    report = {"url": c.url, "healthy": not problems, "problems": problems, "health": health.model_dump(),
              "nodes": nodes, "load": _load(inst), "instances": [_row(i, names) for i in inst.instances],
              "removed": [_row(i, names) for i in inst.removed], "migrations": moves.model_dump(),
              "dispatch": dispatch.model_dump(), "autoscaling": scaling.model_dump()}
    if args.json:
        print(json.dumps(report))
        return 0 if not problems else 1
    print(f"app {c.url}: {health.status}, {health.healthy_instances} healthy instance(s)")
    if nodes is not None:
        print(f"nodes ({args.state}): {sum(n['alive'] for n in nodes)} of {len(nodes)} alive")
        t = table("NODE", "STATE", "ID")
        for n in nodes:
            t.add_row(n["name"] or "?", "alive" if n["alive"] else "DEAD", n["node_id"][:12])
        show(t)
    print("instances:")
    _print_instances(inst, names)
    load = report["load"]
    print(f"requests: the router holds {load['pending']} pending (in flight); the instances run {load['running']} "
          f"and queue {load['waiting']}; KV blocks {load['kv_blocks_used']}/{load['kv_blocks_total']} used")
    acc = "-" if load["acceptance"] is None else f"{load['acceptance']:.2f}"
    k = "-" if load["mean_k"] is None else f"{load['mean_k']:.2f}"
    draft_ms = "-" if load["draft_ms_per_token"] is None else f"{load['draft_ms_per_token']:.2f}"
    print(f"speculation: acceptance {acc}, mean k {k}, draft {draft_ms} ms per drafted token (mean over instances); "
          f"calibration re-ran {load['calibration_tokens']} tokens in {load['calibration_s']:.2f} s")
    if load["prefix_cache_queries"]:
        print(f"prefix cache: {load['prefix_cache_hits']} of {load['prefix_cache_queries']} prompt tokens found "
              f"cached ({load['prefix_cache_hit_rate']:.1%})")
    if load["moe_local_rate"] is not None:
        print(f"expert parallelism: {load['moe_local_rate']:.1%} of expert activations local, "
              f"{load['moe_bytes_per_token']:.0f} all-to-all bytes and {load['moe_ms_per_token']:.2f} MoE-layer ms "
              "per token (mean over expert-parallel instances)")
    d = dispatch.decisions
    print(f"dispatch: {dispatch.policy}; {d.get('prefix', 0)} routed to a cached prefix, "
          f"{d.get('load_over_prefix', 0)} away from one (too loaded), {d.get('load', 0)} by load alone; "
          f"prefix index: {dispatch.index_entries} blocks of {dispatch.index_instances} instance(s)")
    roles = {i.role for i in inst.instances}
    if roles - {"both"} or dispatch.disaggregation:
        print(_disaggregation_line(inst, dispatch))
    by = moves.by_status
    print(f"migrations: {by.get('finished', 0)} finished, {by.get('aborted_src', 0)} aborted at the source, "
          f"{by.get('aborted_dst', 0)} at the destination; downtime mean {moves.downtime_mean_s * 1e3:.1f} ms, "
          f"max {moves.downtime_max_s * 1e3:.1f} ms; {moves.failovers} request(s) failed over")
    if scaling.enabled:
        print(_autoscaling_line(scaling))
    for line in failed_rounds_lines(dispatch, scaling):
        print(line)
    if moves.failover_wait is not None:
        w = moves.failover_wait
        why = ("no start seen yet: the floor" if w.slowest_s is None else
               f"{w.multiple:g} x the slowest of the last {w.samples} starts ({w.slowest_s:.1f} s)")
        print(f"failover: with no instance up a request waits up to {w.wait_s:.0f} s for one to register ({why}, "
              f"within {w.floor_s:.0f}-{w.ceiling_s:.0f} s)")
        if w.last_start:
            print("last start: " + ", ".join(f"{name} {s:.1f} s" for name, s in w.last_start))
    for p in problems:
        print(f"UNHEALTHY: {p}")
    return 0 if not problems else 1


def failed_rounds_lines(d: Dispatch, a: Autoscaling) -> list[str]:
    """`specfleet status`'s warnings for background rounds that raised (the router's loops, the autoscaler's): each
    loop goes on, so only these counts show a defect that fails every round."""
    rounds = [(f"router {loop}", n, d.last_round_error.get(loop, "")) for loop, n in sorted(d.failed_rounds.items())
              if n]
    if a.enabled and a.failed_rounds:
        rounds.append(("autoscaler", a.failed_rounds, a.last_failure))
    return [f"WARNING: {n} {name} round(s) failed since it started; last: {error or '?'} (see its log)"
            for name, n, error in rounds]


def _autoscaling_line(a: Autoscaling) -> str:
    """`specfleet status`'s autoscaling line: size within bounds, the last decision and the last step, with reasons."""
    last = f"; last decision: {a.last.action} ({a.last.reason})" if a.last is not None else ""
    steps = sum(n for *_, n in a.counts)
    step = ""
    if a.events:
        e = a.events[-1]
        moved = f", {e.migrated} request(s) migrated" if e.action == "down" else ""
        step = (f"; last step: {e.action} {e.instance_id} {e.outcome} in {e.duration_s:.1f} s ({e.reason}{moved}"
                f"{': ' + e.detail if e.detail else ''})")
    ttft = ""
    if a.ttft_p99_s is not None:  # measured by the API replicas, or predicted from the queue (while none reports)
        of = f" from {a.ttft_replicas} API replica(s)" if a.ttft_source == "measured" else ""
        ttft = f"; ttft p99 {a.ttft_p99_s:.3f} s ({a.ttft_source}{of})"
    return (f"autoscaling: {a.instances} instance(s) within {a.min_instances}-{a.max_instances}; {steps} step(s)"
            f"{ttft}{last}{step}")


def run_instances(args: argparse.Namespace) -> int:
    with client(args) as c:
        inst = c.instances()
    if args.json:
        print(json.dumps({"instances": [_row(i) for i in inst.instances], "removed": [_row(i) for i in inst.removed]}))
    else:
        _print_instances(inst, {})
    return 0


def run_requests(args: argparse.Namespace) -> int:
    with client(args) as c:
        rows = c.requests(args.status)
    if args.json:
        print(json.dumps({"requests": [r.model_dump() for r in rows]}))
        return 0
    now = time.time()
    if not rows:
        print(f"(no {args.status + ' ' if args.status else ''}requests)")
        return 0
    t = table("REQUEST", "STATUS", "INSTANCE", "PRIO", "TIME s", right=("PRIO", "TIME s"))
    for r in sorted(rows, key=lambda r: r.created_at):
        took = (r.finished_at or now) - r.created_at
        t.add_row(r.request_id, r.status, r.instance_id, str(r.priority), f"{took:.2f}")
    show(t)
    return 0


def _call(args: argparse.Namespace, call: Callable[[AdminClient], Any], said: Callable[[Any], str],
          ok: Callable[[Any], bool] = lambda _: True) -> int:
    """One call to the admin API: its answer as JSON with --json, else in words (`said`); exit status 0 if `ok`."""
    with client(args) as c:
        result = call(c)
    print(json.dumps(result.model_dump()) if args.json else said(result))
    return 0 if ok(result) else 1


def run_abort(args: argparse.Namespace) -> int:
    return _call(args, lambda c: c.abort(args.request_id), lambda r: f"aborted {r.request_id}")


def run_drain(args: argparse.Namespace) -> int:
    migrate = not args.abort and not args.wait

    def said(r) -> str:  # noqa: ANN001 - the drain's answer
        if migrate:
            return (f"drained {r.instance_id}: no new requests go there; {r.migrated} migrated away, "
                    f"{r.running} still there" + "".join(f"\n  not moved: {m}" for m in r.not_moved))
        what = "aborted" if r.aborted else "left to finish"
        return f"draining {r.instance_id}: no new requests go there; {r.running} running ({what})"
    return _call(args, lambda c: c.drain(args.instance_id, abort=args.abort, migrate=migrate), said,
                 lambda r: not migrate or r.running == 0)


def run_migrate(args: argparse.Namespace) -> int:
    def said(r) -> str:  # noqa: ANN001 - the migration's answer
        if r.status != "finished":
            return f"{r.request_id} stays where it runs: {r.status} ({r.reason})"
        cached = f" ({r.tokens_skipped} more found in its prefix cache)" if r.tokens_skipped else ""
        return (f"migrated {r.request_id}: {r.tokens_copied} KV tokens{cached} in {r.stages} stage(s) while it "
                f"decoded, downtime {r.downtime_s * 1e3:.1f} ms, {r.total_s * 1e3:.1f} ms in all")
    return _call(args, lambda c: c.migrate(args.request_id, args.to), said, lambda r: r.status == "finished")


def run_undrain(args: argparse.Namespace) -> int:
    return _call(args, lambda c: c.undrain(args.instance_id), lambda r: f"{r.instance_id} takes requests again")


def run_models_list(args: argparse.Namespace) -> int:
    rows = [{"name": e.name, "size_mb": e.size_mb, "downloaded": model_store.model_path(e.name).is_file(),
             "path": str(model_store.model_path(e.name)), "description": e.description}
            for e in model_store.CATALOG.values()]
    if args.json:
        print(json.dumps({"cache_dir": str(model_store.cache_dir()), "models": rows}))
        return 0
    print(f"{'NAME':<24} {'MB':>7} {'HERE':<5} DESCRIPTION   (cache: {model_store.cache_dir()})")
    for r in rows:
        print(f"{r['name']:<24} {r['size_mb']:>7.1f} {'yes' if r['downloaded'] else 'no':<5} {r['description']}")
    return 0


def run_models_fetch(args: argparse.Namespace) -> int:
    entry = model_store.lookup(args.name)  # UnknownModelError (a user error) lists the catalog
    with _Progress(entry.name, stages=3) as bar:
        path = model_store.fetch_model(entry.name, progress=bar.stage)
    print(path)
    return 0


# ---- helpers ----------------------------------------------------------------------------------------------
def _nodes(state_path: Path) -> tuple[list[dict] | None, str | None]:
    """The local cluster's nodes (None if there is no state file) and a problem reaching it, if any."""
    if not state_path.exists():
        return None, None
    state = local_cluster.read_state(state_path)
    try:
        found = local_cluster.query_nodes(state.address, timeout_s=20.0, auth_token_path=state.auth_token_path)
        live = {n.name: n for n in found}
    except ClusterError as e:
        return [], f"cluster {state.address}: {e}"
    return [{"name": n.spec.name, "head": n.head, "alive": n.spec.name in live and live[n.spec.name].alive,
             "node_id": live[n.spec.name].node_id if n.spec.name in live else ""} for n in state.nodes], None


def _row(i: InstanceRow, names: dict[str, str] | None = None) -> dict:
    row = i.model_dump(mode="json")
    if names and i.node in names:
        row["node_name"] = names[i.node]
    return row


def _place(place: InstancePlace) -> str:
    """Stages and draft as `node:device[layers]`, e.g. `a100:0[0:15] l4-1:0[15:30]; draft a100:0 (ray)`."""
    stages = " ".join(f"{s.node}:{s.device}[{s.layers[0]}:{s.layers[1]}]" for s in place.stages)
    draft = f"; draft {place.draft.node}:{place.draft.device}" if place.draft else ""
    return f"{stages}{draft} ({place.executor})"


def _load(inst: Instances) -> dict:
    stats = [i.stats for i in inst.instances if i.stats is not None]
    spec = [s.spec for s in stats if s.spec.policy != "off"]
    return {"running": sum(s.load.running for s in stats), "waiting": sum(s.load.waiting for s in stats),
            "in_flight": sum(i.in_flight for i in inst.instances),
            "pending": sum(i.in_flight for i in inst.instances),  # the router's backpressure count
            "kv_blocks_used": sum(s.load.kv_blocks_used for s in stats),
            "kv_blocks_total": sum(s.load.kv_blocks_used + s.load.kv_blocks_free for s in stats),
            "acceptance": round(sum(s.acceptance for s in spec) / len(spec), 4) if spec else None,
            "mean_k": round(sum(s.mean_k for s in spec) / len(spec), 3) if spec else None,
            "draft_ms_per_token": round(1e3 * sum(s.draft_s_per_token for s in spec) / len(spec), 3) if spec else None,
            "calibration_tokens": sum(s.calibration_tokens for s in spec),
            "calibration_s": round(sum(s.calibration_s for s in spec), 3),
            **_prefix_cache([s.prefix_cache for s in stats]),
            **_expert_load([s.moe for s in stats if s.moe.active])}


def _prefix_cache(stats: list[PrefixCacheStats]) -> dict:
    """Fleet-wide prefix cache figures in tokens (each instance's since it started), and the hit rate."""
    queries, hits = sum(s.queries for s in stats), sum(s.hits for s in stats)
    return {"prefix_cache_queries": queries, "prefix_cache_hits": hits,
            "prefix_cache_hit_rate": round(hits / queries, 4) if queries else None}


def _expert_load(ep: list[MoEStats]) -> dict:
    """Expert-parallel figures, mean over the instances that have them (None without any)."""
    mean = lambda f: round(sum(f(s) for s in ep) / len(ep), 4) if ep else None  # noqa: E731
    return {"moe_local_rate": mean(lambda s: s.local_rate),
            "moe_bytes_per_token": mean(lambda s: s.alltoall_bytes_per_token),
            "moe_ms_per_token": mean(lambda s: 1e3 * s.s_per_token)}


def _disaggregation_line(inst: Instances, dispatch: Dispatch) -> str:
    """Prefill/decode disaggregation in one line: instances per role, placements, handoffs (docs/disaggregation.md)."""
    per_role = {r: sum(i.role == r for i in inst.instances) for r in ("prefill", "decode", "both")}
    running = "/".join(str(sum(i.stats.load.running for i in inst.instances if i.role == r and i.stats))
                       for r in per_role)
    d, h = dispatch.disaggregation, dispatch.handoffs
    named = ("disaggregated", "prefix_hit", "short_prompt")
    other = sum(d.values()) - sum(d.get(k, 0) for k in named)
    return (f"disaggregation: {per_role['prefill']} prefill, {per_role['decode']} decode, {per_role['both']} both "
            f"instance(s), running {running}; {d.get('disaggregated', 0)} requests split, {d.get('prefix_hit', 0)} "
            f"decoded where their prefix was cached, {d.get('short_prompt', 0)} short, {other} otherwise; handoffs "
            f"{h.get('finished', 0)} done, {sum(h.values()) - h.get('finished', 0)} not, "
            f"{dispatch.handoffs_pending} waiting for a first token")


def _print_instances(inst: Instances, names: dict[str, str]) -> None:
    """A table of the instances, then each one's place and error, then those removed."""
    numbers = ("FLIGHT", "RUN", "WAIT", "KV USED", "ACCEPT", "K", "STEP ms", "PREFIX HIT")
    t = table("INSTANCE", "MODEL", "NODE", "STATE", *numbers, right=numbers)
    notes = []
    for i in inst.instances:
        state = "unhealthy" if not i.healthy else "draining" if i.draining else "ok"
        s = i.stats
        kv = f"{s.load.kv_blocks_used}/{s.load.kv_blocks_used + s.load.kv_blocks_free}" if s else "-"
        hit = f"{s.prefix_cache.hits / s.prefix_cache.queries:.2f}" if s and s.prefix_cache.queries else "-"
        cols = (str(s.load.running), str(s.load.waiting), kv, f"{s.spec.acceptance:.2f}", f"{s.spec.mean_k:.2f}",
                f"{s.step.step_time_ema_s * 1e3:.1f}", hit) if s else ("-", "-", kv, "-", "-", "-", "-")
        t.add_row(i.instance_id, i.model[:24], names.get(i.node, i.node[:12]), state, str(i.in_flight), *cols)
        notes += [f"{i.instance_id} place: {_place(i.place)}"] if i.place.stages else []
        notes += [f"{i.instance_id} model: {i.backend}"] if i.backend else []
        notes += [f"{i.instance_id} role: {i.role}"] if i.role != "both" else []
        notes += [f"{i.instance_id} error: {i.error}"] if i.error else []
    if inst.instances:
        show(t)
    else:
        print("(no instances registered)")
    for note in notes:
        print(note)
    for r in inst.removed:
        print(f"removed {r.instance_id} (node {names.get(r.node, r.node[:12])}): {r.error}")


class _Progress:
    """A stage bar on stderr for fetch_model's progress messages, redrawn with the elapsed time on a terminal."""

    def __init__(self, name: str, stages: int) -> None:
        self.name, self.stages, self.done, self.message = name, stages, 0, "checking the cache"
        self.t0 = time.monotonic()
        self.tty = sys.stderr.isatty()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._ticker = threading.Thread(target=self._tick, daemon=True) if self.tty else None

    def __enter__(self) -> "_Progress":
        if self._ticker is not None:
            self._ticker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            sys.stderr.write("\n")
            sys.stderr.flush()

    def stage(self, message: str) -> None:
        with self._lock:
            self.done = min(self.stages, self.done + 1)
            self.message = message.removeprefix(f"{self.name}: ")
        self._draw()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            self._draw()

    def _draw(self) -> None:
        with self._lock:
            width = 24
            filled = width * self.done // self.stages
            line = (f"[{'#' * filled}{'-' * (width - filled)}] {self.done}/{self.stages} {self.name}: {self.message} "
                    f"({time.monotonic() - self.t0:.0f}s)")
            sys.stderr.write(f"\r{line[:160]:<160}" if self.tty else line + "\n")
            sys.stderr.flush()
