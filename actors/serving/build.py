"""Build an instance whose shards are Ray actors: placement group, shard actors, the stages' process group.

    instance = ray_instance(engine_cfg, ShardLayout.from_plan(plan(...).instances[0]))
    completions = generate(instance, prompts, params)   # the engine runs in this process, the stages in actors
    instance.shutdown()

Every step is bounded by a timeout; if one fails, everything started so far is stopped and the placement
group removed before the error propagates.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import ray
import torch
from ray.actor import ActorHandle
from ray.util.placement_group import PlacementGroup

from actors.executors.experts import ep_stages
from actors.executors.protocol import StageExecutor
from actors.shards.expert import ExpertSpec
from actors.shards.group import MemberSpec
from actors.serving.instance import Instance
from actors.engine.loading import load_runners
from actors.executors.local import LocalStages
from actors.model.loader import LoadedModel, load_metadata, load_model_config
from actors.executors.pipeline import PipelineRunner
from actors.executors.rank_group import gather
from actors.executors.remote import GroupStages, RayStages
from actors.shards.stage import ShardSpec
from actors.shards.ray_actors import ExpertActor, LeaderActor, MemberActor, StageActor
from actors.speculation import draft_group
from actors.start_phases import phase
from cluster.config import DraftParallelConfig, EngineConfig, ExpertParallelConfig
from placement import realize
from placement.layout import ShardLayout
from placement.planner import PlacementError


@dataclass(frozen=True)
class StageGroup:
    """Stage actors of one model in pipeline order, their names for messages, and each one's layers."""

    actors: tuple[ActorHandle, ...]
    names: tuple[str, ...]
    layer_ids: tuple[tuple[int, ...], ...]

    def executor(self, model: LoadedModel, timeout_s: float) -> StageExecutor:
        """The executor that drives them, each call bounded by `timeout_s`."""
        return RayStages(self.actors, self.names, self.layer_ids, timeout_s)


@dataclass(frozen=True)
class DraftGroup(StageGroup):
    """An EasySpec draft group: its leader first (it holds the whole draft's layers, `layer_ids[0]`), then members."""

    def executor(self, model: LoadedModel, timeout_s: float) -> StageExecutor:
        return GroupStages(self.actors, self.names, self.layer_ids[0], timeout_s)


@dataclass(frozen=True)
class ExpertGroup(StageGroup):
    """Expert-parallel ranks of the target in rank order, each with every layer."""

    experts: ExpertParallelConfig

    def executor(self, model: LoadedModel, timeout_s: float) -> StageExecutor:
        return ep_stages(self.actors, self.names, model, timeout_s, self.experts)


@dataclass(frozen=True)
class Shards:
    """An instance's shard actors, the placement group holding them, and its target process group's backend."""

    target: StageGroup
    draft: StageGroup | None
    layout: ShardLayout
    placement_group: PlacementGroup
    backend: str | None  # "gloo" or "nccl"; None for a single stage (no activations to move)

    def kill(self) -> None:
        for group in (self.target, self.draft):
            for actor in group.actors if group else ():
                ray.kill(actor, no_restart=True)
        realize.release(self.placement_group)


def shard_specs(cfg: EngineConfig, layout: ShardLayout) -> tuple[list[ShardSpec] | list[ExpertSpec], ShardSpec | None]:
    """What each target stage (or expert rank) and the draft load; PlacementError if the layout does not fit the
    config."""
    m, ep = cfg.model, cfg.experts
    num_layers = load_model_config(m.target, m.backend).num_hidden_layers
    layout.check(num_layers)
    last = len(layout.stages) - 1
    stages: list[ShardSpec] | list[ExpertSpec]
    if ep.enabled:  # expert parallelism: each slot of the layout is one rank, holding every layer
        if len(layout.stages) != ep.ranks:
            raise PlacementError(f"experts.ranks is {ep.ranks}, the layout has {len(layout.stages)} slots for them")
        stages = expert_rank_specs(cfg, num_layers)
    else:
        stages = [ShardSpec(m.target, m.dtype, s.layer_ids, first=i == 0, last=i == last, cache=cfg.cache,
                            device=m.device, weights=m.weights, activations=m.activations, backend=m.backend,
                            deterministic=cfg.deterministic)
                  for i, s in enumerate(layout.stages)]
    draft = draft_spec(cfg)
    if draft is not None and layout.draft_node is None:
        raise PlacementError("the engine config names a draft, but the layout places none (draft_node)")
    return stages, draft


def expert_rank_specs(cfg: EngineConfig, num_layers: int) -> list[ExpertSpec]:
    """What each expert-parallel rank of the target loads: every layer, its slice of the (planned) experts."""
    m, ep = cfg.model, cfg.experts
    shard = ShardSpec(m.target, m.dtype, tuple(range(num_layers)), first=True, last=True, cache=cfg.cache,
                      device=m.device, weights=m.weights, activations=m.activations)
    return [ExpertSpec(shard, rank=i, size=ep.ranks, plan=ep.plan, attention=ep.attention,
                       stats=ep.stats if ep.attention == "tensor" else None, confidence=ep.confidence)
            for i in range(ep.ranks)]


def draft_spec(cfg: EngineConfig) -> ShardSpec | None:
    """What the draft shard loads (the leader of an EasySpec group); None when the config drafts with no model."""
    m = cfg.model
    if cfg.speculation.policy == "off" or (m.draft is None and m.draft_layers is None):
        return None
    if m.draft is not None:
        source, layer_ids = m.draft, tuple(range(load_model_config(m.draft, m.backend).num_hidden_layers))
    else:
        source, layer_ids = m.target, tuple(m.draft_layers or ())
    return ShardSpec(source, m.dtype, layer_ids, first=True, last=True, cache=cfg.cache,
                     quantization=m.draft_quantization, weights=m.weights, activations=m.activations,
                     backend=m.backend, device=m.device, draft_parallel=cfg.speculation.draft_parallel)


def member_specs(draft: ShardSpec) -> list[MemberSpec]:
    """The EasySpec group members beyond the draft shard, ranks 1.. in order, each with the layers it runs."""
    cfg = draft.draft_parallel
    if not cfg.enabled:
        return []
    owner = draft_group.group_owners(cfg, draft.layer_ids)
    return [MemberSpec(replace(draft, layer_ids=tuple(i for i in draft.layer_ids if owner[i] == rank), first=False,
                               last=False, draft_parallel=DraftParallelConfig()),
                       rank=rank, draft_layers=draft.layer_ids, groups=cfg)
            for rank in range(1, draft_group.world_size(cfg, len(draft.layer_ids)))]


def build_shards(cfg: EngineConfig, layout: ShardLayout, *, num_cpus: float = 1.0,
                 ready_timeout_s: float = 300.0, group_timeout_s: float = 60.0, name: str = "") -> Shards:
    """Reserve the layout's bundles, start and load every shard, and join the target stages' process group.

    With a `name`, the placement group is called so and the actors f"{name}/stage-{i}" and f"{name}/draft".
    """
    stage_specs, draft_shard = shard_specs(cfg, layout)
    if draft_shard is None:
        layout = layout.model_copy(update={"draft_node": None})
    pg = realize.reserve(layout.bundles(num_cpus), name=name, timeout_s=ready_timeout_s)
    actors: list[ActorHandle] = []
    try:
        member = member_specs(draft_shard) if draft_shard else []
        shared = {(s.rank - 1) % len(layout.stages) for s in member}  # stages that host a draft member
        names = [f"expert rank {i} on {s.node}:{s.device}" if cfg.experts.enabled else
                 f"stage {i} on {s.node}:{s.device} (layers {s.layers[0]}-{s.layers[1] - 1})"
                 for i, s in enumerate(layout.stages)]
        role = ExpertActor if cfg.experts.enabled else StageActor
        for i, spec in enumerate(stage_specs):
            gpus = layout.stages[i].gpus / (2 if i in shared else 1)  # a draft member shares its GPU (_spawn_members)
            actors.append(role.spawn(spec, pg, i, num_cpus=num_cpus, num_gpus=gpus,
                                     name=f"{name}/stage-{i}" if name else None))
        draft = None
        if draft_shard is not None:
            leader = LeaderActor if member else StageActor
            actors.append(leader.spawn(draft_shard, pg, layout.draft_bundle, num_cpus=num_cpus,
                                       num_gpus=layout.draft_gpus, name=f"{name}/draft" if name else None))
            members = [(actors[-1], f"draft on {layout.draft_node}:{layout.draft_device}")]
            members += _spawn_members(member, layout, pg, name)  # EasySpec ranks 1.., if any
            actors += [a for a, _ in members[1:]]
            draft = (DraftGroup if member else StageGroup)(tuple(a for a, _ in members), tuple(n for _, n in members),
                                                           (draft_shard.layer_ids,))
        all_names = names + (list(draft.names) if draft else [])
        gather([a.ready.remote() for a in actors], all_names, "load", ready_timeout_s)
        if isinstance(draft, DraftGroup):
            _join(list(draft.actors), list(draft.names), ready_timeout_s, group_timeout_s)
        stages = actors[:len(stage_specs)]
        backend = _join(stages, names, ready_timeout_s, group_timeout_s) if len(stages) > 1 else None
        target_ids = tuple(s.shard.layer_ids if isinstance(s, ExpertSpec) else s.layer_ids for s in stage_specs)
        target = (ExpertGroup(tuple(stages), tuple(names), target_ids, experts=cfg.experts) if cfg.experts.enabled
                  else StageGroup(tuple(stages), tuple(names), target_ids))
        return Shards(target, draft, layout, pg, backend)
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        realize.release(pg)
        raise


def draft_group_runner(cfg: EngineConfig, *, num_cpus: float = 1.0, timeout_s: float = 300.0,
                       step_timeout_s: float = 60.0) -> tuple[PipelineRunner, Callable[[], None]]:
    """`cfg`'s draft as shard actors anywhere in the connected Ray cluster (no layout: benchmarks on one machine):
    the draft shard and, for EasySpec groups, its members, each with `num_cpus` CPUs (its torch threads). Returns
    the draft's runner, for an Engine in this process, and the function that stops the actors."""
    m = cfg.model
    spec = draft_spec(cfg)
    if spec is None:
        raise ValueError("the config has no draft model to run")
    member = member_specs(spec)
    actors = [(LeaderActor if member else StageActor).spawn(spec, None, 0, num_cpus=num_cpus)]
    actors += [MemberActor.spawn(s, None, 0, num_cpus=num_cpus) for s in member]
    names = ["draft"] + [f"draft member {s.rank}" for s in member]

    def stop() -> None:
        for actor in actors:
            ray.kill(actor, no_restart=True)
    try:
        gather([a.ready.remote() for a in actors], names, "load", timeout_s)
        if len(actors) > 1:
            _join(actors, names, timeout_s, timeout_s)
        group = (DraftGroup if member else StageGroup)(tuple(actors), tuple(names), (spec.layer_ids,))
        model = load_metadata(m.draft if m.draft is not None else m.target, m.dtype, m.backend)
        return PipelineRunner(model, cfg.cache, group.executor(model, step_timeout_s)), stop
    except BaseException:
        stop()
        raise


def expert_parallel_runner(cfg: EngineConfig, *, num_cpus: float = 1.0, timeout_s: float = 300.0
                           ) -> tuple[PipelineRunner, Callable[[], None]]:
    """`cfg`'s MoE target as `cfg.experts.ranks` expert-parallel rank actors anywhere in the connected Ray cluster
    (no layout: benchmarks on one machine), each with `num_cpus` CPUs. Returns the target's runner, for an
    Engine in this process, and the function that stops the actors."""
    if not cfg.experts.enabled:
        raise ValueError("the config asks for no expert parallelism (experts.ranks is 1)")
    model = load_metadata(cfg.model.target, cfg.model.dtype, cfg.model.backend)
    specs = expert_rank_specs(cfg, model.num_layers)
    actors = [ExpertActor.spawn(s, None, 0, num_cpus=num_cpus) for s in specs]
    names = [f"expert rank {i}" for i in range(len(specs))]

    def stop() -> None:
        for actor in actors:
            ray.kill(actor, no_restart=True)
    try:
        gather([a.ready.remote() for a in actors], names, "load", timeout_s)
        _join(actors, names, timeout_s, timeout_s)
        stages = ep_stages(actors, names, model, timeout_s, cfg.experts)
        return PipelineRunner(model, cfg.cache, stages), stop
    except BaseException:
        stop()
        raise


def _join(actors: list[ActorHandle], names: list[str], ready_timeout_s: float, group_timeout_s: float) -> str:
    """Join `actors` into one process group, ranks in order (rank 0 hosts the rendezvous); returns its backend."""
    [address] = gather([actors[0].rendezvous_address.remote()], names[:1], "rendezvous", ready_timeout_s)
    devices = gather([a.device.remote() for a in actors], names, "device", ready_timeout_s)
    backend = "nccl" if all(d.startswith("cuda") for d in devices) else "gloo"  # gloo if any member is on a CPU
    joins = [a.join.remote(address, rank, len(actors), group_timeout_s, backend) for rank, a in enumerate(actors)]
    return gather(joins, names, "process group", group_timeout_s + 30)[0]


def _spawn_members(members: list[MemberSpec], layout: ShardLayout, pg: PlacementGroup,
                   name: str) -> list[tuple[ActorHandle, str]]:
    """The EasySpec group members beyond the draft shard (rank 0), each with the layers it runs, on the devices of
    the instance's target stages (idle while the draft runs): member r beside stage (r - 1) mod stages, taking no
    CPU of its own (on a GPU it shares the stage's device)."""
    out = []
    for spec in members:
        rank = spec.rank
        stage = (rank - 1) % len(layout.stages)
        slot = layout.stages[stage]
        actor = MemberActor.spawn(spec, pg, stage, num_cpus=0, num_gpus=slot.gpus / 2 if slot.gpus else 0.0,
                                  name=f"{name}/draft-{rank}" if name else None)
        out.append((actor, f"draft member {rank} on {slot.node}:{slot.device}"))
    return out


def ray_instance(cfg: EngineConfig, layout: ShardLayout, *, num_cpus: float = 1.0,
                 ready_timeout_s: float = 300.0, group_timeout_s: float = 60.0, step_timeout_s: float = 60.0,
                 name: str = "", calibration_dir: Path | None = None) -> Instance:
    """An Instance of `cfg`'s model pair (files, already resolved) whose stages and draft are actors laid out as
    `layout`; the engine runs in the calling process (its calibration kept in `calibration_dir`: Instance).

    Shards get `num_cpus` CPUs each and the GPUs their layout slot names (`gpus`). A shard that does not answer
    a step within `step_timeout_s` counts as failed; a transfer between stages gives up after `group_timeout_s`.
    """
    with phase("shards"):  # their actors started, each loading its layers in its own process
        shards = build_shards(cfg, layout, num_cpus=num_cpus, ready_timeout_s=ready_timeout_s,
                              group_timeout_s=group_timeout_s, name=name)
    try:
        m = cfg.model
        target_model = load_metadata(m.target, m.dtype, m.backend)
        target = PipelineRunner(target_model, cfg.cache, shards.target.executor(target_model, step_timeout_s))
        draft = None
        if shards.draft is not None:
            draft_model = load_metadata(m.draft, m.dtype, m.backend) if m.draft is not None else target_model
            draft = PipelineRunner(draft_model, cfg.cache, shards.draft.executor(draft_model, step_timeout_s))
        return Instance(cfg, target, draft, release=shards.kill, calibration_dir=calibration_dir,
                        placement=layout.model_dump(mode="json"))  # remote stages: their times depend on where
    except BaseException:
        shards.kill()
        raise


def local_instance(cfg: EngineConfig, stages: Sequence[tuple[int, int]] | None = None,
                   device: torch.device | str | None = None, calibration_dir: Path | None = None) -> Instance:
    """An Instance whose stages (and draft) all run in this process, on `device` (default: the config's); its
    goodput calibration kept in `calibration_dir` (Instance)."""
    target, draft = load_runners(cfg, stages, device)
    pipeline = PipelineRunner(target[0].model, cfg.cache, LocalStages(target), target[-1].device)
    draft_pipeline = None
    if draft is not None:
        draft_pipeline = PipelineRunner(draft.model, cfg.cache, LocalStages([draft], ["draft (in process)"]),
                                        draft.device)
    return Instance(cfg, pipeline, draft_pipeline, calibration_dir=calibration_dir)
