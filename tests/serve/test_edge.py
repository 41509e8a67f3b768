"""The app closed by default and an edge that hostile clients cannot bend, through real Ray Serve on the local cluster.

Every listening port of the cluster and the app is on loopback; malformed or abusive bodies are 400s with an
OpenAI error body (never 500s); each API key's concurrency, tokens per minute and priority are enforced before
any work; a trickled body is cut off; Serve's gRPC proxy itself refuses a message over the limit.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import psutil
import pytest

from deploy.infra import local_cluster
from deploy.rpc import specfleet_pb2 as pb
from deploy.rpc import specfleet_pb2_grpc as pb_grpc
from tests.serve.conftest import API_KEY, BODY_TIMEOUT_S, CONTEXT, LIMITED_KEYS, MODEL, ServedApp

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def key(name: str) -> str:
    return LIMITED_KEYS[name][0]


def assert_error(r: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def test_every_port_of_the_cluster_and_the_app_listens_on_loopback_only(served_app: ServedApp, ray_cluster) -> None:
    state = local_cluster.read_state(ray_cluster.state_path)
    procs = local_cluster.running_processes(state)
    listening = [(c.laddr.ip, c.laddr.port, p.pid) for p in procs
                 for c in _connections(p) if c.status == psutil.CONN_LISTEN]
    ports = {port for _, port, _ in listening}
    http_port, grpc_port = int(served_app.url.rsplit(":", 1)[1]), int(served_app.grpc_target.rsplit(":", 1)[1])
    assert {state.nodes[0].ports["gcs"], http_port, grpc_port} <= ports  # the GCS and both Serve proxies are seen
    open_ = [(ip, port, " ".join(_cmdline(psutil.Process(pid)))[:120]) for ip, port, pid in listening if ip not in LOOPBACK]
    assert open_ == []
    assert not any("ray.util.client.server" in " ".join(_cmdline(p)) for p in procs)  # no Ray client server


def _connections(p: psutil.Process) -> list:
    try:
        return p.net_connections("inet")
    except psutil.Error:  # exited since the listing
        return []


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


@pytest.mark.parametrize(("route", "raw", "param", "code"), [
    ("/v1/completions", '{"model": "M", "prompt": "hi", "max_tokens": ' + "9" * 5000 + "}", None, "invalid_json"),
    ("/v1/chat/completions", "[" * 200_000, None, "invalid_json"),
    ("/v1/chat/completions", '{"model": "M", "messages": ' + "[" * 50_000 + "]" * 50_000 + "}", None, "invalid_json"),
    ("/v1/completions", b'{"model": "M", "prompt": "\xff\xfe"}', None, "invalid_json"),
])
def test_bodies_that_break_a_parser_are_400s_not_500s(served_app: ServedApp, route: str, raw: str | bytes,
                                                      param: str | None, code: str) -> None:
    with served_app.client() as c:
        r = c.post(route, content=raw.replace("M", MODEL) if isinstance(raw, str) else raw,
                   headers={"content-type": "application/json"})
    assert_error(r, 400, param, code)


@pytest.mark.parametrize(("extra", "param", "code"), [
    ({"priority": 10**29}, "priority", "invalid_value"),
    ({"priority": 1}, "priority", "priority_not_allowed"),  # the key's max_priority is 0
    ({"stop": "x" * 60_000}, "stop", "invalid_value"),
    ({"stop": [f"s{i}" for i in range(17)]}, "stop", "invalid_value"),
    ({"n": 16, "max_tokens": 5000}, "max_tokens", "limit_exceeded"),  # n * max_tokens over serve.edge's bound
    ({"seed": 2**64}, "seed", "invalid_value"),
    ({"top_k": -(2**40)}, "top_k", "invalid_value"),
    ({"functions": [{"name": "f"}]}, "functions", "unsupported_parameter"),
    ({"min_p": 0.5}, "min_p", "unsupported_parameter"),
    ({"presence_penalty": 2.5}, "presence_penalty", "invalid_value"),
    ({"logit_bias": {"1": 101}}, "logit_bias", "invalid_value"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "invalid_value"),
    ({"turbo": True}, "turbo", "unsupported_parameter"),
    # nested past Python's recursion limit: once a RecursionError and a 500
    ({"guided_json": "[" * 2000 + "]" * 2000}, "guided_json", "invalid_value"),
    ({"guided_choice": ["x" * 1001]}, "guided_choice.0", "invalid_value"),
    ({"stop_token_ids": list(range(65))}, "stop_token_ids", "invalid_value"),
])
def test_out_of_bounds_and_unimplemented_fields_are_400s_that_name_the_field(served_app: ServedApp, extra: dict,
                                                                              param: str, code: str) -> None:
    with served_app.client() as c:
        for route, body in (("/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 4}),
                            ("/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                                                      "messages": [{"role": "user", "content": "hello"}]})):
            assert_error(c.post(route, json={**body, **extra}), 400, param, code)


def test_neutral_values_of_unimplemented_fields_are_accepted(served_app: ServedApp) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2, "logprobs": None, "presence_penalty": 0,
            "frequency_penalty": 0.0, "response_format": {"type": "text"}, "user": "someone"}
    with served_app.client() as c:
        assert c.post("/v1/completions", json=body).status_code == 200


def test_too_many_messages_and_a_prompt_too_long_for_the_context_are_refused_before_tokenizing(
        served_app: ServedApp) -> None:
    with served_app.client() as c:
        many = [{"role": "user", "content": "hi"}] * 600
        assert_error(c.post("/v1/chat/completions", json={"model": MODEL, "messages": many}), 400, "messages",
                     "limit_exceeded")
        huge = "lorem ipsum " * 80_000  # ~1 MB: far beyond CONTEXT tokens whatever the tokenizer makes of it
        assert_error(c.post("/v1/completions", json={"model": MODEL, "prompt": huge}), 400, "prompt",
                     "context_length_exceeded")


def read_http_reply(s: socket.socket) -> str:
    """One whole HTTP/1.1 reply: the head, then Content-Length bytes of body (they may come in later segments)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return data.decode(errors="replace")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return (head + b"\r\n\r\n" + body).decode(errors="replace")


def test_a_body_that_trickles_in_is_cut_off_with_408(served_app: ServedApp) -> None:
    host, port = served_app.url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2}).encode()
    with socket.create_connection((host, int(port)), timeout=BODY_TIMEOUT_S + 60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body[:10])
        t0 = time.monotonic()
        reply = read_http_reply(s)  # the rest of the body never comes
        waited = time.monotonic() - t0
    assert reply.startswith("HTTP/1.1 408"), reply[:300]
    assert '"request_timeout"' in reply and waited >= BODY_TIMEOUT_S * 0.9


def test_a_keys_slow_bodies_hold_its_own_slots_only(served_app: ServedApp) -> None:
    """A body being read holds one of its key's `max_concurrent` slots from before its first byte: a key that opens
    slow bodies on every connection it may hold gets 429 on the next at once (not one more connection and 1 MB
    buffer per try), and another key is served meanwhile."""
    host, port = served_app.url.removeprefix("http://").rsplit(":", 1)
    narrow = key("narrow").encode()  # max_concurrent 2
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + narrow + b"\r\nContent-Length: 2000\r\n\r\n{")
    slow = [socket.create_connection((host, int(port)), timeout=BODY_TIMEOUT_S + 60) for _ in range(2)]
    try:
        for s in slow:
            s.sendall(head)  # and never the rest: each holds its read until the body timeout
        time.sleep(0.5)
        with socket.create_connection((host, int(port)), timeout=30) as s:
            t0 = time.monotonic()
            s.sendall(head)
            reply = read_http_reply(s)
        assert reply.startswith("HTTP/1.1 429") and "too_many_concurrent_requests" in reply, reply[:300]
        assert time.monotonic() - t0 < BODY_TIMEOUT_S / 2  # refused before its body, not after the timeout
        with served_app.client() as c:  # another key
            assert c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200
        for s in slow:
            assert read_http_reply(s).startswith("HTTP/1.1 408")
    finally:
        for s in slow:
            s.close()
    with served_app.client(key("narrow")) as c:  # the timed-out reads gave their slots back
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2}).status_code == 200


def test_a_key_refused_as_a_whole_is_answered_by_serves_proxy_until_its_retry_after(served_app: ServedApp) -> None:
    """A key at its max_concurrent is refused by the replica with Retry-After; sent again at once, Serve's HTTP proxy
    answers it (deploy/serve/proxy_guard.py: its own message, the same code), another key is served meanwhile, and
    once the Retry-After has passed the replica decides again."""
    host, port = served_app.url.removeprefix("http://").rsplit(":", 1)
    narrow = key("narrow")  # max_concurrent 2
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Authorization: Bearer " + narrow.encode() + b"\r\nContent-Length: 2000\r\n\r\n{")
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    slow = [socket.create_connection((host, int(port)), timeout=BODY_TIMEOUT_S + 60) for _ in range(2)]
    try:
        for s in slow:
            s.sendall(head)  # each holds one of the key's two slots until the body timeout
        time.sleep(0.5)
        with served_app.client(narrow) as c:
            first = c.post("/v1/completions", json=body)
            again = c.post("/v1/completions", json=body)
        by_replica = assert_error(first, 429, code="too_many_concurrent_requests")
        by_proxy = assert_error(again, 429, code="too_many_concurrent_requests")
        assert "choices in flight" in by_replica["message"] and "refused it less than" in by_proxy["message"]
        assert again.headers["retry-after"] == "1" and "x-specfleet-key-refused" not in first.headers
        with served_app.client() as c:  # another key
            assert c.post("/v1/completions", json=body).status_code == 200
    finally:
        for s in slow:
            s.close()  # the reads end: their slots are given back
    time.sleep(1.2)  # past the Retry-After
    with served_app.client(narrow) as c:
        assert c.post("/v1/completions", json=body).status_code == 200


def test_a_keys_concurrency_limit_counts_choices_and_is_checked_first(served_app: ServedApp) -> None:
    narrow = key("narrow")  # max_concurrent 2
    with served_app.client(narrow) as c:
        assert_error(c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 3}), 400, "n",
                     "limit_exceeded")
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 600, "ignore_eos": True, "temperature": 0}
    start = threading.Barrier(6)

    def send(api_key: str) -> httpx.Response:
        with served_app.client(api_key) as c:
            start.wait()
            return c.post("/v1/completions", json=body)

    with ThreadPoolExecutor(6) as pool:  # 5 at once from one key (each runs for hundreds of steps), 1 from another
        replies = list(pool.map(send, [narrow] * 5 + [API_KEY]))
    refused = [r for r in replies[:5] if r.status_code == 429]
    assert len(refused) >= 3 and all(r.status_code in (200, 429) for r in replies[:5])
    for r in refused:
        assert_error(r, 429, code="too_many_concurrent_requests")
        assert int(r.headers["retry-after"]) >= 1
    assert replies[5].status_code == 200, replies[5].text  # another key is not held back by this one's limit
    with served_app.client(narrow) as c:  # ended requests gave their share back
        assert c.post("/v1/completions", json={**body, "max_tokens": 2}).status_code == 200


def test_a_responses_request_gives_its_bodys_slot_back(served_app: ServedApp) -> None:
    # /v1/responses took one of the key's slots to read its body and never gave it back, so a key with
    # max_concurrent N was refused (429) from its (N+1)th Responses request on, for good
    narrow = key("narrow")  # max_concurrent 2
    body = {"model": MODEL, "input": "hello", "max_output_tokens": 2, "temperature": 0}
    with served_app.client(narrow) as c:
        replies = [c.post("/v1/responses", json=body) for _ in range(4)]
        assert [r.status_code for r in replies] == [200] * 4, [r.text[:200] for r in replies]
        assert all(r.json()["status"] in ("completed", "incomplete") for r in replies)
        assert c.post("/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 2,
                                                "n": 2}).status_code == 200  # both of its slots are free


def test_a_keys_tokens_per_minute_count_prompt_and_n_times_max_tokens(served_app: ServedApp) -> None:
    with served_app.client(key("metered")) as c:  # 200 tokens per minute
        assert_error(c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 100,
                                                     "n": 2}), 400, "max_tokens", "limit_exceeded")  # 203 > 200
        ok = c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 150})
        assert ok.status_code == 200, ok.text
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 150})
        assert_error(r, 429, code="tokens_per_minute_exceeded")
        assert 1 <= int(r.headers["retry-after"]) <= 60


def test_a_keys_max_priority_caps_the_priority_it_may_ask_for(served_app: ServedApp) -> None:
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    with served_app.client(key("vip")) as c:  # max_priority 10
        assert c.post("/v1/completions", json={**body, "priority": 10}).status_code == 200
        assert_error(c.post("/v1/completions", json={**body, "priority": 11}), 400, "priority", "priority_not_allowed")
    with served_app.client() as c:
        assert c.post("/v1/completions", json={**body, "priority": -5}).status_code == 200  # lower is always allowed


def test_serves_grpc_proxy_refuses_a_message_over_the_limit_before_it_crosses(served_app: ServedApp) -> None:
    with grpc.insecure_channel(served_app.grpc_target, options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
        stub = pb_grpc.SpecfleetStub(ch)
        request = pb.GenerateRequest(model=MODEL, prompt="x" * (1 << 20) + "y" * 1000, max_tokens=2)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(request, metadata=[("authorization", f"Bearer {API_KEY}")], timeout=60)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # grpc's own message, from the proxy's server: the replica's check would say "serve.max_request_bytes"
    assert "larger than max" in err.value.details(), err.value.details()
