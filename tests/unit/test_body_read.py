"""The API's body read (deploy/serve/http_api.py `_read`): a client that leaves before its body arrived is a 499,
not the 500 (and the ERROR traceback in the replica's log) that a disconnect mid-body used to give."""

from __future__ import annotations

import asyncio

import pytest
from starlette.requests import Request

from deploy.serve.http_api import _read
from deploy.serve.openai_api import APIError


def _request(messages: list[dict]) -> Request:
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [(b"content-length", b"64")]}
    pending = list(messages)

    async def receive() -> dict:
        return pending.pop(0)

    return Request(scope, receive)


def test_a_client_gone_mid_body_is_a_499() -> None:
    request = _request([{"type": "http.request", "body": b'{"model": ', "more_body": True},
                        {"type": "http.disconnect"}])
    with pytest.raises(APIError) as e:
        asyncio.run(_read(request, limit=1024, timeout_s=5.0))
    assert e.value.status == 499 and e.value.code == "client_closed_request"


def test_a_whole_body_is_read() -> None:
    request = _request([{"type": "http.request", "body": b'{"a": ', "more_body": True},
                        {"type": "http.request", "body": b'1}', "more_body": False}])
    assert asyncio.run(_read(request, limit=1024, timeout_s=5.0)) == b'{"a": 1}'
