"""A choice's task in `Call` (deploy/serve/frontend.py) is supervised: whatever it raises ends that choice with an error
item and releases it, instead of leaving the client's iteration waiting for good."""

from __future__ import annotations

import asyncio

from cluster.config import EngineConfig, ModelConfig, SpecfleetConfig
from cluster.request import FinishReason, RequestStatus
from deploy.serve.frontend import Call, Frontend
from deploy.serve.frontend_config import frontend_config


class _Raises:
    """An instance handle whose stream cannot even be opened: submitting it raises a plain TypeError (a fault to
    inject; Ray itself raises RayError subclasses, which the stream already handled)."""

    class _Method:
        def options(self, **_):
            return self

        def remote(self, *_):
            raise TypeError("an unexpected argument")

    generate = _Method()


def test_a_choice_whose_task_raises_ends_with_an_error_and_is_released(tiny_models, caplog) -> None:
    frontend = Frontend(frontend_config(SpecfleetConfig(engine=EngineConfig(model=ModelConfig(
        target=str(tiny_models["llama"]))))), router=None)
    released = []
    frontend.release = lambda ids, routed, status, abort=False: released.append((tuple(ids), status, abort))
    prep = frontend.prepare([1, 2, 3], max_tokens=4, temperature=0.0, top_p=1.0, top_k=0, seed=None, stop=(), n=2,
                            priority=0, ignore_eos=True)
    call = Call(frontend, prep, [f"{prep.request_id}-0", f"{prep.request_id}-1"], [("i0", _Raises())] * 2)

    async def consume():
        return [item async for item in call]

    items = asyncio.run(asyncio.wait_for(consume(), 30))  # it used to wait forever

    assert sorted(i for i, _ in items) == [0, 1]
    for _, item in items:  # the client reads a request id, never the server's own error text (issue 39)
        assert item.delta.finish_reason is FinishReason.ERROR and "TypeError" not in item.delta.error
        assert f"request id {item.delta.request_id}" in item.delta.error
    assert "TypeError: an unexpected argument" in caplog.text  # the cause is in the server's log
    assert sorted(r[0][0] for r in released) == sorted(call.ids)
    assert {r[1] for r in released} == {RequestStatus.FAILED}
