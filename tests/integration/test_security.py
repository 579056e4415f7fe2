"""The system with every link secured, for real: mutual TLS client->coordinator and coordinator->workers, a token.

One LocalCluster (the tiny served model of tests/tiny_models.py as target and
draft: the property is about the links, not the text) whose every server
requires a client certificate from the test's CA, whose coordinator requires a
bearer token and enforces the operator's limits. Greedy output through it must
equal target-only decoding of the same model in process (tests/references.py;
the plaintext services equal it too: tests/integration/test_services.py), and
every limit is refused with its status.
"""

from __future__ import annotations

import json
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.cli import main
from tandem.client import TandemClient, build_request
from tandem.cluster import ClusterSpec, LocalCluster
from tandem.rpc.tls import ClientTLS, ServerTLS, open_channel
from tandem.v1 import target_pb2, target_pb2_grpc
from tests.references import target_only
from tests.tls_certs import make_pki

pytestmark = pytest.mark.slow

TOKENS = ("client-one-0123456789abcdef", "client-two-0123456789abcdef")
PROMPTS = ["Explain what a hash map is, with an example.", "Write a short poem about the sea."]
MAX_PROMPT_TOKENS = 100  # the chat-templated PROMPTS are under 50 tokens (one per character)
# Long enough that a stream of this many tokens outlasts the calls made while it holds its client's one slot
# (the tiny model answers in milliseconds); prompt and stream fit the model's 2048 positions.
MAX_NEW_TOKENS_LIMIT = 1500
MAX_REQUEST_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="module")
def client_tls(pki) -> ClientTLS:
    return ClientTLS(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)


@pytest.fixture(scope="module")
def cluster(tiny_served_dir, pki, client_tls, tmp_path_factory):
    tokens = tmp_path_factory.mktemp("secrets") / "tokens"
    tokens.write_text("".join(f"{t}\n" for t in TOKENS))
    spec = ClusterSpec(
        target=str(tiny_served_dir), draft=str(tiny_served_dir), dtype="bfloat16", kv_cache_tokens=2048,
        log_dir=tmp_path_factory.mktemp("logs"), metrics=False, expose_worker_addresses=False,
        server_tls=ServerTLS(pki.server_cert, pki.server_key, client_ca=pki.ca), client_tls=client_tls,
        worker_args=("--host", "127.0.0.1"),
        coordinator_args=("--host", "127.0.0.1", "--auth-token-file", str(tokens),
                          "--max-prompt-tokens", str(MAX_PROMPT_TOKENS),
                          "--max-new-tokens-limit", str(MAX_NEW_TOKENS_LIMIT), "--max-concurrent-per-client", "1",
                          "--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-new-tokens", "16"))
    with LocalCluster(spec) as running:
        yield running


@pytest.fixture(scope="module")
def client(cluster, client_tls):
    with TandemClient(cluster.coordinator.address, timeout_s=120, tls=client_tls, token=TOKENS[0]) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_served_dir):
    return target_only(tiny_served_dir, PROMPTS, dtype="bfloat16", max_new_tokens=40)


def refused(call, *args, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(*args, **kwargs)
    return info.value


@pytest.mark.parametrize("method", ["draft", "none"])
def test_greedy_over_mutual_tls_with_a_token_equals_target_only(client, reference, method):
    for prompt in PROMPTS:
        reply = client.generate(build_request(prompt, chat=True, max_new_tokens=40, method=method))
        assert list(reply.token_ids) == reference[prompt], prompt
        assert reply.stats.target_worker == "target-0"  # no internal address unless the operator exposes them
        assert reply.stats.draft_worker == ("draft-0" if method == "draft" else "")


def test_info_names_replicas_opaquely(client):
    info = client.info()
    assert [w.address for w in info.target_workers] == ["target-0"]
    assert [w.address for w in info.draft_workers] == ["draft-0"]
    assert all(w.healthy for w in [*info.target_workers, *info.draft_workers])


def test_tandem_generate_addr_with_tls_and_token_file(cluster, pki, reference, tmp_path, capsys):
    token_file = tmp_path / "token"
    token_file.write_text(TOKENS[1] + "\n")
    code = main(["generate", PROMPTS[0], "--chat", "--json", "--max-new-tokens", "40", "--method", "none",
                 "--addr", cluster.coordinator.address, "--tls-ca", str(pki.ca), "--tls-cert", str(pki.client_cert),
                 "--tls-key", str(pki.client_key), "--token-file", str(token_file)])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert json.loads(out.out.strip().splitlines()[-1])["token_ids"] == reference[PROMPTS[0]]


def test_strangers_are_kept_out_but_probes_get_health(cluster, pki, client_tls):
    address = cluster.coordinator.address
    request = build_request("hi", max_new_tokens=4)
    with TandemClient(address, timeout_s=30, tls=client_tls) as no_token:
        error = refused(no_token.generate, request)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in error.details()
    with TandemClient(address, timeout_s=30, tls=client_tls, token="not-a-known-token-at-all") as wrong_token:
        error = refused(wrong_token.generate, request)
        assert error.code() == grpc.StatusCode.UNAUTHENTICATED and "not-a-known" not in error.details()
    for stranger in (ClientTLS(ca=pki.ca), None,
                     ClientTLS(ca=pki.ca, cert=pki.other_client_cert, key=pki.other_client_key)):
        with TandemClient(address, timeout_s=10, tls=stranger, token=TOKENS[0]) as c:
            assert refused(c.generate, request).code() == grpc.StatusCode.UNAVAILABLE
    with open_channel(address, client_tls) as channel:  # a probe with a certificate needs no token
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    # The workers take only clients with the CA's certificates: nobody else reaches Prefill.
    worker = cluster.workers("target")[0].address
    with open_channel(worker, ClientTLS(ca=pki.ca)) as channel:
        error = refused(target_pb2_grpc.TargetWorkerStub(channel).Prefill,
                        target_pb2.PrefillRequest(seq_id="x", token_ids=[1, 2]), timeout=10)
        assert error.code() == grpc.StatusCode.UNAVAILABLE


def test_each_limit_is_refused_with_its_status(client, cluster, client_tls):
    error = refused(client.generate, build_request("word " * (MAX_PROMPT_TOKENS + 10)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("text: the prompt is ") and f"at most {MAX_PROMPT_TOKENS}" in error.details()
    # Ids in the tiny vocabulary, so that the length is what is refused.
    error = refused(client.generate, build_request([3 + i % 90 for i in range(MAX_PROMPT_TOKENS + 1)]))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("token_ids.ids:")
    assert f"at most {MAX_PROMPT_TOKENS}" in error.details()
    error = refused(client.generate, build_request("hi", max_new_tokens=MAX_NEW_TOKENS_LIMIT + 1))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("stopping.max_new_tokens:") and str(MAX_NEW_TOKENS_LIMIT) in error.details()
    error = refused(client.generate, build_request("hi", request_id="r" * 129))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and error.details().startswith("request_id: at most 128")
    error = refused(client.generate, build_request("hi", stop_strings=("x" * MAX_REQUEST_BYTES,)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    # One request at a time per token: a second one from the same token is refused while the first runs,
    # another token's goes through, and the slot is back once the first ends.
    stream = client.stream(build_request(PROMPTS[0], chat=True, max_new_tokens=MAX_NEW_TOKENS_LIMIT,
                                         ignore_eos=True, method="none"))
    next(stream)
    try:
        error = refused(client.generate, build_request("hi", max_new_tokens=2))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "at most 1" in error.details()
        with TandemClient(cluster.coordinator.address, timeout_s=60, tls=client_tls, token=TOKENS[1]) as other:
            assert len(other.generate(build_request("hi", max_new_tokens=2, ignore_eos=True)).token_ids) == 2
    finally:
        stream.cancel()
    for _ in range(100):  # the cancelled stream's slot is released as its handler unwinds
        try:
            assert len(client.generate(build_request("hi", max_new_tokens=2, ignore_eos=True)).token_ids) == 2
            break
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            time.sleep(0.1)
    else:
        raise AssertionError("the cancelled stream's slot never came back")
