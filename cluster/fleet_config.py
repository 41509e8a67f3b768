"""The fleet's shape (`fleet:` in the config): how many engine instances, of how many stages, with what resources.

The router actor dispatches to whatever instances register with it and reads none of this; the app plans and starts
the fleet from it (placement/fleet.py, deploy/serve/app.py) and the autoscaler grows and shrinks it. As in a Ray Serve
deployment's options, where `num_replicas` and `autoscaling_config` sit side by side, the fixed size and the
autoscaling bounds live in one section, so the rule that relates them is this section's own.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.autoscale import AutoscalingConfig


def starts_at_min(raw: object) -> object:
    """A raw `fleet` mapping with `instances` defaulted to `autoscaling.min_instances` (an autoscaled fleet starts at
    its minimum), for FleetConfig's validation."""
    if isinstance(raw, dict) and isinstance(raw.get("autoscaling"), dict) and "instances" not in raw:
        return {**raw, "instances": raw["autoscaling"].get("min_instances", 1)}
    return raw


class FleetConfig(BaseModel):
    """The engine instances the app starts (deploy/serve/app.py) and how each is placed (placement/fleet.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    instances: int = Field(default=1, ge=1)  # engine instances to start
    # 1: each instance is one process; N > 1: the target split over N stage actors (plus a draft actor),
    # placed by the planner over the cluster's labelled nodes (placement/planner.py, actors/serving/build.py)
    pipeline_stages: int = Field(default=1, ge=1)
    instance_num_cpus: float = Field(default=1.0, ge=0.0)  # CPUs each instance's engine (and each shard) reserves
    # custom Ray resources each instance's engine actor needs, e.g. an accelerator kind of the inventory
    # (placement/inventory.py, ray_resources) to pin instances to a worker group
    instance_resources: dict[str, float] = {}
    # SLO autoscaling (cluster/autoscale.py, docs/autoscaling.md); absent: a fixed fleet of `instances`; with it the
    # fleet starts at min_instances (`instances` defaults to it and may not differ)
    autoscaling: AutoscalingConfig | None = None

    _starts_at_min = model_validator(mode="before")(classmethod(lambda cls, raw: starts_at_min(raw)))

    @model_validator(mode="after")
    def _instances_at_min(self) -> "FleetConfig":
        if self.autoscaling is not None and self.instances != self.autoscaling.min_instances:
            raise ValueError(f"fleet.instances ({self.instances}) must equal fleet.autoscaling.min_instances "
                             f"({self.autoscaling.min_instances}): an autoscaled fleet starts at its minimum")
        return self

    def __hash__(self) -> int:  # frozen, but a dict field is unhashable: hash the canonical JSON instead
        return hash(self.model_dump_json())


# the keys that lived under `router` before the fleet's shape got its own section: a config still naming them is
# told where each went (cluster/config_file.py), never silently read another way
MOVED_TO_FLEET = {f"router.{key}": f"fleet.{key}" for key in FleetConfig.model_fields}
