"""A coordinator SIGKILLed mid-request leaves no KV behind on the workers it shares with another.

Real processes: one target and one draft worker (a tiny random-weight Llama, with a
sequence lease of LEASE_S seconds so that the test is quick) and two coordinators over
them. Coordinator A has two long requests under way and is killed outright; coordinator B
has one under way throughout. Each worker must free A's sequences on its own
(``tandem.rpc.leases``: within 1.25 leases of A's last word), count them in
``tandem_<role>_sequences_reclaimed_total{reason="lease"}``, and leave B's sequence alone:
B's request finishes, never moved, with the tokens plain target decoding gives.

The clients read their streams slowly on purpose: a stream's first tokens, then nothing
until the test says so. With a small HTTP/2 window the coordinator's writes then wait,
and so does its request, holding its sequences on the workers (idle, but its coordinator
alive and heard from): every request is certain to be live when A is killed, whatever
the machine's speed, and B's idle sequence shows that only a silent coordinator's
sequences are taken back.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tandem.client import build_request
from tandem.cluster import ClusterSpec, LocalCluster, Service
from tandem.rpc.server import GRPC_OPTIONS
from tandem.v1 import generation_pb2_grpc
from tests.integration.faults import worker_info
from tests.tiny_models import TINY_COMMON, save_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.slow

LEASE_S = 2.0
BOUND_S = 1.25 * LEASE_S  # the lease, and a sweep every quarter of it
SLACK_S = 20.0  # a busy shared machine delays processes; without leases the KV is never freed at all
PROMPT = "a lighthouse keeper, a storm, and a ship"
TOKENS = 400
# A receive window of 1 KiB and no window growth: a coordinator gets a few dozen stream messages
# ahead of a client that stops reading, then its request waits.
SLOW_READER = [*GRPC_OPTIONS, ("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-leases")
    save_tiny_model(path, "llama", seed=11, max_position_embeddings=4096)
    return save_tiny_tokenizer(path, TINY_COMMON["vocab_size"])


def reclaimed(worker: Service, reason: str) -> float:
    """The worker's count of sequences it freed itself for ``reason``, from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{worker.metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    for family in text_string_to_metric_families(text):
        if family.name == f"tandem_{worker.role}_sequences_reclaimed":
            return sum(s.value for s in family.samples
                       if s.name.endswith("_total") and s.labels.get("reason") == reason)
    return 0.0


class SlowStream(threading.Thread):
    """A streaming request that reads its first tokens, then stops reading until ``resume`` is set."""

    def __init__(self, address: str, max_new_tokens: int) -> None:
        super().__init__(daemon=True)
        self.address = address
        # fixed k: every round asks the draft, so the request holds a sequence on both workers.
        self.request = build_request(PROMPT, max_new_tokens=max_new_tokens, ignore_eos=True, method="draft",
                                     fixed_k=True)
        self.tokens: list[int] = []
        self.stats = None
        self.error: grpc.RpcError | None = None
        # Its first round arrived (the prefill's token, then a drafted and verified round): the target and
        # the draft both hold its sequence.
        self.started = threading.Event()
        self.resume = threading.Event()
        self.start()

    def run(self) -> None:
        try:
            with grpc.insecure_channel(self.address, options=SLOW_READER) as channel:
                stub = generation_pb2_grpc.GenerationStub(channel)
                for chunks, chunk in enumerate(stub.GenerateStream(self.request, timeout=300), 1):
                    self.tokens.extend(chunk.token_ids)
                    if chunk.HasField("stats"):
                        self.stats = chunk.stats
                    if chunks >= 2:
                        self.started.set()
                        self.resume.wait()
        except grpc.RpcError as exc:
            self.error = exc
        finally:
            self.started.set()


def test_a_killed_coordinators_kv_is_freed_and_the_other_coordinators_request_is_untouched(model_dir, tmp_path):
    spec = ClusterSpec(target=str(model_dir), draft=str(model_dir), dtype="bfloat16", kv_cache_tokens=16384,
                       worker_threads=1, log_dir=tmp_path, worker_args=("--sequence-lease", str(LEASE_S)))
    with LocalCluster(spec) as cluster:
        a = cluster.coordinator
        b = cluster.add_coordinator()
        workers = [*cluster.workers("target"), *cluster.workers("draft")]
        baseline = {w.role: worker_info(w).free_blocks for w in workers}
        with grpc.insecure_channel(b.address, options=GRPC_OPTIONS) as channel:
            target_only = list(generation_pb2_grpc.GenerationStub(channel).Generate(build_request(
                PROMPT, max_new_tokens=TOKENS, ignore_eos=True, method="none"), timeout=300).token_ids)

        doomed = [SlowStream(a.address, TOKENS) for _ in range(2)]
        survivor = SlowStream(b.address, TOKENS)
        for stream in (*doomed, survivor):
            assert stream.started.wait(120) and stream.error is None, stream.error
        for w in workers:
            assert worker_info(w).active_sequences == 3, f"{w.role} should hold A's two sequences and B's one"

        os.kill(a.process.pid, signal.SIGKILL)
        a.process.wait()
        killed = time.monotonic()
        while not all(reclaimed(w, "lease") == 2 for w in workers):
            assert time.monotonic() - killed < BOUND_S + SLACK_S, (
                f"A's sequences still held {time.monotonic() - killed:.1f}s after it was killed: "
                + ", ".join(f"{w.role} holds {worker_info(w).active_sequences}" for w in workers))
            time.sleep(0.1)
        for w in workers:  # B's sequence, idle all this time but its coordinator alive, is still there
            info = worker_info(w)
            assert info.active_sequences == 1 and info.free_blocks < baseline[w.role], w.role

        survivor.resume.set()
        survivor.join(300)
        assert survivor.error is None, survivor.error
        assert survivor.tokens == target_only
        assert survivor.stats.target_moves == 0 and survivor.stats.draft_moves == 0
        for stream in doomed:
            stream.resume.set()
            stream.join(30)
            assert stream.error is not None and stream.error.code() == grpc.StatusCode.UNAVAILABLE
        for w in workers:  # B released its own (after its reply: coordinator/service.py); nothing is left over
            released = time.monotonic() + 10
            while (info := worker_info(w)).active_sequences and time.monotonic() < released:
                time.sleep(0.05)
            assert (info.free_blocks, info.active_sequences) == (baseline[w.role], 0), w.role
            assert reclaimed(w, "idle") == 0 and reclaimed(w, "lease") == 2
