"""The continuation cache, shared through Redis, against the other ways of proposing tokens.

One run, real processes (LocalCluster: one target worker, one draft worker when
a method needs it), bf16, the Qwen pair by default. Every configuration is a
PAIR of coordinators of its own over the same workers (so the models load
once, and every configuration starts with empty caches); requests alternate
between the two coordinators of a pair, one at a time (batch 1, so timings
compare). All pairs run side by side: each request is sent to every
configuration in turn, in a rotating order, so machine noise hits them alike.

1. Sampling rollouts, as RL training or pass@k produce them: --prompts HumanEval
   prompts (chat template), each sampled --samples times at --temperature with a
   seed of its own, the samples spread round-robin over the pair's coordinators.

     target-only           method none (plain decoding)
     prompt-lookup         method ngram, coordinators with --no-continuation-cache
                           (n-gram matches in the request's own text only)
     local-cache           method ngram, each coordinator its own in-process cache
     shared-cache          method ngram, both coordinators --redis-url to one redis-server
     shared-cache-chains   the same with --tree off: chains only, where shared-cache may
                           verify a token tree of the cache's other runs (auto)
     hybrid                method hybrid (n-gram on a 3+ token match, else the draft
                           model), --no-continuation-cache
     hybrid+shared-cache   method hybrid, --redis-url

   With the shared cache a sample can reuse what the OTHER coordinator generated
   for the same prompt; with per-coordinator caches only what its own did.

2. The Spec-Bench mix: --mix-prompts prompts over the six Spec-Bench categories,
   greedy, --mix-tokens each: hybrid without cache vs hybrid+shared-cache (a fresh
   one), alternating coordinators. Unrelated prompts: this measures what the
   cache costs when it rarely helps (lookups, wrong proposals). Greedy decoding
   is lossless either way, so the outputs must be identical.

3. Cache lookup latency on loopback: p50 / p99 of a local hit, a shared hit (one
   Redis round trip) and a miss, measured directly by benchmarks/cache_lookup.py's
   ``run``; and, for reference, the same estimated from the coordinators' own
   tandem_coordinator_cache_lookup_seconds histograms during the rollouts
   (bucket interpolation, coarse).

Reported per method: tokens/s (generated tokens / summed wall seconds of the
Generate calls, seen by the client), speedup over target-only, acceptance
(accepted / drafted), the share of rounds whose proposal came from the cache,
from the request's own text, from the draft model, or that proposed nothing
(from the coordinators' tandem_coordinator_proposals_total deltas), the cache
lookups answered by the shared tier, and Redis errors.

Goals: n-gram with the shared cache >= 2x target-only and >= 1.3x the
per-coordinator cache on the rollouts; hybrid+shared-cache >= 0.97x hybrid on
the Spec-Bench mix; a shared hit p50 < 1 ms.

Writes shared_cache_bench.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/shared_cache_bench.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    DEFAULT_RESULTS_DIR,
    DEFAULT_SPEC_BENCH,
    HUMANEVAL,
    SPEC_BENCH_CATEGORIES,
    Prompt,
    grouped_bars,
    load_prompts,
    markdown_table,
    new_figure,
    quick_default,
    save_figure,
    threshold_line,
    write_json,
    write_markdown,
)
from tandem.cli.draft_flags import add_draft_flags, draft_worker_args  # noqa: E402

NAME = "shared_cache_bench"
BASELINE = "target-only"
QUICK_MODEL = "smollm2"
WARMUP_PROMPT = "Name three colours."  # unrelated to every benchmark prompt: what it teaches a cache is noise
SOURCES = ("cache", "ngram", "draft")  # tandem.spec.proposers: continuation cache, own text, draft model
P = "tandem_coordinator_"


@dataclass(frozen=True, slots=True)
class Config:
    """One configuration of a coordinator pair: the request method and tree mode, and the cache the
    coordinators keep."""

    name: str
    method: str  # the request's speculation method
    cache: str  # "none" (--no-continuation-cache), "local" (in-process) or "shared" (--redis-url)
    tree: str = "auto"  # the request's tree mode (tandem.spec.options.TREE_MODES)

    def coordinator_args(self, redis_url: str | None) -> tuple[str, ...]:
        if self.cache == "none":
            return ("--no-continuation-cache",)
        if self.cache == "shared":
            assert redis_url is not None
            return ("--redis-url", redis_url)
        return ()

    @property
    def uses_draft(self) -> bool:
        return self.method in ("draft", "hybrid")


CONFIGS = {c.name: c for c in (
    Config("target-only", "none", "none"),
    Config("prompt-lookup", "ngram", "none"),
    Config("local-cache", "ngram", "local"),
    Config("shared-cache", "ngram", "shared"),
    Config("shared-cache-chains", "ngram", "shared", tree="off"),
    Config("hybrid", "hybrid", "none"),
    Config("hybrid+shared-cache", "hybrid", "shared"),
)}
MIX_CONFIGS = ("hybrid", "hybrid+shared-cache")


# ----- flags -------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shared_cache_bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None,
                   help="target model, catalog name or directory (default: qwen-coder-1.5b; --quick: smollm2)")
    p.add_argument("--draft", default=None,
                   help="draft model of the hybrid methods (default: qwen-coder-0.5b; --quick: smollm2)")
    add_draft_flags(p)
    p.add_argument("--methods", default=",".join(CONFIGS),
                   help=f"rollout configurations, comma-separated subset of {', '.join(CONFIGS)}; "
                        "target-only is always added (the baseline) (default: all)")
    p.add_argument("--prompts", type=int, default=None,
                   help="HumanEval prompts of the rollouts (default: 4; --quick: 2)")
    p.add_argument("--samples", type=int, default=None, help="samples per prompt (default: 4; --quick: 2)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens per rollout sample at most (default: 128; --quick: 24)")
    p.add_argument("--temperature", type=float, default=0.8, help="rollout sampling temperature (default: %(default)s)")
    p.add_argument("--mix-prompts", type=int, default=None,
                   help="Spec-Bench prompts, spread over its six categories; 0 skips part 2 (default: 12; --quick: 4)")
    p.add_argument("--mix-tokens", type=int, default=None,
                   help="greedy tokens per mix prompt (default: 96; --quick: 24)")
    p.add_argument("--lookup-samples", type=int, default=None,
                   help="lookups per latency scenario (>= 100); 0 skips part 3 (default: 2000; --quick: 300)")
    p.add_argument("--k", type=int, default=4, help="most draft tokens per round, adaptive (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompt selection; sample i of the run is sampled with seed --seed + i "
                        "(default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype of both workers (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run on SmolLM2 (target and draft): 2 prompts x 2 samples x 24 tokens, "
                        "4 mix prompts x 24 tokens, 300 lookups per scenario")
    p.add_argument("--spec-bench", type=Path, default=DEFAULT_SPEC_BENCH,
                   help="Spec-Bench question.jsonl (default: benchmarks/data/spec_bench/question.jsonl)")
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR,
                   help="results directory (default: benchmarks/results)")
    return p


def resolve_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.target = args.target or (QUICK_MODEL if args.quick else "qwen-coder-1.5b")
    args.draft = args.draft or (QUICK_MODEL if args.quick else "qwen-coder-0.5b")
    args.prompts = quick_default(args.prompts, args.quick, 2, 4)
    args.samples = quick_default(args.samples, args.quick, 2, 4)
    args.max_new_tokens = quick_default(args.max_new_tokens, args.quick, 24, 128)
    args.mix_prompts = quick_default(args.mix_prompts, args.quick, 4, 12)
    args.mix_tokens = quick_default(args.mix_tokens, args.quick, 24, 96)
    args.lookup_samples = quick_default(args.lookup_samples, args.quick, 300, 2000)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {', '.join(CONFIGS)}")
    args.methods = [BASELINE, *[m for m in CONFIGS if m in methods and m != BASELINE]]  # table order
    if min(args.prompts, args.samples, args.max_new_tokens, args.mix_tokens, args.k) <= 0:
        raise SystemExit("--prompts, --samples, --max-new-tokens, --mix-tokens and --k must be positive")
    if args.mix_prompts < 0 or args.temperature <= 0:
        raise SystemExit("--mix-prompts must be >= 0 and --temperature > 0 (the rollouts sample)")
    if args.lookup_samples and args.lookup_samples < 100:
        raise SystemExit("--lookup-samples must be 0 (skip) or at least 100")
    return args


# ----- prompts -------------------------------------------------------------
def mix_prompts(n: int, seed: int, path: Path) -> list[Prompt]:
    """``n`` Spec-Bench prompts, taken round-robin over its categories (a seeded sample of each)."""
    if n == 0:
        return []
    per = math.ceil(n / len(SPEC_BENCH_CATEGORIES))
    pool = load_prompts(SPEC_BENCH_CATEGORIES, per, seed, path)
    by_category = [[p for p in pool if p.category == c] for c in SPEC_BENCH_CATEGORIES]
    ordered = [group[i] for i in range(per) for group in by_category if i < len(group)]
    return ordered[:n]


# ----- metrics ---------------------------------------------------------------
def scrape(metrics_port: int) -> dict[str, float]:
    """Every coordinator sample, keyed ``name{label="value",...}`` (labels sorted)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(P):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def metrics_delta(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict[str, float]:
    """What a pair of coordinators counted between two scrapes, summed over the pair."""
    total: dict[str, float] = {}
    for b, a in zip(before, after):
        for key, value in a.items():
            if key.endswith("_created") or "_created{" in key:
                continue
            total[key] = total.get(key, 0.0) + value - b.get(key, 0.0)
    return total


KEPT_METRICS = tuple(P + n for n in ("requests", "generated_tokens", "proposals", "proposed_tokens", "accepted_tokens",
                                      "cache_", "round_overhead_seconds_", "verify_latency_seconds_",
                                      "draft_latency_seconds_"))


def kept_metrics(delta: dict[str, float]) -> dict[str, float]:
    """The deltas worth keeping in the JSON: proposals and the cache's counters, non-zero."""
    return {k: v for k, v in delta.items() if v and k.startswith(KEPT_METRICS)}


def counter(delta: dict[str, float], name: str, **labels: str) -> float:
    key = P + name + ("{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" if labels else "")
    return delta.get(key, 0.0)


def histogram_mean_ms(delta: dict[str, float], name: str) -> float | None:
    count = delta.get(f"{P}{name}_count", 0.0)
    return 1000 * delta.get(f"{P}{name}_sum", 0.0) / count if count else None


def histogram_quantile(delta: dict[str, float], name: str, q: float) -> float | None:
    """Prometheus-style quantile of a histogram delta: linear within the bucket it falls in."""
    prefix = f'{P}{name}_bucket{{le="'
    buckets = sorted((float(k[len(prefix):-2]), v) for k, v in delta.items() if k.startswith(prefix))
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound  # past the last finite bucket: its bound is all one can say
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return None


# ----- coordinator pairs ---------------------------------------------------------
@dataclass(slots=True)
class Pair:
    """Two coordinators of one configuration over the shared workers, and a client of each."""

    config: Config
    services: list[Any]
    clients: list[Any]
    redis_db: int | None = None
    before: list[dict[str, float]] = field(default_factory=list)

    def snapshot(self) -> list[dict[str, float]]:
        return [scrape(s.metrics_port) for s in self.services]


class Redis:
    """One throwaway redis-server (tests/redis_server.py); each configuration gets a database of its own."""

    def __init__(self, workdir: Path) -> None:
        from tests.redis_server import RedisServer, find_redis_server, free_port

        binary = find_redis_server()
        if binary is None:
            raise SystemExit("redis-server not found: apt-get install redis-server")
        self.server = RedisServer(binary, free_port(), workdir)
        self.next_db = 1

    def fresh_url(self) -> tuple[str, int]:
        """A database nobody has used yet in this run: an empty shared cache."""
        db, self.next_db = self.next_db, self.next_db + 1
        if db > 15:
            raise RuntimeError("redis-server has 16 databases; this run needs more fresh ones")
        return f"redis://127.0.0.1:{self.server.port}/{db}", db


def start_pair(cluster: Any, config: Config, redis: Redis) -> Pair:
    from tandem.client import TandemClient

    url, db = redis.fresh_url() if config.cache == "shared" else (None, None)
    services = [cluster.add_coordinator(extra_args=config.coordinator_args(url)) for _ in range(2)]
    clients = [TandemClient(s.address, timeout_s=1800) for s in services]
    return Pair(config, services, clients, db)


def stop_pairs(pairs: list[Pair]) -> None:
    """SIGTERM the pairs' coordinators (the workers stay) and wait for them to drain."""
    for pair in pairs:
        for client in pair.clients:
            client.close()
        for service in pair.services:
            if service.process.poll() is None:
                service.process.send_signal(signal.SIGTERM)
    for pair in pairs:
        for service in pair.services:
            try:
                service.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                service.process.kill()
                service.process.wait()


def request(prompt: str, config: Config, args: argparse.Namespace, max_new_tokens: int, seed: int | None) -> Any:
    """A chat request at batch 1, unpipelined (the local default); ``seed`` None: greedy."""
    from tandem.client import build_request
    from tandem.sampling import SamplingParams

    sampling = SamplingParams(args.temperature, seed=seed) if seed is not None else SamplingParams(0.0)
    return build_request(prompt, chat=True, max_new_tokens=max_new_tokens, sampling=sampling,
                         method=config.method, k=args.k, pipelining=False, tree=config.tree)


def warm_up(pairs: list[Pair], args: argparse.Namespace) -> None:
    """One short untimed request per coordinator (connections, cost models), then the metrics baseline."""
    for pair in pairs:
        for client in pair.clients:
            client.generate(request(WARMUP_PROMPT, pair.config, args, 8, None))
    for pair in pairs:
        pair.before = pair.snapshot()


def generate(pair: Pair, coordinator: int, prompt: Prompt, args: argparse.Namespace, max_new_tokens: int,
             seed: int | None) -> dict[str, Any]:
    """One timed request; the row keeps what the reply says."""
    req = request(prompt.text, pair.config, args, max_new_tokens, seed)
    started = time.perf_counter()
    reply = pair.clients[coordinator].generate(req)
    seconds = time.perf_counter() - started
    s = reply.stats
    return {"method": pair.config.name, "prompt_id": prompt.prompt_id, "category": prompt.category, "seed": seed,
            "coordinator": coordinator, "prompt_tokens": s.prompt_tokens, "tokens": s.generated_tokens,
            "seconds": seconds, "server_elapsed_s": s.elapsed_s, "drafted": s.drafted, "accepted": s.accepted,
            "rounds": s.rounds, "finish_reason": reply.finish_reason, "token_ids": list(reply.token_ids)}


def rotated(items: list[Any], by: int) -> list[Any]:
    by %= len(items)
    return items[by:] + items[:by]


# ----- the three parts -------------------------------------------------------------
def run_rollouts(pairs: list[Pair], prompts: list[Prompt], args: argparse.Namespace, bar: Any) -> list[dict[str, Any]]:
    """Every sample of every prompt through every configuration, sample i on coordinator i % 2."""
    runs = []
    i = 0
    for prompt in prompts:
        for sample in range(args.samples):
            for pair in rotated(pairs, i):  # who goes first rotates: noise hits every configuration alike
                bar.set_postfix(method=pair.config.name, prompt=prompt.prompt_id, sample=sample)
                row = generate(pair, i % 2, prompt, args, args.max_new_tokens, args.seed + i)
                row["sample"] = sample
                runs.append(row)
                bar.update(1)
            i += 1
    return runs


def run_mix(pairs: list[Pair], prompts: list[Prompt], args: argparse.Namespace, bar: Any) -> list[dict[str, Any]]:
    """Greedy, every prompt through both configurations, prompt i on coordinator i % 2."""
    runs = []
    for i, prompt in enumerate(prompts):
        for pair in rotated(pairs, i):
            bar.set_postfix(method=pair.config.name, prompt=prompt.prompt_id)
            runs.append(generate(pair, i % 2, prompt, args, args.mix_tokens, None))
            bar.update(1)
    return runs


def measure_lookups(url: str, samples: int, seed: int) -> dict[str, Any]:
    """benchmarks/cache_lookup.py's scenarios (local hit, shared hit, miss) against this run's redis-server."""
    from benchmarks.cache_lookup import run as cache_lookup_run

    results = asyncio.run(cache_lookup_run(url, None, samples, seed))
    return {name: results[name] for name in ("local_hit", "shared_hit", "shared_miss")}


# ----- aggregation ---------------------------------------------------------------------
def summarize(runs: list[dict[str, Any]], pairs: list[Pair], deltas: dict[str, dict[str, float]],
              baseline: str | None) -> list[dict[str, Any]]:
    """One row per configuration: speed, acceptance, where the proposals came from."""
    rows = []
    for pair in pairs:
        name = pair.config.name
        mine = [r for r in runs if r["method"] == name]
        tokens, seconds = sum(r["tokens"] for r in mine), sum(r["seconds"] for r in mine)
        drafted, accepted = sum(r["drafted"] for r in mine), sum(r["accepted"] for r in mine)
        rounds = sum(r["rounds"] for r in mine)
        d = deltas[name]
        by_source = {s: counter(d, "proposals_total", source=s) for s in SOURCES}
        lookups = {t: counter(d, "cache_lookup_results_total", tier=t) for t in ("local", "shared", "miss")}
        proposed_cache = counter(d, "proposed_tokens_total", source="cache")
        row = {"method": name, "request_method": pair.config.method, "cache": pair.config.cache,
               "tree": pair.config.tree, "requests": len(mine), "tokens": tokens, "seconds": round(seconds, 3),
               "tokens_per_s": tokens / seconds if seconds else None, "speedup": None,
               "acceptance": accepted / drafted if drafted else None, "drafted": drafted, "accepted": accepted,
               "rounds": rounds,
               # Shares of all rounds (the rest proposed nothing: k = 0 or no match), from the metrics.
               "share_cache": by_source["cache"] / rounds if rounds else None,
               "share_own_text": by_source["ngram"] / rounds if rounds else None,
               "share_draft": by_source["draft"] / rounds if rounds else None,
               "share_none": 1 - sum(by_source.values()) / rounds if rounds else None,
               "cache_acceptance": (counter(d, "accepted_tokens_total", source="cache") / proposed_cache
                                    if proposed_cache else None),
               "lookups": sum(lookups.values()), "lookups_local": lookups["local"],
               "lookups_shared": lookups["shared"], "lookups_miss": lookups["miss"],
               "lookup_p50_us": None, "lookup_p99_us": None,
               "redis_errors": counter(d, "cache_redis_errors_total"),
               "redis_writes_dropped": counter(d, "cache_writes_dropped_total"),
               # Where a round's time goes: the coordinator's own work (cache lookups included) and the workers.
               "overhead_ms_per_round": histogram_mean_ms(d, "round_overhead_seconds"),
               "verify_ms": histogram_mean_ms(d, "verify_latency_seconds"),
               "draft_ms": histogram_mean_ms(d, "draft_latency_seconds")}
        if row["lookups"]:
            p50 = histogram_quantile(d, "cache_lookup_seconds", 0.5)
            p99 = histogram_quantile(d, "cache_lookup_seconds", 0.99)
            row["lookup_p50_us"] = p50 * 1e6 if p50 is not None else None
            row["lookup_p99_us"] = p99 * 1e6 if p99 is not None else None
        rows.append(row)
    base = next((r for r in rows if r["method"] == baseline), None)
    for row in rows:
        if base and base["tokens_per_s"] and row["tokens_per_s"]:
            row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
    return rows


def by_sample(runs: list[dict[str, Any]], methods: list[str], samples: int) -> list[dict[str, Any]]:
    """tokens/s per method and sample index: sample 0 meets empty caches, later ones what earlier ones taught."""
    rows = []
    for method in methods:
        row: dict[str, Any] = {"method": method}
        for s in range(samples):
            mine = [r for r in runs if r["method"] == method and r["sample"] == s]
            seconds = sum(r["seconds"] for r in mine)
            row[f"sample {s}"] = sum(r["tokens"] for r in mine) / seconds if seconds else None
        rows.append(row)
    return rows


def ratio(rows: list[dict[str, Any]], a: str, b: str) -> float | None:
    ra = next((r for r in rows if r["method"] == a), None)
    rb = next((r for r in rows if r["method"] == b), None)
    if ra and rb and ra["tokens_per_s"] and rb["tokens_per_s"]:
        return ra["tokens_per_s"] / rb["tokens_per_s"]
    return None


# ----- output ----------------------------------------------------------------------
ROLLOUT_COLUMNS = ("method", "requests", "tokens", "seconds", "tokens_per_s", "speedup", "acceptance",
                   "share_cache", "share_own_text", "share_draft", "share_none", "cache_acceptance",
                   "lookups_shared", "redis_errors", "overhead_ms_per_round", "verify_ms", "draft_ms")
MIX_COLUMNS = ("method", "requests", "tokens", "seconds", "tokens_per_s", "speedup", "acceptance",
               "share_cache", "share_own_text", "share_draft", "share_none", "cache_acceptance", "redis_errors",
               "overhead_ms_per_round", "verify_ms", "draft_ms")


def latency_table(lookups: dict[str, Any] | None, rollout_rows: list[dict[str, Any]]) -> str:
    rows = []
    for name, r in (lookups or {}).items():
        rows.append({"what": f"cache_lookup.py {name}", "samples": r["samples"], "p50_us": r["p50_us"],
                     "p99_us": r["p99_us"]})
    for r in rollout_rows:
        if r["lookups"]:
            rows.append({"what": f"in the loop, {r['method']} (histogram estimate)", "samples": int(r["lookups"]),
                         "p50_us": r["lookup_p50_us"], "p99_us": r["lookup_p99_us"]})
    return markdown_table(rows, ("what", "samples", "p50_us", "p99_us")) if rows else "(not measured)"


def verdicts(rollout_rows: list[dict[str, Any]], mix_rows: list[dict[str, Any]],
             lookups: dict[str, Any] | None) -> tuple[dict[str, float | None], list[str]]:
    summary = {
        "shared_cache_over_target_only": ratio(rollout_rows, "shared-cache", BASELINE),
        "shared_cache_over_local_cache": ratio(rollout_rows, "shared-cache", "local-cache"),
        "local_cache_over_prompt_lookup": ratio(rollout_rows, "local-cache", "prompt-lookup"),
        "hybrid_shared_over_hybrid_rollouts": ratio(rollout_rows, "hybrid+shared-cache", "hybrid"),
        "mix_hybrid_shared_over_hybrid": ratio(mix_rows, "hybrid+shared-cache", "hybrid"),
        "shared_hit_p50_ms": lookups["shared_hit"]["p50_us"] / 1000 if lookups else None,
        "shared_hit_p99_ms": lookups["shared_hit"]["p99_us"] / 1000 if lookups else None,
    }
    lines = [
        threshold_line("rollouts: n-gram shared-cache / target-only tokens/s",
                       summary["shared_cache_over_target_only"], ">=", 2.0),
        threshold_line("rollouts: n-gram shared-cache / local-cache (per coordinator) tokens/s",
                       summary["shared_cache_over_local_cache"], ">=", 1.3),
        threshold_line("Spec-Bench mix: hybrid+shared-cache / hybrid tokens/s",
                       summary["mix_hybrid_shared_over_hybrid"], ">=", 0.97),
        threshold_line("loopback shared-hit lookup p50, ms", summary["shared_hit_p50_ms"], "<", 1.0),
    ]
    if summary["local_cache_over_prompt_lookup"] is not None:
        lines.append(f"  info  rollouts: local-cache / prompt-lookup tokens/s: "
                     f"{summary['local_cache_over_prompt_lookup']:.3f}")
    if summary["hybrid_shared_over_hybrid_rollouts"] is not None:
        lines.append(f"  info  rollouts: hybrid+shared-cache / hybrid tokens/s: "
                     f"{summary['hybrid_shared_over_hybrid_rollouts']:.3f}")
    if summary["shared_hit_p99_ms"] is not None:
        lines.append(f"  info  loopback shared-hit lookup p99: {summary['shared_hit_p99_ms']:.3f} ms")
    for part, rows in (("rollouts", rollout_rows), ("Spec-Bench mix", mix_rows)):
        for r in rows:
            if r["request_method"] != "none" and r["share_none"] is not None and r["share_none"] > 0.9:
                lines.append(f"  note  {part}: {r['method']} proposed nothing in {r['share_none']:.0%} of rounds "
                             "(adaptive k chose 0: a draft as costly as the target, as in --quick, never pays)")
    return summary, lines


def chart(rollout_rows: list[dict[str, Any]], mix_rows: list[dict[str, Any]], out: Path) -> Path:
    """tokens/s per configuration (rollouts, mix) and where each configuration's rounds' proposals came from."""
    fig, axes = new_figure(ncols=3, width=5.5)
    names = [r["method"] for r in rollout_rows]
    grouped_bars(axes[0], names, {"tokens/s": [r["tokens_per_s"] for r in rollout_rows]}, "tokens/s")
    for x, r in enumerate(rollout_rows):
        if r["speedup"]:
            axes[0].annotate(f"{r['speedup']:.2f}x", (x, r["tokens_per_s"] or 0), ha="center", va="bottom",
                             fontsize="small")
    axes[0].set_title("sampling rollouts: tokens/s (speedup over target-only)")
    bottom = [0.0] * len(rollout_rows)
    for key, label in (("share_cache", "cache"), ("share_own_text", "own text"), ("share_draft", "draft model"),
                       ("share_none", "no proposal")):
        values = [r[key] or 0.0 for r in rollout_rows]
        axes[1].bar(range(len(rollout_rows)), values, 0.6, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[1].set_xticks(range(len(rollout_rows)))
    axes[1].set_xticklabels(names, rotation=20, ha="right")
    axes[1].set_ylabel("share of rounds")
    axes[1].set_ylim(0, 1.25)
    axes[1].set_title("rollouts: where each round's proposal came from")
    axes[1].legend(fontsize="small", ncol=4, loc="upper center")
    if mix_rows:
        grouped_bars(axes[2], [r["method"] for r in mix_rows], {"tokens/s": [r["tokens_per_s"] for r in mix_rows]},
                     "tokens/s")
        for x, r in enumerate(mix_rows):
            if r["speedup"]:
                axes[2].annotate(f"{r['speedup']:.2f}x", (x, r["tokens_per_s"] or 0), ha="center", va="bottom",
                                 fontsize="small")
        axes[2].set_title("Spec-Bench mix, greedy: tokens/s (over hybrid)")
    else:
        axes[2].set_axis_off()
    return save_figure(fig, out, NAME)


def write_results(args: argparse.Namespace, payload: dict[str, Any], rollout_rows: list[dict[str, Any]],
                  sample_rows: list[dict[str, Any]], mix_rows: list[dict[str, Any]], lookups: dict[str, Any] | None,
                  lines: list[str]) -> list[Path]:
    settings = payload["settings"]
    shown = {k: v for k, v in settings.items() if k not in ("rollout_prompts", "mix_prompts")}
    body = [f"Settings: `{shown}`", "",
            f"## Sampling rollouts ({settings['prompts']} HumanEval prompts x {settings['samples']} samples, "
            f"temperature {settings['temperature']}, {settings['max_new_tokens']} tokens at most, "
            "two coordinators per configuration, round-robin)", "",
            markdown_table(rollout_rows, ROLLOUT_COLUMNS), "",
            "share_*: share of all rounds whose proposal came from the continuation cache, the request's own "
            "text or the draft model (the rest proposed nothing); cache_acceptance: accepted / proposed tokens "
            "of the cache's proposals; lookups_shared: lookups the Redis tier answered; overhead_ms_per_round: "
            "round time the coordinator spent not waiting for a worker (cache lookups included); verify_ms, "
            "draft_ms: mean Verify / Propose call latency seen by the coordinators.", "",
            "tokens/s by sample index (sample 0 meets empty caches):", "",
            markdown_table(sample_rows, list(sample_rows[0]) if sample_rows else ["method"]), ""]
    if mix_rows:
        body += [f"## Spec-Bench mix ({len(settings['mix_prompts'])} prompts, greedy, {settings['mix_tokens']} tokens)",
                 "", markdown_table(mix_rows, MIX_COLUMNS), "",
                 f"Identical outputs, hybrid vs hybrid+shared-cache: {payload['summary']['mix_identical_outputs']}", ""]
    body += ["## Cache lookup latency (loopback Redis)", "", latency_table(lookups, rollout_rows), "",
             "## Goals", "", "```", *lines, "```"]
    return [write_json(args.out, NAME, payload),
            write_markdown(args.out, NAME, "Shared continuation cache benchmark", "\n".join(body)),
            chart(rollout_rows, mix_rows, args.out)]


# ----- main -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = resolve_args(argv)
    from tqdm import tqdm

    from tandem.cluster import ClusterSpec, LocalCluster

    rollout_prompts = load_prompts([HUMANEVAL], args.prompts, args.seed, args.spec_bench)
    mix = mix_prompts(args.mix_prompts, args.seed, args.spec_bench)
    configs = [CONFIGS[m] for m in args.methods]
    needs_draft = any(c.uses_draft for c in configs) or bool(mix)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    # SIGTERM (a job stopped by kill, a CI timeout) must reach the ``finally`` below like Ctrl-C: the
    # workers and coordinators would drain anyway (they watch this process), but redis-server does not.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    workdir = Path(tempfile.mkdtemp(prefix="tandem-shared-cache-bench-"))
    redis = Redis(workdir)
    redis.server.start()
    spec = ClusterSpec(target=args.target, draft=args.draft if needs_draft else None, dtype=args.dtype,
                       coordinator_args=("--no-continuation-cache",), log_dir=workdir / "logs",
                       draft_args=tuple(draft_worker_args(args)) if needs_draft else ())
    cluster = LocalCluster(spec)
    print(f"{len(rollout_prompts)} prompts x {args.samples} samples x {len(configs)} configurations, "
          f"{len(mix)} mix prompts x 2; starting {args.target} (+ {args.draft} draft) "
          f"(logs: {workdir / 'logs'})", file=sys.stderr)
    ok = False
    setup_s = 0.0  # starting processes, warm-ups: time the measured requests do not include
    try:
        t0 = time.perf_counter()
        cluster.start()
        # The first coordinator only warms the workers up (first-call allocations), then leaves.
        from tandem.client import TandemClient

        first = Pair(CONFIGS[BASELINE], [cluster.coordinator], [TandemClient(cluster.coordinator.address, 1800)])
        for name in (BASELINE, "hybrid") if needs_draft else (BASELINE,):
            first.clients[0].generate(request(WARMUP_PROMPT, CONFIGS[name], args, 8, None))
        stop_pairs([first])

        print(f"starting {2 * len(configs)} coordinators", file=sys.stderr)
        pairs = [start_pair(cluster, c, redis) for c in configs]
        warm_up(pairs, args)
        setup_s += time.perf_counter() - t0
        total = len(rollout_prompts) * args.samples * len(configs) + 2 * len(mix)
        bar = tqdm(total=total, desc=NAME, unit="req", file=sys.stderr)
        rollout_runs = run_rollouts(pairs, rollout_prompts, args, bar)
        rollout_deltas = {p.config.name: metrics_delta(p.before, p.snapshot()) for p in pairs}
        stop_pairs(pairs)
        rollout_rows = summarize(rollout_runs, pairs, rollout_deltas, BASELINE)
        redis_dbs = {p.config.name: p.redis_db for p in pairs if p.redis_db is not None}

        mix_runs: list[dict[str, Any]] = []
        mix_rows: list[dict[str, Any]] = []
        mix_deltas: dict[str, dict[str, float]] = {}
        if mix:
            t0 = time.perf_counter()
            mix_pairs = [start_pair(cluster, CONFIGS[m], redis) for m in MIX_CONFIGS]
            warm_up(mix_pairs, args)
            setup_s += time.perf_counter() - t0
            mix_runs = run_mix(mix_pairs, mix, args, bar)
            mix_deltas = {p.config.name: metrics_delta(p.before, p.snapshot()) for p in mix_pairs}
            stop_pairs(mix_pairs)
            mix_rows = summarize(mix_runs, mix_pairs, mix_deltas, "hybrid")
        bar.close()
        cluster.stop()

        lookups = None
        if args.lookup_samples:
            print(f"cache lookup latency: {args.lookup_samples} lookups per scenario", file=sys.stderr)
            url, _ = redis.fresh_url()
            lookups = measure_lookups(url, args.lookup_samples, args.seed)
        ok = True
    finally:
        cluster.stop()
        redis.server.stop()
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"logs kept in {workdir / 'logs'}", file=sys.stderr)

    summary, lines = verdicts(rollout_rows, mix_rows, lookups)
    plain = [r for r in mix_runs if r["method"] == "hybrid"]
    cached = [r for r in mix_runs if r["method"] == "hybrid+shared-cache"]
    same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(plain, cached))
    summary["mix_identical_outputs"] = f"{same}/{len(plain)}"
    if plain:
        lines.append(f"  info  Spec-Bench mix identical greedy outputs, hybrid vs hybrid+shared-cache: "
                     f"{summary['mix_identical_outputs']}")
    sample_rows = by_sample(rollout_runs, args.methods, args.samples)
    for r in [*rollout_runs, *mix_runs]:
        r.pop("token_ids")
    settings = {
        "target": args.target, "draft": args.draft if needs_draft else None, "dtype": args.dtype,
        "draft_quantization": args.draft_quantization, "draft_vocab": args.draft_vocab, "k": args.k,
        "adaptive_k": True, "pipelining": False, "methods": args.methods, "prompts": args.prompts,
        "samples": args.samples, "temperature": args.temperature, "max_new_tokens": args.max_new_tokens,
        "mix_tokens": args.mix_tokens, "lookup_samples": args.lookup_samples, "seed": args.seed,
        "quick": args.quick, "spec_bench_file": args.spec_bench.name,
        "rollout_prompts": [p.prompt_id for p in rollout_prompts], "mix_prompts": [p.prompt_id for p in mix],
    }
    payload = {
        "benchmark": NAME, "settings": settings, "summary": summary, "thresholds": lines,
        "machine": {"cpus": os.cpu_count(), "load_average_1m_before": round(load_before, 2),
                    "load_average_1m_after": round(os.getloadavg()[0], 2),
                    "wall_s": round(time.perf_counter() - started, 1), "setup_s": round(setup_s, 1),
                    "python": sys.version.split()[0]},
        "redis_databases": redis_dbs, "rollouts": rollout_rows, "rollouts_by_sample": sample_rows, "mix": mix_rows,
        "lookup_latency": lookups,
        "metrics_deltas": {"rollouts": {k: kept_metrics(d) for k, d in rollout_deltas.items()},
                           "mix": {k: kept_metrics(d) for k, d in mix_deltas.items()}},
        "runs": {"rollouts": rollout_runs, "mix": mix_runs},
    }
    print(markdown_table(rollout_rows, ROLLOUT_COLUMNS))
    print()
    print(markdown_table(sample_rows, list(sample_rows[0])))
    if mix_rows:
        print()
        print(markdown_table(mix_rows, MIX_COLUMNS))
    print()
    print(latency_table(lookups, rollout_rows))
    print("\n".join(lines))
    paths = write_results(args, payload, rollout_rows, sample_rows, mix_rows, lookups, lines)
    print(f"wrote {', '.join(str(p) for p in paths)} in {payload['machine']['wall_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
