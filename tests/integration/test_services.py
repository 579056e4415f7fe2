"""The distributed system for real: worker and coordinator processes on localhost, real gRPC.

Most tests here send requests to the session's shared SmolLM2 cluster (tests/integration/conftest.py:
two target and two draft replicas; the draft is the target's own model, so every draft token is
accepted, which makes the pipelined path carry most of the traffic). Outputs are compared with
in-process target-only decoding of the same model: greedy output must be identical token for token.
A test that reconfigures (the other dtype) starts a SmolLM2 cluster of its own; tests that stop, hang or signal
processes start one on the tiny model, since what they prove is about processes, not text.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem.client import TandemClient, build_request
from tandem.cluster import ClusterSpec, LocalCluster
from tandem.sampling import SamplingParams
from tandem.v1 import draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.integration.conftest import MAX_NEW_TOKENS, OTHER_DTYPE, PROMPTS
from tests.references import target_only

pytestmark = pytest.mark.slow


@pytest.fixture
def cluster(shared_cluster):
    return shared_cluster


@pytest.fixture
def client(shared_client):
    return shared_client


@pytest.fixture
def reference(smollm2_reference):
    return smollm2_reference


def generate(client, prompt, **kw):
    return client.generate(build_request(prompt, chat=True, max_new_tokens=MAX_NEW_TOKENS, **kw))


def stream_tokens(client, prompt, **kw) -> list[int]:
    tokens = []
    for chunk in client.stream(build_request(prompt, chat=True, max_new_tokens=MAX_NEW_TOKENS, **kw)):
        tokens.extend(chunk.token_ids)
    return tokens


def metric_samples(service, name: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=5).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^({name}\S*) (\S+)$", text, re.M)}


def summed_metric(services, name: str) -> dict[str, float]:
    """``name``'s samples added up over ``services`` (the replicas of one fleet)."""
    total: dict[str, float] = {}
    for service in services:
        for key, value in metric_samples(service, name).items():
            total[key] = total.get(key, 0.0) + value
    return total


# ----- correctness --------------------------------------------------------------

@pytest.mark.parametrize("method", ["draft", "hybrid", "ngram", "none", "auto"])
def test_greedy_through_services_equals_target_only(client, reference, method):
    # The draft is the target's own model, so its chain is always accepted whole. That is asserted on
    # chains: a tree round (auto builds one where verification is cheap, e.g. packed bf16 on a CPU that
    # multiplies bf16) also counts its branch nodes as drafted, and those lose whenever the chain wins.
    tree = "off" if method == "draft" else ""
    for prompt in PROMPTS:
        reply = generate(client, prompt, method=method, fixed_k=True, tree=tree)
        assert list(reply.token_ids) == reference[prompt], prompt
        assert reply.stats.method == ("hybrid" if method == "auto" else method)  # auto: hybrid, with drafts
        if method in ("draft", "hybrid", "auto"):
            assert reply.stats.drafted > 0
        if method == "draft":
            assert reply.stats.tree_rounds == 0 and reply.stats.accepted == reply.stats.drafted


@pytest.mark.parametrize("method", ["hybrid", "ngram"])
def test_greedy_token_trees_through_services_equal_target_only(client, reference, method):
    """Trees on the wire: parents to the target, the draft's next-best tokens back from the draft."""
    tree_rounds = 0
    for prompt in PROMPTS:
        reply = generate(client, prompt, method=method, fixed_k=True, tree="on")
        assert list(reply.token_ids) == reference[prompt], prompt
        tree_rounds += reply.stats.tree_rounds
    assert tree_rounds > 0


def test_greedy_through_services_in_the_other_dtype_equals_target_only(smollm2_dir, tmp_path):
    """The shared system runs ``SHARED_DTYPE``; a system of its own runs the other (fp32 where the CPU multiplies
    bf16 natively, bf16 where it emulates it), so that both dtypes' kernels are checked through real workers."""
    reference = target_only(smollm2_dir, PROMPTS[:1], dtype=OTHER_DTYPE, max_new_tokens=MAX_NEW_TOKENS)
    spec = ClusterSpec(target=str(smollm2_dir), draft=str(smollm2_dir), dtype=OTHER_DTYPE, kv_cache_tokens=4096,
                       log_dir=tmp_path, metrics=False, pipelining=True,
                       draft_args=("--quantization", "none", "--vocab", "0"))
    with LocalCluster(spec) as cluster, TandemClient(cluster.coordinator.address, timeout_s=120) as client:
        for method, tree in (("none", "off"), ("hybrid", "on")):
            # plain steps, and a tree over the wire from the draft worker's chain and an n-gram's branches, on one
            # prompt: this dtype is the slow one on this CPU, fp32 costing about 3x packed bf16 and emulated bf16
            # about 2.5x fp32 when verifying (on a CPU that emulates it the test took 116 s with a draft-only run
            # beside these). Draft, n-gram and hybrid run in both dtypes in process (tests/spec), and all through
            # the shared system.
            reply = generate(client, PROMPTS[0], method=method, fixed_k=True, tree=tree)
            assert list(reply.token_ids) == reference[PROMPTS[0]], (method, tree)
            if method != "none":  # the draft worker's chains, in this dtype, under the trees' branches
                assert reply.stats.drafted > 0 and reply.stats.draft_worker and reply.stats.tree_rounds > 0


def test_pipelined_and_unpipelined_runs_agree(client, reference):
    for prompt in PROMPTS[:2]:
        piped = generate(client, prompt, method="draft", fixed_k=True, pipelining=True)
        plain = generate(client, prompt, method="draft", fixed_k=True, pipelining=False)
        assert list(piped.token_ids) == list(plain.token_ids) == reference[prompt]


def test_stream_equals_unary_and_text_reassembles(client, reference):
    chunks = list(client.stream(build_request(PROMPTS[0], chat=True, max_new_tokens=40, method="draft")))
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == reference[PROMPTS[0]]
    assert len(chunks) > 1 and chunks[-1].finish_reason and chunks[-1].stats.generated_tokens == len(tokens)
    assert "".join(c.text for c in chunks) == generate(client, PROMPTS[0], method="draft").text


def test_sixteen_concurrent_streams_match_their_single_runs_and_batch(client, cluster, reference):
    targets = cluster.workers("target")
    before = summed_metric(targets, "tandem_target_batch_size")
    jobs = [PROMPTS[i % len(PROMPTS)] for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda p: stream_tokens(client, p, method="draft"), jobs))
    for prompt, tokens in zip(jobs, results):
        assert tokens == reference[prompt]
    after = summed_metric(targets, "tandem_target_batch_size")
    batches = after["tandem_target_batch_size_count"] - before.get("tandem_target_batch_size_count", 0)
    calls = after["tandem_target_batch_size_sum"] - before.get("tandem_target_batch_size_sum", 0)
    # 16 streams of about 40 tokens over two targets: one forward per call would be ~16 x 10 batches of 1.
    # Batching means fewer forwards than calls, by a wide margin: on average well over two calls per forward.
    assert batches > 0 and calls / batches > 2, (calls, batches)


def test_seeded_sampling_is_reproducible_through_services(client):
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    first = generate(client, PROMPTS[1], sampling=sampling, method="draft", fixed_k=True)
    second = generate(client, PROMPTS[1], sampling=sampling, method="draft", fixed_k=True)
    assert list(first.token_ids) == list(second.token_ids)
    assert first.stats.drafted > 0


def test_seeded_speculative_output_is_the_plain_seeded_output_through_services(client):
    """The target keeps its own seeded draw at every position (tandem.spec.rejection, "Seeded sampling")."""
    sampling = SamplingParams(temperature=0.8, top_p=0.95, seed=11)
    plain = list(generate(client, PROMPTS[1], sampling=sampling, method="none").token_ids)
    drafted = generate(client, PROMPTS[1], sampling=sampling, method="draft", fixed_k=True)
    assert list(drafted.token_ids) == plain and drafted.stats.drafted > 0
    assert list(generate(client, PROMPTS[1], sampling=sampling, method="hybrid").token_ids) == plain


def test_stop_string_cuts_text_and_stop_token_ends(client, reference):
    full = generate(client, PROMPTS[1], method="draft")
    cut_at = full.text[5:15]
    reply = generate(client, PROMPTS[1], method="draft", stop_strings=(cut_at,))
    assert reply.finish_reason == "stop" and cut_at not in reply.text
    assert full.text.startswith(reply.text)
    stop_token = reference[PROMPTS[1]][6]
    reply = generate(client, PROMPTS[1], method="draft", stop_token_ids=(stop_token,))
    assert list(reply.token_ids)[-1] == stop_token and reply.finish_reason == "stop"
    assert list(reply.token_ids) == reference[PROMPTS[1]][: reference[PROMPTS[1]].index(stop_token) + 1]


def vllm_totals(service) -> dict[str, float]:
    """The coordinator's vllm: samples by name, each summed over its labels (model_name, finished_reason...)."""
    totals: dict[str, float] = {}
    for key, value in metric_samples(service, "vllm:").items():
        name = key.partition("{")[0]
        totals[name] = totals.get(name, 0.0) + value
    return totals


def test_the_coordinator_s_vllm_metrics_count_what_its_replies_say(client, cluster):
    """What a gateway or a vLLM dashboard scrapes from a real coordinator agrees with the replies' own statistics:
    tokens read and written, requests finished, proposed and accepted tokens; nothing is left queued or running."""
    before = vllm_totals(cluster.coordinator)
    replies = [generate(client, prompt, method="draft", fixed_k=True, tree="off") for prompt in PROMPTS[:2]]
    after = vllm_totals(cluster.coordinator)

    def added(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)
    assert added("vllm:request_success_total") == 2
    assert added("vllm:prompt_tokens_total") == sum(r.stats.prompt_tokens for r in replies)
    assert added("vllm:generation_tokens_total") == sum(r.stats.generated_tokens for r in replies)
    assert added("vllm:spec_decode_num_draft_tokens_total") == sum(r.stats.drafted for r in replies) > 0
    assert added("vllm:spec_decode_num_accepted_tokens_total") == sum(r.stats.accepted for r in replies)
    assert added("vllm:time_to_first_token_seconds_count") == 2
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert 0 <= after["vllm:kv_cache_usage_perc"] <= 1


def test_cancelled_stream_returns_its_kv_blocks(client):
    stream = client.stream(build_request(PROMPTS[0], chat=True, max_new_tokens=400, method="draft", ignore_eos=True))
    next(stream)
    next(stream)
    stream.cancel()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        info = client.info()
        workers = [*info.target_workers, *info.draft_workers]
        if all(w.info.free_blocks == w.info.total_blocks for w in workers):
            break
        time.sleep(0.3)
    assert all(w.info.free_blocks == w.info.total_blocks and w.info.active_sequences == 0 for w in workers)


# ----- bad input -------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,field", [
    (dict(prompt=""), "text"),
    (dict(prompt=[]), "token_ids.ids"),
    (dict(prompt=[1, -5]), "token_ids.ids"),
    (dict(prompt=[1, 10_000_000]), "token_ids.ids"),
    (dict(prompt="x " * 9000), "prompt"),
    (dict(prompt="hi", max_new_tokens=-3), "stopping.max_new_tokens"),
    (dict(prompt="hi", max_new_tokens=100_000), "stopping.max_new_tokens"),
    (dict(prompt="hi", sampling=None, method="medusa"), "speculation.method"),
    (dict(prompt="hi", k=-1), "speculation.k"),
    (dict(prompt="hi", k=99), "speculation.k"),
    (dict(prompt="hi", heads_nodes=-1), "speculation.heads_nodes"),
    (dict(prompt="hi", heads_nodes=99), "speculation.heads_nodes"),
    (dict(prompt="hi", tree="always"), "speculation.tree"),
])
def test_bad_input_is_invalid_argument_naming_the_field(client, kwargs, field):
    prompt = kwargs.pop("prompt")
    with pytest.raises(grpc.RpcError) as info:
        client.generate(build_request(prompt, **kwargs))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(field), info.value.details()


@pytest.mark.parametrize("field,message", [
    ("temperature", "sampling: temperature must be >= 0"),
    ("top_p_low", "sampling: top_p must be in (0, 1]"),
    ("top_p_high", "sampling: top_p must be in (0, 1]"),
    ("top_k", "sampling: top_k must be >= 0"),
])
def test_bad_sampling_is_invalid_argument(client, field, message):
    request = build_request("hi")
    setattr(request.sampling, {"top_p_low": "top_p", "top_p_high": "top_p"}.get(field, field),
            {"temperature": -1.0, "top_p_low": -0.5, "top_p_high": 1.5, "top_k": -2}[field])
    with pytest.raises(grpc.RpcError) as info:
        client.generate(request)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith(message), info.value.details()


def test_unknown_sequence_is_not_found_on_both_workers(cluster):
    with grpc.insecure_channel(cluster.workers("target")[0].address) as channel:
        stub = target_pb2_grpc.TargetWorkerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Verify(target_pb2.VerifyRequest(seq_id="nope", committed_len=3, draft_tokens=[1]), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND
    with grpc.insecure_channel(cluster.workers("draft")[0].address) as channel:
        stub = draft_pb2_grpc.DraftWorkerStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Propose(draft_pb2.ProposeRequest(seq_id="nope", committed_len=3, new_tokens=[1], k=2), timeout=10)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_health_and_reflection(cluster):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(cluster.coordinator.address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="tandem.v1.Generation"), timeout=5)
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        replies = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5)
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert {"tandem.v1.Generation", "grpc.health.v1.Health"} <= names


# ----- replicas and failures -------------------------------------------------------------

def test_two_draft_and_two_target_replicas_share_the_load(client, cluster):
    assert len(cluster.workers("target")) == len(cluster.workers("draft")) == 2
    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda p: generate(client, p, method="draft"), PROMPTS * 2))
    assert len({r.stats.target_worker for r in replies}) == 2
    assert len({r.stats.draft_worker for r in replies}) == 2


# ----- processes stopped, hung, signalled: on the tiny model --------------------------------

def test_unresponsive_worker_gives_deadline_exceeded_not_a_hang(tiny_served_dir, tmp_path):
    spec = ClusterSpec(target=str(tiny_served_dir), draft=None, dtype="float32", kv_cache_tokens=2048,
                       log_dir=tmp_path, metrics=False, coordinator_args=("--call-timeout", "3", "--move-wait", "5"))
    with LocalCluster(spec) as cluster, TandemClient(cluster.coordinator.address, timeout_s=60) as client:
        assert len(generate(client, PROMPTS[0], method="none").token_ids) > 0  # serving before the hang
        target = cluster.workers("target")[0].process
        target.send_signal(signal.SIGSTOP)  # alive but not answering
        try:
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                generate(client, PROMPTS[0], method="none")
            assert info.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
            # the call times out (3 s), the request waits for another healthy target (--move-wait 5 s,
            # each look a 2 s Info call), finds none, and fails: bounded, not a hang
            assert time.monotonic() - start < 25
        finally:
            target.send_signal(signal.SIGCONT)
        target.kill()  # gone for good
        target.wait()
        with pytest.raises(grpc.RpcError) as info:
            generate(client, PROMPTS[0], method="none")
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_sigterm_drains_and_exits_cleanly(tiny_served_dir, tmp_path):
    # The grace outlasts the request on a loaded machine: what is tested is that the drain waits for it.
    spec = ClusterSpec(target=str(tiny_served_dir), draft=None, dtype="float32", kv_cache_tokens=2048,
                       log_dir=tmp_path, metrics=False, coordinator_args=("--drain-grace", "60"))
    cluster = LocalCluster(spec)
    address = cluster.start()
    new_tokens = 200  # long enough to be in flight when the signal lands, even on the tiny model
    with TandemClient(address, timeout_s=60) as client:
        stream = client.stream(build_request(PROMPTS[0], chat=True, max_new_tokens=new_tokens, method="none",
                                             ignore_eos=True))
        chunks = [next(stream)]  # the request is in flight now: the drain must let it finish
        cluster.coordinator.process.send_signal(signal.SIGTERM)
        chunks.extend(stream)
    # The coordinator exits by itself once its request is done (well inside the grace); only then are the
    # workers stopped, so that a second signal never lands on a coordinator still shutting down.
    cluster.coordinator.process.wait(timeout=45)  # a bound on a hang, far inside the 60 s grace
    cluster.stop()
    assert chunks[-1].finish_reason == "length" and sum(len(c.token_ids) for c in chunks) == new_tokens
    assert all(s.process.returncode == 0 for s in cluster.services), [
        (s.role, s.process.returncode) for s in cluster.services
    ]


def test_tandem_up_serves_generate_addr_and_stops_on_ctrl_c(tiny_served_dir, tmp_path):
    """The README's path: `tandem up`, then `tandem generate --addr`, then Ctrl-C stops every process."""
    import json

    prompt = "def add(a, b):"
    expected = target_only(tiny_served_dir, [prompt], dtype="float32", max_new_tokens=12, chat=False)[prompt]
    up = subprocess.Popen([sys.executable, "-m", "tandem", "up", "--target", str(tiny_served_dir), "--draft",
                           str(tiny_served_dir), "--dtype", "float32", "--port", "0", "--log-dir", str(tmp_path)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in up.stdout:
            lines.append(line)
            if line.startswith("ready:"):
                break
        address = lines[-1].split("--addr")[1].strip()
        pids = [int(ln.split("pid")[1]) for ln in lines if " pid " in ln]
        assert len(pids) == 3
        proc = subprocess.run([sys.executable, "-m", "tandem", "generate", prompt, "--addr", address,
                               "--max-new-tokens", "12", "--json"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        assert out["token_ids"] == expected
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0
        for pid in pids:  # every child is gone
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if up.poll() is None:
            up.kill()
