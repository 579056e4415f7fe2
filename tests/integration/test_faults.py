"""Worker faults, survived: real worker processes killed, hung and filled up mid-request.

Every fault here happens to a replica that is serving a streaming request
(found by asking each worker's Info which one holds a sequence). The client
must see no error, no token lost or repeated, and the same tokens as without
the fault: greedy, the target-only output of the same model computed in
process; seeded sampled, an undisturbed run of the same request on the same
cluster.

The workers serve the tiny served model (tests/tiny_models.py): the faults are
about processes, not text, and it answers in milliseconds. So the streams are
long (hundreds of tokens, whatever the model would rather stop at): a stream
lasts seconds, and the fault, dealt after its first dozen tokens, surely lands
mid-stream (``target_moves`` / ``draft_moves`` say so).
"""

from __future__ import annotations

import os
import re
import signal
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tandem.client import TandemClient, build_request
from tandem.sampling_params import SamplingParams
from tandem.tokenizer import encode_prompt, load_tokenizer
from tandem.v1 import common_pb2, target_pb2, target_pb2_grpc
from tests.integration.faults import assert_kv_whole, local_cluster, serving, worker_info
from tests.references import target_only

pytestmark = pytest.mark.slow

PROMPT = "Write a long story about a lighthouse keeper and a storm."
TOKENS = 600
# The full-KV test: 64 blocks of 16 tokens; each request needs about 28 (a ~35-token prompt and 400 new
# tokens), so two fit at once and four cannot: some are preempted, wait and are rebuilt.
KV_CACHE_TOKENS = 1024
COUNT_PROMPTS = [f"Count from {i} to {i + 60}, one number per line." for i in range(4)]
COUNT_TOKENS = 400
# The burst test: prompts that reach one idle target together, each long enough that the last answered waits for
# many times its own price, against a call timeout longer than any step (a lone chunk is about a second's worth).
BURST_PROMPTS, BURST_TOKENS, BURST_CALL_TIMEOUT_S = 48, 2000, 2.0


def request(**kw):
    kw.setdefault("method", "draft")
    return build_request(PROMPT, chat=True, max_new_tokens=TOKENS, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def greedy(tiny_served_dir) -> list[int]:
    """What every greedy request here must stream: the target alone, in process."""
    return target_only(tiny_served_dir, [PROMPT], max_new_tokens=TOKENS, ignore_eos=True)[PROMPT]


def stream_with_fault(client: TandemClient, req, fault, after_tokens: int = 12):
    """Stream ``req``; once ``after_tokens`` arrived, call ``fault()``. Returns (tokens, final stats)."""
    tokens, stats, faulted = [], None, False
    for chunk in client.stream(req):
        tokens.extend(chunk.token_ids)
        if chunk.HasField("stats"):
            stats = chunk.stats
        if not faulted and len(tokens) >= after_tokens:
            fault()
            faulted = True
    assert faulted, "the request ended before the fault"
    return tokens, stats


@pytest.fixture
def two_targets(tiny_served_dir, tmp_path):
    with local_cluster(tiny_served_dir, tmp_path, targets=2, drafts=1) as cluster:
        with TandemClient(cluster.coordinator.address, timeout_s=300) as client:
            yield cluster, client


def kill(service) -> None:
    os.kill(service.process.pid, signal.SIGKILL)
    service.process.wait()


def warm_prefix_caches(cluster, model_dir, prompt: str) -> None:
    """Every target replica computes the prompt once (a Prefill and a Release), so each holds it in its cache."""
    ids = encode_prompt(load_tokenizer(model_dir), prompt, chat=True)
    for target in cluster.workers("target"):
        with grpc.insecure_channel(target.address) as channel:
            stub = target_pb2_grpc.TargetWorkerStub(channel)
            stub.Prefill(target_pb2.PrefillRequest(seq_id="warm", token_ids=ids), timeout=30)
            stub.Release(common_pb2.ReleaseRequest(seq_id="warm"), timeout=30)


def test_killing_the_serving_target_mid_stream_loses_no_token(two_targets, greedy, tiny_served_dir):
    cluster, client = two_targets
    warm_prefix_caches(cluster, tiny_served_dir, PROMPT)
    victim = []

    def kill_serving() -> None:
        victim.append(serving(cluster, "target"))
        kill(victim[0])

    tokens, stats = stream_with_fault(client, request(), kill_serving)
    assert tokens == greedy
    assert stats.target_moves == 1 and stats.generated_tokens == TOKENS
    assert stats.prompt_tokens_reused > 0  # the first replica answered the prompt from its cache
    (survivor,) = [t for t in cluster.workers("target") if t is not victim[0]]
    assert worker_info(survivor).prefix_cache.reused_tokens > 0  # and the rebuild used the new replica's cache


def test_a_seeded_sampled_request_keeps_its_stream_across_a_move(two_targets):
    cluster, client = two_targets
    # Plain sampled decoding: every round is one position, so the rounds cannot differ between runs
    # (with speculation they can: the continuation cache learns from the first run and proposes
    # otherwise in the second, and other drafts mean other acceptance draws).
    seeded = dict(method="none", sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=5))
    expected = list(client.generate(request(**seeded)).token_ids)
    assert list(client.generate(request(**seeded)).token_ids) == expected  # the undisturbed stream repeats
    tokens, stats = stream_with_fault(client, request(**seeded), lambda: kill(serving(cluster, "target")))
    assert stats.target_moves == 1
    assert tokens == expected


def test_a_hung_target_is_left_and_skipped_until_it_answers_again(two_targets, greedy):
    cluster, client = two_targets
    hung = []

    def hang():
        hung.append(serving(cluster, "target"))
        os.kill(hung[0].process.pid, signal.SIGSTOP)

    try:
        tokens, stats = stream_with_fault(client, request(), hang)
        assert tokens == greedy and stats.target_moves == 1
        assert sum(not w.healthy for w in client.info().target_workers) == 1  # marked, and skipped
        reply = client.generate(request())
        assert list(reply.token_ids) == greedy  # new requests go elsewhere
        assert reply.stats.target_worker != hung[0].address and reply.stats.target_moves == 0
    finally:
        for service in hung:
            os.kill(service.process.pid, signal.SIGCONT)
    deadline = time.monotonic() + 30
    while not all(w.healthy for w in client.info().target_workers):  # its health returns
        assert time.monotonic() < deadline, "the resumed replica never turned healthy again"
        time.sleep(0.5)


def test_killing_the_only_draft_mid_stream_goes_on_without_it(tiny_served_dir, tmp_path, greedy):
    with local_cluster(tiny_served_dir, tmp_path, targets=1, drafts=1) as cluster, \
            TandemClient(cluster.coordinator.address, timeout_s=300) as client:
        # fixed k: the draft drafts every round, so it holds the sequence when it is killed. (Adaptive k
        # may rightly not draft at all where verification is cheap and plain steps win.)
        tokens, stats = stream_with_fault(client, request(fixed_k=True), lambda: kill(serving(cluster, "draft")))
        assert tokens == greedy
        assert stats.draft_moves == 1
        assert list(client.generate(request(method="ngram")).token_ids) == greedy  # still serving


def test_a_full_kv_pool_preempts_and_rebuilds_and_every_request_completes(tiny_served_dir, tmp_path):
    alone = target_only(tiny_served_dir, COUNT_PROMPTS, max_new_tokens=COUNT_TOKENS, ignore_eos=True)
    with local_cluster(tiny_served_dir, tmp_path, targets=1, drafts=0, kv_cache_tokens=KV_CACHE_TOKENS) as cluster, \
            TandemClient(cluster.coordinator.address, timeout_s=600) as client:

        def run(prompt):
            return client.generate(build_request(prompt, chat=True, max_new_tokens=COUNT_TOKENS, ignore_eos=True,
                                                 method="ngram"))

        with ThreadPoolExecutor(len(COUNT_PROMPTS)) as pool:
            replies = list(pool.map(run, COUNT_PROMPTS))
        assert {p: list(r.token_ids) for p, r in zip(COUNT_PROMPTS, replies)} == alone
        assert sum(r.stats.preemptions for r in replies) > 0
        assert_kv_whole(cluster.workers("target"))


def test_a_busy_target_under_a_burst_of_long_prompts_is_not_taken_for_hung(tiny_served_dir, tmp_path):
    """48 prompts of 2,000 tokens at once: the last answered waits about five seconds (2-core EPYC, alone), past its
    hang timeout (2 s and 4 times its prompt's price: about 2.4 s). Before workers said what they compute, the
    coordinator took the healthy target for hung then, and moved 23 of 24 such requests (to the same target: each
    read its prompt again). The burst was 24 prompts under a 4 s timeout until a prompt's attention pieces shared
    calls: the tiny model then read all 24 in about a second, under any hang timeout, and nothing was tested."""
    prompts = [[(i * 7919 + j * 104729) % 80 + 10 for j in range(BURST_TOKENS)] for i in range(BURST_PROMPTS)]
    with local_cluster(tiny_served_dir, tmp_path, targets=1, drafts=0, call_timeout_s=BURST_CALL_TIMEOUT_S,
                       kv_cache_tokens=BURST_PROMPTS * (BURST_TOKENS + 64)) as cluster, \
            TandemClient(cluster.coordinator.address, timeout_s=300) as client:
        started = time.monotonic()

        def run(prompt):
            reply = client.generate(build_request(prompt, max_new_tokens=2, method="none", ignore_eos=True))
            return reply, time.monotonic() - started

        with ThreadPoolExecutor(BURST_PROMPTS) as pool:
            answered = list(pool.map(run, prompts))
        waits = sorted(seconds for _, seconds in answered)
        assert [reply.stats.target_moves for reply, _ in answered] == [0] * BURST_PROMPTS, waits
        assert all(len(reply.token_ids) == 2 for reply, _ in answered)
        # the prompts shared a lone chunk per step and finished one after another, not all at the burst's end
        assert waits[0] < waits[-1] / 3, waits
        # calls did outlast their hang timeout (the case this is about), and waited on
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{cluster.coordinator.metrics_port}/metrics", timeout=10)
        busy = re.search(r'^tandem_coordinator_busy_waits_total\{role="target"\} (\S+)$', metrics.read().decode(), re.M)
        assert busy is not None and float(busy.group(1)) > 0, waits
        assert_kv_whole(cluster.workers("target"))
