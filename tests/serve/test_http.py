"""The OpenAI-compatible HTTP API through real Ray Serve on the local cluster: outputs, streaming, auth, errors."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.serve.conftest import ADMIN_KEY, API_KEY, CONTEXT, LIMITED_KEYS, MAX_PENDING, MODEL, ServedApp, specfleet
from tests.unit.helpers import load, reference_greedy, text_prompts


def sse_events(response: httpx.Response) -> list[dict | str]:
    """The `data:` payloads of a server-sent-event stream, JSON-decoded except the final [DONE]."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def kv_blocks_used(app: ServedApp) -> list[int]:
    with app.client(ADMIN_KEY) as c:
        rows = c.get("/admin/instances").json()["instances"]
    return [r["stats"]["kv_blocks_used"] + r["stats"]["draft_kv_blocks_used"] for r in rows if r["stats"]]


def wait_kv_free(app: ServedApp, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (used := kv_blocks_used(app)) != [0, 0]:
        assert time.monotonic() < deadline, f"KV blocks still in use: {used}"
        time.sleep(0.2)


def test_greedy_completions_equal_the_targets_own_output_through_the_whole_stack(served_app: ServedApp) -> None:
    prompts = text_prompts(load(served_app.target), 4, offset=20)
    with served_app.client() as c:
        for prompt in prompts:
            r = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200, r.text
            body = r.json()
            expected = reference_greedy(served_app.target, prompt, 24)
            tokenizer = load(served_app.target).tokenizer
            assert body["choices"][0]["text"] == tokenizer.decode(expected, skip_special_tokens=True)
            assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(expected),
                                     "total_tokens": len(prompt) + len(expected)}
            spec = body["spec_decode"]
            assert spec["proposed_tokens"] >= spec["accepted_tokens"] >= 0 and spec["rounds"] > 0


def test_streaming_sends_chunks_before_the_end_and_ends_with_done(served_app: ServedApp) -> None:
    prompt = text_prompts(load(served_app.target), 1, offset=3)[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    arrivals, events = [], []
    with served_app.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
                payload = line[len("data: "):]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if e["choices"]]
    assert len(chunks) >= 3 and arrivals[-1] - arrivals[0] > 0  # several chunks, not one burst at the end
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] == "length"
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    usage = events[-2]["usage"]
    assert usage["completion_tokens"] == 40 and events[-2]["spec_decode"]["proposed_tokens"] > 0
    tokenizer = load(served_app.target).tokenizer
    expected = reference_greedy(served_app.target, prompt, 40)
    if tokenizer.eos_token_id not in expected:  # ignore_eos: the reference stops at EOS, we do not
        assert "".join(c["choices"][0]["text"] for c in chunks) == tokenizer.decode(expected, skip_special_tokens=True)


def test_chat_applies_the_template_and_streams_role_then_content(served_app: ServedApp) -> None:
    messages = [{"role": "user", "content": "Name three colours."}]
    tokenizer = load(served_app.target).tokenizer
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    expected = tokenizer.decode(reference_greedy(served_app.target, list(ids), 12), skip_special_tokens=True)
    with served_app.client() as c:
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_completion_tokens": 12,
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": expected}
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        with c.stream("POST", "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 12,
                                                            "temperature": 0, "stream": True}) as s:
            events = sse_events(s)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant" and events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == expected


def test_stop_strings_cut_the_text_and_seeds_reproduce_samples(served_app: ServedApp) -> None:
    prompt = text_prompts(load(served_app.target), 1, offset=7)[0]
    with served_app.client() as c:
        full = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 30, "temperature": 0,
                                               "ignore_eos": True}).json()["choices"][0]["text"]
        stop = full[10:13]
        cut = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 30, "temperature": 0,
                                              "ignore_eos": True, "stop": [stop]}).json()["choices"][0]
        assert cut["finish_reason"] == "stop" and cut["text"] == full[:full.index(stop)]
        sampled = [c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 20,
                                                   "temperature": 1.0, "seed": seed, "ignore_eos": True}).json()
                   for seed in (11, 11, 12)]
    texts = [s["choices"][0]["text"] for s in sampled]
    assert texts[0] == texts[1] != texts[2]


def test_n_choices_and_the_official_openai_client_streaming_included(served_app: ServedApp) -> None:
    client = openai.OpenAI(base_url=f"{served_app.url}/v1", api_key=API_KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.completions.create(model=MODEL, prompt="hello there", max_tokens=8, temperature=0.8, n=3, seed=5)
    assert sorted(c.index for c in out.choices) == [0, 1, 2] and out.usage.completion_tokens > 0
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                          temperature=0)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    parts, usage = [], None
    for chunk in stream:
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        usage = chunk.usage or usage
    assert "".join(parts) == chat.choices[0].message.content
    assert usage is not None and usage.completion_tokens == chat.usage.completion_tokens
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{served_app.url}/v1", api_key="wrong", max_retries=0).models.list()


BAD_INPUTS = [
    pytest.param("/v1/completions", b"{not json", 400, "invalid_json", id="malformed JSON"),
    pytest.param("/v1/completions", b"[1, 2]", 400, "invalid_json", id="not an object"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "many"}, 400, "max_tokens",
                 id="wrong type"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature",
                 id="negative temperature"),
    pytest.param("/v1/completions", {"model": "gpt-9", "prompt": "x"}, 404, "model", id="unknown model"),
    pytest.param("/v1/completions", {"prompt": "x"}, 400, "model", id="no model"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens",
                 id="max_tokens 0"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 10_000}, 400, "max_tokens",
                 id="max_tokens beyond the context"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "word " * 2 * CONTEXT}, 400, "prompt",
                 id="prompt too long"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", id="empty prompt"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": [10**9]}, 400, "prompt", id="token id out of range"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop", id="empty stop"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n", id="n 0"),
    pytest.param("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", id="empty messages"),
    pytest.param("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400,
                 "messages", id="unknown role"),
    pytest.param("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "messages", id="messages a string"),
    pytest.param("/v1/nothing", {}, 404, None, id="unknown route"),
    # strict types and the one set of bounds (cluster/request.py, SamplingParams)
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "12"}, 400, "max_tokens",
                 id="a number as a string"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 12.0}, 400, "max_tokens",
                 id="a float for an integer"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "stream": 1}, 400, "stream",
                 id="an integer for a bool"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "temperature": 2.5}, 400, "temperature",
                 id="temperature above 2"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p", id="top_p 0"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "seed", id="huge seed"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "seed": -1}, 400, "seed", id="negative seed"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "seed": 2**63 - 1, "n": 2}, 400, "seed",
                 id="seed + choice beyond the bound"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "x", "stop": [str(i) for i in range(17)]}, 400,
                 "stop", id="17 stop strings"),
    pytest.param("/v1/completions", {"model": MODEL, "prompt": "x" * (1 << 20)}, 413, "request_too_large",
                 id="body over the size limit"),
]


@pytest.mark.parametrize(("path", "body", "status", "param"), BAD_INPUTS)
def test_bad_input_gets_an_openai_error_body_and_disturbs_nothing_in_flight(served_app: ServedApp, path, body,
                                                                             status, param) -> None:
    prompt = text_prompts(load(served_app.target), 1, offset=5)[0]
    result: dict = {}

    def bystander() -> None:  # a request in flight while the bad one is handled
        with served_app.client() as c:
            result["r"] = c.post("/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 16,
                                                          "temperature": 0})

    t = threading.Thread(target=bystander)
    t.start()
    with served_app.client() as c:
        r = c.post(path, content=body) if isinstance(body, bytes) else c.post(path, json=body)
    t.join(120)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:  # the field at fault, or for an unparsable body the error code
        assert (error["param"] or error["code"] or "").startswith(param), error
    assert result["r"].status_code == 200
    tokenizer = load(served_app.target).tokenizer
    expected = tokenizer.decode(reference_greedy(served_app.target, prompt, 16), skip_special_tokens=True)
    assert result["r"].json()["choices"][0]["text"] == expected


def test_a_chunked_body_over_the_size_limit_gets_413(served_app: ServedApp) -> None:
    def chunks():  # no Content-Length: the limit is enforced as the body arrives
        yield b'{"model": "' + MODEL.encode() + b'", "prompt": "'
        for _ in range(80):
            yield b"x" * 16384
        yield b'"}'

    with served_app.client() as c:
        r = c.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large", r.text
        ok = c.post("/v1/completions", json={"model": MODEL, "prompt": "x" * 1000, "max_tokens": 2})
        assert ok.status_code in (200, 400), ok.text  # under the limit: judged on its content, not its size


@pytest.mark.parametrize("key", [None, "wrong-key", ADMIN_KEY])
def test_v1_needs_an_api_key_and_admin_needs_the_admin_key(served_app: ServedApp, key) -> None:
    with served_app.client(key) as c:
        for r in (c.get("/v1/models"), c.post("/v1/completions", json={"model": MODEL, "prompt": "x"})):
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
            assert "sk-test" not in r.text
    with served_app.client(API_KEY) as c:
        assert c.get("/admin/instances").status_code == 401
    with served_app.client(ADMIN_KEY) as c:
        assert len(c.get("/admin/instances").json()["instances"]) == 2


@pytest.mark.parametrize("chunks", [1, 3, 6])
def test_a_client_that_disconnects_aborts_its_request_and_frees_its_kv(served_app: ServedApp, chunks: int) -> None:
    body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 240, "temperature": 0,
            "ignore_eos": True, "stream": True}
    with served_app.client() as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            rid = json.loads(next(lines)[len("data: "):])["id"]
            for _ in range(chunks - 1):
                next(lines)
        # the stream is closed after `chunks` chunks, long before its 240 tokens; unless the API aborts it, the
        # router never hears of its end (nobody reads its last item), so "aborted" is the API's doing
    deadline = time.monotonic() + 60
    with served_app.client(ADMIN_KEY) as c:
        while True:
            rows = {row["request_id"]: row for row in c.get("/admin/requests").json()["requests"]}
            instances = c.get("/admin/instances").json()["instances"]
            if rows[rid]["status"] == "aborted" and sum(i["in_flight"] for i in instances) == 0:
                break
            assert time.monotonic() < deadline, (rows[rid], [r for r in rows.values() if r["status"] == "running"],
                                                 instances)
            time.sleep(0.2)
    wait_kv_free(served_app)


def test_above_the_pending_limit_requests_get_429_with_retry_after(served_app: ServedApp) -> None:
    body = {"model": MODEL, "prompt": "count with me", "max_tokens": 240, "temperature": 0, "ignore_eos": True}

    async def burst() -> list[httpx.Response]:  # all at once from one event loop: threads started too slowly
        headers = {"Authorization": f"Bearer {API_KEY}"}  # under load to overlap, and no 429 came (seen twice)
        async with httpx.AsyncClient(base_url=served_app.url, headers=headers, timeout=300,
                                     limits=httpx.Limits(max_connections=None)) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(MAX_PENDING * 3)))

    statuses = asyncio.run(burst())
    codes = sorted(r.status_code for r in statuses)
    assert codes.count(200) >= MAX_PENDING // 2 and 429 in codes and set(codes) <= {200, 429}, codes
    busy = next(r for r in statuses if r.status_code == 429)
    assert busy.headers["retry-after"] == "1" and busy.json()["error"]["type"] == "rate_limit_error"
    assert all(r.json()["usage"]["completion_tokens"] == 240 for r in statuses if r.status_code == 200)
    wait_kv_free(served_app)


def _samples(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(f",{k}={v}" for k, v in sorted(s.labels.items()) if k != "model_name")
            out[key] = s.value
    return out


def test_health_and_metrics_parse_and_their_counters_move(served_app: ServedApp) -> None:
    assert httpx.get(f"{served_app.url}/health").json() == {"status": "ok", "healthy_instances": 2}
    before = _samples(httpx.get(f"{served_app.url}/metrics").text)
    with served_app.client() as c:
        for _ in range(2):  # the API replica that serves /metrics sees these requests (one replica)
            assert c.post("/v1/completions", json={"model": MODEL, "prompt": "metrics please", "max_tokens": 10,
                                                   "temperature": 0, "ignore_eos": True}).status_code == 200
    after = _samples(httpx.get(f"{served_app.url}/metrics").text)
    moved = lambda name: after.get(name, 0) - before.get(name, 0)  # noqa: E731
    assert moved("specfleet:generation_tokens_total") == 20
    assert moved("specfleet:request_success_total,finished_reason=length") == 2
    assert moved("specfleet:e2e_request_latency_seconds_count") == 2
    assert moved("specfleet:time_to_first_token_seconds_count") == 2
    assert moved("specfleet:spec_decode_num_draft_tokens_total") >= moved("specfleet:spec_decode_num_accepted_tokens_total") > 0
    assert moved("specfleet:spec_decode_num_accepted_tokens_per_pos_total,position=0") > 0
    gauges = [k for k in after if k.split(",")[0] == "specfleet:num_requests_running"]
    assert len(gauges) == 2  # one per instance
    # the instances' figures reach /metrics through the router's poll and the replica's fleet view, reused for
    # about a second (deploy/serve/cached.py): read until they show these requests' drafting
    deadline = time.monotonic() + 30
    while True:
        draft_s = [v for k, v in _samples(httpx.get(f"{served_app.url}/metrics").text).items()
                   if k.startswith("specfleet:spec_decode_draft_seconds_per_token,")]
        assert len(draft_s) == 2  # the draft's time per drafted token, per instance
        if max(draft_s) > 0:
            break
        assert time.monotonic() < deadline, draft_s
        time.sleep(0.3)
    # the router's own counts beside the instances' (they agree once the requests have been released)
    assert len([k for k in after if k.startswith("specfleet:router_requests_in_flight,instance=")]) == 2
    assert "specfleet:router_requests_pending" in after
    deadline = time.monotonic() + 30
    while (now := _samples(httpx.get(f"{served_app.url}/metrics").text))["specfleet:router_requests_pending"]:
        assert time.monotonic() < deadline, now
        time.sleep(0.2)


def _prefix_tokens(app: ServedApp, at_least: float) -> tuple[float, float]:
    """The fleet's prefix cache (queries, hits) in tokens from `/admin/instances` (not on the unauthenticated
    /metrics: docs/security.md), once the instances' stats count at least `at_least` queries (they reach the router
    with its next poll)."""
    deadline = time.monotonic() + 30
    with app.client(ADMIN_KEY) as c:
        while True:
            stats = [r["stats"] for r in c.get("/admin/instances").json()["instances"] if r["stats"]]
            queries = sum(s["prefix_cache_queries"] for s in stats)
            if queries >= at_least:
                return queries, sum(s["prefix_cache_hits"] for s in stats)
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)


def _idle(app: ServedApp) -> None:
    """Wait until the router's latest stats show every instance idle (no request, no KV held: cached blocks count as
    free), so that least load sends the next request to the first instance by id."""
    deadline = time.monotonic() + 30
    with app.client(ADMIN_KEY) as c:
        while True:
            rows = c.get("/admin/instances").json()["instances"]
            if all(r["in_flight"] == 0 and r["stats"] and r["stats"]["running"] == r["stats"]["waiting"] == 0
                   and r["stats"]["kv_blocks_used"] == 0 for r in rows):
                return
            assert time.monotonic() < deadline, rows
            time.sleep(0.2)


def test_cache_salt_keeps_its_own_prefix_cache_and_changes_no_output(served_app: ServedApp) -> None:
    """A prompt served again finds its blocks cached, unless it comes with another cache_salt (vLLM's field; also in
    the OpenAPI schema) or from another API key (tenant); every output is the target's greedy one; a bad salt is a
    400 naming it. The router's decisions by reason are on /metrics and in `specfleet status`."""
    prompt = text_prompts(load(served_app.target), 1, offset=5)[0]  # 35 tokens: 8 full blocks of 4
    expected = load(served_app.target).tokenizer.decode(reference_greedy(served_app.target, prompt, 8),
                                                        skip_special_tokens=True)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    queries, hit = _prefix_tokens(served_app, 0)
    hits = [hit]
    with served_app.client() as c, served_app.client(LIMITED_KEYS["vip"][0]) as other_tenant:
        for client, salt in ((c, None), (c, "tenant-a"), (c, "tenant-a"), (c, None), (other_tenant, None)):
            _idle(served_app)  # least load sends each to the same idle instance
            r = client.post("/v1/completions", json={**body, **({"cache_salt": salt} if salt else {})})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text
            queries, hit = _prefix_tokens(served_app, queries + len(prompt))
            hits.append(hit)
        r = c.post("/v1/completions", json={**body, "cache_salt": ""})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt", r.text
        schema = c.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]["properties"]
        assert "cache_salt" in schema
    # 32 tokens (8 blocks) of the prompt could come from the cache: the first salted request found none cached
    steps = [b - a for a, b in zip(hits, hits[1:])]
    # the first request finds whatever earlier tests of this session's app left: any whole blocks of its prefix
    assert steps[1:] == [0, 32, 32, 0] and steps[0] in range(0, 33, 4), hits  # the other key's found none of them
    report = json.loads(specfleet("status", "--json", "--config", str(served_app.config_path)).stdout)
    assert report["dispatch"]["policy"] == "least_load" and report["dispatch"]["decisions"]["load"] >= 4
    text = httpx.get(f"{served_app.url}/metrics").text
    assert 'specfleet:router_dispatch_decisions_total{policy="least_load",reason="load"}' in text


def test_routing_statistics_come_only_from_an_expert_parallel_instance(served_app: ServedApp) -> None:
    with served_app.client(ADMIN_KEY) as c:
        instance = c.get("/admin/instances").json()["instances"][0]["instance_id"]
        r = c.get(f"/admin/instances/{instance}/routing")
        assert r.status_code == 409 and r.json()["error"]["code"] == "not_expert_parallel", r.text
        r = c.get("/admin/instances/no-such-instance/routing")
        assert r.status_code == 404 and r.json()["error"]["code"] == "instance_not_found"
    with served_app.client(API_KEY) as c:
        assert c.get(f"/admin/instances/{instance}/routing").status_code == 401
