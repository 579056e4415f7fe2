"""How long a continuation-cache lookup takes: local hit, shared hit over loopback Redis, miss, Redis down.

Each lookup is timed alone (one at a time, as one request's round would do
it) around ``await SharedContinuations.lookup``: packing the context, the
local tier, and for shared hits and misses the one pipelined Redis round
trip and the decoding. Scenarios:

  local_hit       the local tier answers with a long match (Redis is not asked)
  shared_hit      a second "coordinator" with an empty local tier: every answer comes from Redis
  shared_miss     nothing known anywhere: one round trip that finds nothing
  redis_down_miss redis-server killed, breaker open, nothing known locally: what a request pays then

Also the cost of learning (local tier plus queuing for Redis) per token.
Starts its own redis-server on a free port unless --redis-url is given.
Writes benchmarks/results/cache_lookup.json. Goal: shared_hit p50 < 1 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parent.parent
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/cache_lookup.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import DEFAULT_RESULTS_DIR, write_json  # noqa: E402
from tandem.spec.shared_cache import SharedContinuations  # noqa: E402
from tests.redis_server import RedisServer, find_redis_server, free_port  # noqa: E402

NAMESPACE = "cache-lookup-benchmark"
SEQ_LEN = 24  # tokens per learned sequence: an 8-token context and the 16 that followed it
K = 8


def summary(samples: list[float]) -> dict[str, Any]:
    """p50, p90, p99, mean and max of latencies in seconds, reported in microseconds."""
    ordered = sorted(samples)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))] * 1e6

    return {"samples": len(ordered), "p50_us": round(pct(50), 1), "p90_us": round(pct(90), 1),
            "p99_us": round(pct(99), 1), "mean_us": round(statistics.fmean(ordered) * 1e6, 1),
            "max_us": round(ordered[-1] * 1e6, 1)}


async def timed_lookups(cache: SharedContinuations, contexts: list[list[int]], source: str | None) -> list[float]:
    """Latency of each lookup; checks every answer came from ``source`` (None: no answer)."""
    samples = []
    for context in contexts:
        started = time.perf_counter()
        hit = await cache.lookup(context, K)
        samples.append(time.perf_counter() - started)
        got = hit.source if hit is not None else None
        if got != source:
            raise SystemExit(f"expected a {source} answer, got {hit!r}: the benchmark measures the wrong thing")
    return samples


def calibration_us() -> float:
    """Microseconds for a fixed pure-Python loop (lower: a faster or quieter machine), to compare runs."""
    data = bytes(60_000)
    started = time.perf_counter()
    for i in range(0, 42_000, 3):
        data[i : i + 24]
    return round((time.perf_counter() - started) * 1e6, 1)


async def run(url: str, server: RedisServer | None, n: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    corpus = [[rng.randrange(100, 150_000) for _ in range(SEQ_LEN)] for _ in range(n)]
    results: dict[str, Any] = {}
    learner = SharedContinuations(NAMESPACE, url, max_pending=10**7)  # default orders; never started
    started = time.perf_counter()
    for seq in corpus:
        learner.learn(seq, final=True)
    results["learn_us_per_token"] = round((time.perf_counter() - started) / (n * SEQ_LEN) * 1e6, 2)
    del learner
    # The writer shares only 8-token contexts (what the lookups below match) to keep the setup short;
    # the reader reads every order, as a coordinator does.
    writer = SharedContinuations(NAMESPACE, url, max_pending=10**7, shared_orders=[8], max_entries=10**6)
    reader = SharedContinuations(NAMESPACE, url)
    await writer.start()
    await reader.start()
    try:
        for seq in corpus:
            writer.learn(seq, final=True)
        observations = writer.pending_writes
        started = time.process_time()
        await writer.flush()
        results["flush_cpu_us_per_observation"] = round((time.process_time() - started) / observations * 1e6, 2)

        contexts = [seq[:8] for seq in corpus]
        unknown = [[rng.randrange(150_000, 200_000) for _ in range(8)] for _ in range(n)]
        await timed_lookups(writer, contexts[:50], "local")  # warm-up: connections, code paths
        await timed_lookups(reader, unknown[:50], None)
        results["local_hit"] = summary(await timed_lookups(writer, contexts, "local"))
        results["shared_hit"] = summary(await timed_lookups(reader, contexts, "shared"))
        results["shared_miss"] = summary(await timed_lookups(reader, unknown[50:], None))
        results["reader_metrics"] = {k: v for k, v in reader.snapshot().items() if not k.endswith("_s")}
        if server is not None:
            server.stop()
            down = SharedContinuations(NAMESPACE, url)
            await down.start()  # unreachable: starts with the breaker open
            results["redis_down_miss"] = summary(await timed_lookups(down, unknown[50:], None))
            results["redis_down_miss"]["breaker"] = down.breaker.state
            await down.close()
    finally:
        await writer.close()
        await reader.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=2000, help="lookups per scenario (default 2000)")
    parser.add_argument("--redis-url", help="an existing Redis (default: start redis-server on a free port)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    args = parser.parse_args(argv)

    server = None
    with tempfile.TemporaryDirectory(prefix="tandem-cache-bench-") as tmp:
        if args.redis_url is None:
            binary = find_redis_server()
            if binary is None:
                raise SystemExit("redis-server not found: apt-get install redis-server, or pass --redis-url")
            server = RedisServer(binary, free_port(), Path(tmp))
            server.start()
        try:
            results = asyncio.run(run(args.redis_url or server.url, server, args.samples, args.seed))
        finally:
            if server is not None:
                server.stop()
    payload = {"benchmark": "cache_lookup", "k": K, "context_tokens": 8, "python": sys.version.split()[0],
               "redis": "redis-server started by the benchmark" if server else "given --redis-url",
               "calibration_loop_us": calibration_us(), "cpus": os.cpu_count(),
               "load_average_1m": round(os.getloadavg()[0], 2), **results,
               "goal": {"shared_hit_p50_under_1ms": results["shared_hit"]["p50_us"] < 1000}}
    path = write_json(args.out, "cache_lookup", payload)
    for name in ("local_hit", "shared_hit", "shared_miss", "redis_down_miss"):
        if name in results:
            r = results[name]
            print(f"{name:16s} p50 {r['p50_us']:8.1f} us   p99 {r['p99_us']:8.1f} us   ({r['samples']} lookups)")
    print(f"learn {results['learn_us_per_token']} us/token, flush {results['flush_cpu_us_per_observation']} "
          f"us CPU/observation; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
