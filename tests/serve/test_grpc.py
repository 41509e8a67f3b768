"""The gRPC service through Ray Serve's gRPC proxy, with a plain grpcio client: unary, streaming, auth, errors."""

from __future__ import annotations

import grpc
import pytest

from deploy.rpc import codegen

codegen.ensure()

from deploy.rpc import specfleet_pb2 as pb  # noqa: E402
from deploy.rpc import specfleet_pb2_grpc as pb_grpc  # noqa: E402
from tests.serve.conftest import ADMIN_KEY, API_KEY, CONTEXT, MODEL, ServedApp  # noqa: E402
from tests.serve.test_openai_surface import log_softmax as reference_logprobs  # noqa: E402
from tests.unit.helpers import load, reference_greedy, text_prompts  # noqa: E402

AUTH = (("authorization", f"Bearer {API_KEY}"),)


@pytest.fixture(scope="module")
def stub(served_app: ServedApp):
    with grpc.insecure_channel(served_app.grpc_target) as channel:
        yield pb_grpc.SpecfleetStub(channel)


def test_generate_and_stream_give_the_targets_greedy_output(stub, served_app: ServedApp) -> None:
    prompt = text_prompts(load(served_app.target), 1, offset=9)[0]
    expected = reference_greedy(served_app.target, prompt, 20)
    request = pb.GenerateRequest(model=MODEL, prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=20, temperature=0)

    reply = stub.Generate(request, metadata=AUTH, timeout=120)
    assert list(reply.token_ids) == expected
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == len(expected)
    assert reply.finish_reason in ("stop", "length") and reply.spec_decode.proposed_tokens > 0

    chunks = list(stub.GenerateStream(request, metadata=AUTH, timeout=120))
    assert len(chunks) >= 2 and [t for c in chunks for t in c.token_ids] == expected
    assert "".join(c.text for c in chunks) == reply.text
    assert chunks[-1].finish_reason == reply.finish_reason and all(not c.finish_reason for c in chunks[:-1])
    assert chunks[-1].usage.completion_tokens == len(expected)
    salted = pb.GenerateRequest(model=MODEL, prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=20, temperature=0,
                                cache_salt="tenant-a")  # its own prefix cache: the same output
    assert list(stub.Generate(salted, metadata=AUTH, timeout=120).token_ids) == expected


def test_list_models_and_health(stub) -> None:
    models = stub.ListModels(pb.ListModelsRequest(), metadata=AUTH, timeout=30)
    assert [(m.id, m.max_model_len) for m in models.models] == [(MODEL, CONTEXT)]
    health = stub.Health(pb.HealthRequest(), timeout=30)
    assert health.healthy and health.healthy_instances == 2
    fleet = stub.FleetStats(pb.FleetStatsRequest(), metadata=(("authorization", f"Bearer {ADMIN_KEY}"),), timeout=30)
    assert fleet.healthy_instances == 2 and set(fleet.migrations) == {"finished", "aborted_src", "aborted_dst"}
    for metadata in ((), AUTH):  # no key, and a tenant's key: the fleet's figures are the operator's
        with pytest.raises(grpc.RpcError) as err:
            stub.FleetStats(pb.FleetStatsRequest(), metadata=metadata, timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


@pytest.mark.parametrize(("metadata", "request_", "code"), [
    pytest.param((), pb.GenerateRequest(model=MODEL, prompt="hi"), grpc.StatusCode.UNAUTHENTICATED, id="no key"),
    pytest.param((("authorization", "Bearer nope"),), pb.GenerateRequest(model=MODEL, prompt="hi"),
                 grpc.StatusCode.UNAUTHENTICATED, id="wrong key"),
    pytest.param(AUTH, pb.GenerateRequest(model="nope", prompt="hi"), grpc.StatusCode.NOT_FOUND, id="unknown model"),
    pytest.param(AUTH, pb.GenerateRequest(model=MODEL), grpc.StatusCode.INVALID_ARGUMENT, id="no input"),
    pytest.param(AUTH, pb.GenerateRequest(model=MODEL, prompt="hi", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT,
                 id="max_tokens 0"),
    pytest.param(AUTH, pb.GenerateRequest(model=MODEL, prompt="hi", max_tokens=5000),
                 grpc.StatusCode.INVALID_ARGUMENT, id="beyond the context"),
    pytest.param(AUTH, pb.GenerateRequest(model=MODEL, chat=pb.ChatMessages()), grpc.StatusCode.INVALID_ARGUMENT,
                 id="empty chat"),
    pytest.param(AUTH, pb.GenerateRequest(model=MODEL, prompt="hi", temperature=-1), grpc.StatusCode.INVALID_ARGUMENT,
                 id="negative temperature"),
    pytest.param(AUTH, pb.GenerateRequest(model=MODEL, prompt="hi", temperature=2.5), grpc.StatusCode.INVALID_ARGUMENT,
                 id="temperature above 2"),
    pytest.param(AUTH, pb.GenerateRequest(model=MODEL, prompt="hi", seed=-1), grpc.StatusCode.INVALID_ARGUMENT,
                 id="negative seed"),
    pytest.param(AUTH, pb.GenerateRequest(model=MODEL, prompt="hi", top_k=-2), grpc.StatusCode.INVALID_ARGUMENT,
                 id="top_k below -1"),
    pytest.param(AUTH, pb.GenerateRequest(model=MODEL, prompt="hi", stop=["ok", ""]), grpc.StatusCode.INVALID_ARGUMENT,
                 id="empty stop"),
    pytest.param(AUTH, pb.GenerateRequest(model=MODEL, prompt_token_ids=pb.TokenIds(ids=[10**6])),
                 grpc.StatusCode.INVALID_ARGUMENT, id="token id out of range"),
    pytest.param(AUTH, pb.GenerateRequest(model=MODEL, prompt="hi", cache_salt=""), grpc.StatusCode.INVALID_ARGUMENT,
                 id="empty cache_salt"),
    pytest.param(AUTH, pb.GenerateRequest(model=MODEL, prompt="hi", structured=pb.StructuredOutput(
        json_schema='{"type": "object", "properties": {"a": ' * 2000 + "{}" + "}}" * 2000)),
        grpc.StatusCode.INVALID_ARGUMENT, id="schema nested 2000 deep"),
    pytest.param(AUTH, pb.GenerateRequest(model=MODEL, prompt="hi", stop_token_ids=list(range(65))),
                 grpc.StatusCode.INVALID_ARGUMENT, id="65 stop token ids"),
    pytest.param(AUTH, pb.GenerateRequest(model=MODEL, prompt="hi", structured=pb.StructuredOutput(
        choice=pb.Choices(choices=["x" * 1001]))), grpc.StatusCode.INVALID_ARGUMENT, id="a choice of 1001 chars"),
    pytest.param(AUTH, pb.GenerateRequest(model=MODEL, prompt="x" * (1 << 20)), grpc.StatusCode.RESOURCE_EXHAUSTED,
                 id="message over the size limit"),
])
def test_bad_calls_get_status_codes_on_both_methods(stub, metadata, request_, code) -> None:
    with pytest.raises(grpc.RpcError) as unary:
        stub.Generate(request_, metadata=metadata, timeout=30)
    assert unary.value.code() == code and unary.value.details()
    with pytest.raises(grpc.RpcError) as streaming:
        list(stub.GenerateStream(request_, metadata=metadata, timeout=30))
    assert streaming.value.code() == code
    assert API_KEY not in (unary.value.details() or "")
    # a correct request beside it still completes
    ok = stub.Generate(pb.GenerateRequest(model=MODEL, prompt="hi", max_tokens=4, temperature=0, ignore_eos=True),
                       metadata=AUTH, timeout=120)
    assert ok.finish_reason == "length" and len(ok.token_ids) == 4


def test_logprobs_and_prompt_scoring_travel_over_grpc(stub, served_app: ServedApp) -> None:
    prompt = text_prompts(load(served_app.target), 1, offset=17)[0]
    request = pb.GenerateRequest(model=MODEL, prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=6, temperature=0,
                                 logprobs=2, prompt_logprobs=1)
    reply = stub.Generate(request, metadata=AUTH, timeout=120)
    ref = reference_logprobs(served_app, prompt + list(reply.token_ids))
    assert [lp.token_id for lp in reply.logprobs] == list(reply.token_ids) == reference_greedy(served_app.target,
                                                                                              prompt, 6)
    for j, lp in enumerate(reply.logprobs):
        assert lp.logprob == pytest.approx(float(ref[len(prompt) + j - 1, lp.token_id]), abs=1e-4)
        assert len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token_id == lp.token_id
    assert [lp.token_id for lp in reply.prompt_logprobs] == prompt and not reply.prompt_logprobs[0].HasField("logprob")
    for j, lp in enumerate(reply.prompt_logprobs[1:], start=1):
        assert lp.logprob == pytest.approx(float(ref[j - 1, prompt[j]]), abs=1e-4)
    chunks = list(stub.GenerateStream(request, metadata=AUTH, timeout=120))
    assert [lp.logprob for c in chunks for lp in c.logprobs] == pytest.approx([lp.logprob for lp in reply.logprobs])
    scored = stub.Generate(pb.GenerateRequest(model=MODEL, prompt_token_ids=pb.TokenIds(ids=prompt), max_tokens=0,
                                              prompt_logprobs=0), metadata=AUTH, timeout=120)
    assert not scored.token_ids and [lp.logprob for lp in scored.prompt_logprobs[1:]] == pytest.approx(
        [lp.logprob for lp in reply.prompt_logprobs[1:]], abs=1e-5)
    with pytest.raises(grpc.RpcError) as e:
        stub.Generate(pb.GenerateRequest(model=MODEL, prompt="x", max_tokens=4,
                                         structured=pb.StructuredOutput(regex="(unclosed")), metadata=AUTH, timeout=60)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "structured" in e.value.details()
