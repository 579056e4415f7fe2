"""Load held: 64 concurrent streams against a real cluster, every output checked.

`make test` runs one wave (every stream one request) on the tiny served
model (tests/tiny_models.py): the property is about processes, batching and
KV, not text. The long tier runs the same on SmolLM2: one wave by default,
and `make soak` runs waves for TANDEM_SOAK_SECONDS (default there: 300) and
writes the figures to TANDEM_SOAK_REPORT. Each stream sends greedy requests
from a small pool of prompts; every output must equal that prompt's output
when it ran alone (our bf16 kernels are batch-invariant, so batching must not
change a token), no request may fail, and afterwards every worker's KV pool
is whole again. Reported: requests, tokens/s, time to first token and time
per output token (p50, p99), and each process's resident memory before and
after.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tandem.client import TandemClient, build_request
from tandem.cluster import LocalCluster
from tests.integration.faults import assert_kv_whole, local_cluster

pytestmark = pytest.mark.slow

STREAMS = 64
TOKENS = 32
PROMPTS = [
    "Name three rivers in Europe.",
    "def add(a, b):",
    "Write a haiku about the sea.",
    "What is a prime number?",
    "List four colours of the rainbow.",
    "Explain recursion in one sentence.",
    "class Stack:",
    "Translate 'good morning' into French.",
]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def request(prompt: str):
    return build_request(prompt, chat=True, max_new_tokens=TOKENS, ignore_eos=True)


def soak(cluster: LocalCluster, client: TandemClient, seconds: float) -> dict:
    """``STREAMS`` streams of requests until ``seconds`` have passed (0: one wave); asserts that none failed,
    every output equals its prompt's output alone, and every worker's KV pool is whole again. Returns the
    figures."""
    alone = {p: list(client.generate(request(p)).token_ids) for p in PROMPTS}
    baseline = {s.role + str(i): rss_mb(s.process.pid) for i, s in enumerate(cluster.services)}
    ttft, tpot, failures, mismatches = [], [], [], []
    counted = {"requests": 0, "tokens": 0}
    lock = threading.Lock()
    started = time.monotonic()

    def stream(index: int) -> None:
        wave = 0
        while True:
            prompt = PROMPTS[(index + wave) % len(PROMPTS)]
            t0 = time.monotonic()
            first = None
            tokens: list[int] = []
            try:
                for chunk in client.stream(request(prompt)):
                    if chunk.token_ids and first is None:
                        first = time.monotonic() - t0
                    tokens.extend(chunk.token_ids)
            except Exception as exc:  # noqa: BLE001 - every failure is collected and reported
                with lock:
                    failures.append(repr(exc))
                return
            total = time.monotonic() - t0
            with lock:
                counted["requests"] += 1
                counted["tokens"] += len(tokens)
                ttft.append(first or total)
                tpot.append((total - (first or 0)) / max(1, len(tokens) - 1))
                if tokens != alone[prompt]:
                    mismatches.append(prompt)
            wave += 1
            if time.monotonic() - started >= seconds:
                return

    with ThreadPoolExecutor(STREAMS) as pool:
        list(pool.map(stream, range(STREAMS)))
    elapsed = time.monotonic() - started

    assert failures == []
    assert mismatches == []
    assert counted["requests"] >= STREAMS
    assert_kv_whole(cluster.workers("target") + cluster.workers("draft"))
    return {
        "streams": STREAMS, "seconds": round(elapsed, 1), "requests": counted["requests"],
        "tokens": counted["tokens"], "tokens_per_s": round(counted["tokens"] / elapsed, 1),
        "failed": len(failures), "mismatched": len(mismatches),
        "ttft_p50_s": round(statistics.median(ttft), 3), "ttft_p99_s": round(percentile(ttft, 0.99), 3),
        "tpot_p50_s": round(statistics.median(tpot), 4), "tpot_p99_s": round(percentile(tpot, 0.99), 4),
        "rss_mb_before": baseline,
        "rss_mb_after": {s.role + str(i): rss_mb(s.process.pid) for i, s in enumerate(cluster.services)},
    }


def test_a_wave_of_64_streams_on_the_tiny_model_is_exact_and_leaves_kv_whole(tiny_served_dir, tmp_path):
    # The default hang limit: this test is about load, not hangs, and 64 requests queue on one worker.
    with local_cluster(tiny_served_dir, tmp_path, targets=1, drafts=1, kv_cache_tokens=8192,
                       call_timeout_s=60.0) as cluster, \
            TandemClient(cluster.coordinator.address, timeout_s=300) as client:
        print(json.dumps(soak(cluster, client, seconds=0), indent=1))


@pytest.mark.long
def test_64_streams_hold_on_smollm2_and_every_output_is_exact(smollm2_dir, tmp_path):
    seconds = float(os.environ.get("TANDEM_SOAK_SECONDS", "0"))  # 0: one wave
    # 64 prefills at once queue for tens of seconds on one thread: far beyond a short hang limit,
    # which would take a busy worker for a hung one.
    with local_cluster(smollm2_dir, tmp_path, targets=1, drafts=1, kv_cache_tokens=8192,
                       call_timeout_s=300.0) as cluster, \
            TandemClient(cluster.coordinator.address, timeout_s=600) as client:
        report = soak(cluster, client, seconds)
    print(json.dumps(report, indent=1))
    if os.environ.get("TANDEM_SOAK_REPORT"):
        Path(os.environ["TANDEM_SOAK_REPORT"]).write_text(json.dumps(report, indent=1) + "\n")
