"""A background round that raises is counted where operators look (/metrics, `specfleet status`), not only logged.

Last session every migration-planning round raised AttributeError for hours, caught per round and logged: nothing in
/metrics or `specfleet status` showed it. These run the real router's planning loop with a fault in its table.
"""

from __future__ import annotations

import asyncio

from cluster.config import MigrationConfig, RouterConfig
from cluster.router import Router
from cluster.stats import FailedRounds
from deploy.cli.admin_client import Autoscaling, Dispatch
from deploy.cli.admin_cmd import failed_rounds_lines
from deploy.serve.metrics import Metrics


class NotAnInstance:
    """A handle registered as an instance that has none of an instance's methods (an actor of another kind, or of an
    older version): reading its load raises AttributeError, as the planning round of last session's defect did."""


def test_each_failed_planning_round_is_counted_and_planning_goes_on() -> None:
    cfg = RouterConfig(stats_interval_s=60.0,  # no health poll removes the faulty entry while planning runs
                       migration=MigrationConfig(policies=("balance",), interval_s=0.05))

    async def scenario() -> None:
        router = Router(cfg)
        for i in ("i0", "i1"):  # two instances: planning runs
            await router.register(i, NotAnInstance(), "m", 64, "node", incarnation=i)
        for _ in range(100):
            if router.failed_rounds.counts.get("migration_plan", 0) >= 3:  # round after round, it keeps planning
                break
            await asyncio.sleep(0.05)
        stats = await router.routing_stats()
        assert stats.failed_rounds["migration_plan"] >= 3, stats
        assert stats.last_round_error["migration_plan"].startswith("AttributeError:"), stats.last_round_error
        assert "load" in stats.last_round_error["migration_plan"]

        m = Metrics("m")
        m.routing_figures = stats
        text = m.render().decode()
        n = stats.failed_rounds["migration_plan"]
        assert f'specfleet:router_failed_rounds_total{{loop="migration_plan"}} {float(n)}' in text
        assert 'specfleet:router_failed_rounds_total{loop="handoff"} 0.0' in text  # every loop has its series
        [line] = failed_rounds_lines(Dispatch(**stats.as_dict()), Autoscaling(enabled=False))
        assert line.startswith(f"WARNING: {n} router migration_plan round(s) failed") and "AttributeError" in line

        # the fault gone (one instance left: nothing to plan), the count stops rising
        await router.deregister("i1")
        await asyncio.sleep(0.1)
        settled = router.failed_rounds.counts["migration_plan"]
        await router.undrain("i0")  # wakes the planner for a round that now succeeds
        await asyncio.sleep(0.3)
        assert router.failed_rounds.counts["migration_plan"] == settled

    asyncio.run(scenario())


def test_no_failed_round_no_warning_and_the_autoscalers_own_count() -> None:
    assert failed_rounds_lines(Dispatch(policy="least_load", decisions={}, index_entries=0, index_instances=0),
                               Autoscaling(enabled=True)) == []
    failed = FailedRounds()
    failed.record("autoscale", ConnectionError("router away"))
    failed.record("autoscale", ConnectionError("router still away"))
    a = Autoscaling(enabled=True, failed_rounds=failed.counts["autoscale"], last_failure=failed.last_error["autoscale"])
    [line] = failed_rounds_lines(Dispatch(policy="least_load", decisions={}, index_entries=0, index_instances=0), a)
    assert line == ("WARNING: 2 autoscaler round(s) failed since it started; last: ConnectionError: router still away "
                    "(see its log)")
