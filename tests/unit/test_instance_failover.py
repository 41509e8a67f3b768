"""An instance whose engine loop has stopped answers a new request as a failed instance (the API replica then fails
it over to another), not with a plain error the client sees as the request's (actors/serving/server.py)."""

from __future__ import annotations

import asyncio

from actors.serving.server import InstanceServer
from cluster.request import FinishReason, Request, SamplingParams
from placement.fleet import InstanceSpec
from tests.ray.test_instance_server import LAYOUTS, engine_config


async def _items(server: InstanceServer, request: Request) -> list:
    return [item async for item in server.generate(request)]


def test_a_stopped_loop_answers_as_a_failed_instance(tiny_models, tiny_draft_models) -> None:
    spec = InstanceSpec(instance_id="test-stopped", layout=LAYOUTS["local"], executor="local", num_cpus=1,
                        engine=engine_config(tiny_models["llama"], tiny_draft_models["llama"]))
    server = InstanceServer(spec)
    server.loop.close()
    items = asyncio.run(_items(server, Request("r", (1, 2, 3), SamplingParams(max_tokens=2))))
    assert len(items) == 1 and items[0].delta.finish_reason == FinishReason.ERROR
    assert items[0].delta.instance_failure and not items[0].rejected  # failed over, not the client's error
