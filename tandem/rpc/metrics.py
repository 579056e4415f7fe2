"""Prometheus metrics of each role, registered in the server's own registry (no globals)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from tandem.rpc.vllm_metrics import VllmMetrics

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 12.8)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)
LENGTH_BUCKETS = (0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


class WorkerMetrics:
    """What a draft or target worker exports: batching, KV use, queue, forward latency."""

    def __init__(self, registry: CollectorRegistry, role: str) -> None:
        prefix = f"tandem_{role}"
        self.batch_size = Histogram(f"{prefix}_batch_size", "calls served by one batched forward pass",
                                    buckets=BATCH_BUCKETS, registry=registry)
        self.batch_tokens = Histogram(f"{prefix}_batch_tokens", "tokens in one batched forward pass",
                                      buckets=(1, 4, 16, 64, 256, 1024, 4096), registry=registry)
        self.batch_seconds = Histogram(f"{prefix}_batch_seconds", "wall time of one batch",
                                       buckets=LATENCY_BUCKETS, registry=registry)
        # (read from the batcher at scrape time, ``worker_runner``: set after a batch, it read 0 while calls sat held
        # with no batch running)
        self.queue_depth = Gauge(f"{prefix}_queue_depth", "calls waiting for the next batch, or held for room",
                                 registry=registry)
        self.held_for_room = Gauge(f"{prefix}_held_for_room", "Prefills refused for room and held until room frees "
                                   "(wait_for_room_s; counted in queue_depth too)", registry=registry)
        self.kv_blocks_used = Gauge(f"{prefix}_kv_blocks_used", "KV cache blocks in use", registry=registry)
        self.kv_blocks_total = Gauge(f"{prefix}_kv_blocks_total", "KV cache blocks in the pool", registry=registry)
        self.active_sequences = Gauge(f"{prefix}_active_sequences", "sequences holding KV", registry=registry)
        self.sequences_reclaimed = Counter(
            f"{prefix}_sequences_reclaimed", "sequences freed by the worker itself: their coordinator's lease "
            "ran out (reason=lease) or they sat idle past the time-to-live (reason=idle)", ["reason"],
            registry=registry)


class PrefixCacheCollector(Collector):
    """A worker's prefix cache (``tandem.block_pool.PrefixCacheStats``), read at scrape time."""

    def __init__(self, role: str, snapshot: Callable[[], Any]) -> None:
        self.prefix = f"tandem_{role}_prefix_cache"
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        s, p = self.snapshot(), self.prefix
        yield CounterMetricFamily(f"{p}_prompt_tokens", "prompt tokens looked up in the prefix cache",
                                  value=s.prompt_tokens)
        yield CounterMetricFamily(f"{p}_reused_tokens", "prompt tokens whose KV came from the prefix cache",
                                  value=s.reused_tokens)
        yield GaugeMetricFamily(f"{p}_hit_rate", "reused / prompt tokens since start", value=s.hit_rate)
        yield GaugeMetricFamily(f"{p}_cached_blocks", "KV blocks in the prefix cache's index", value=s.cached_blocks)
        yield GaugeMetricFamily(f"{p}_evictable_blocks", "cached KV blocks no sequence holds (evicted LRU first)",
                                value=s.evictable_blocks)
        yield CounterMetricFamily(f"{p}_evictions", "cached KV blocks evicted for new ones", value=s.evictions)


class SharedPromptCollector(Collector):
    """A target's prompt sharing, read at scrape time: the steps new Prefills waited for a prompt being computed
    (target_worker/shared_prompts.py), and the blocks whose prompt scores are kept (tandem.prompt_score_cache)."""

    def __init__(self, snapshot: Callable[[], tuple[int, int]]) -> None:
        self.snapshot = snapshot  # () -> (prompt waits, blocks with kept scores)

    def collect(self) -> Iterator[Any]:
        waits, scored_blocks = self.snapshot()
        yield CounterMetricFamily("tandem_target_shared_prompt_waits", "steps a new Prefill waited for a prompt "
                                  "being computed that it shares a long prefix with", value=waits)
        yield GaugeMetricFamily("tandem_target_prompt_score_blocks", "full prompt blocks whose tokens' scores are "
                                "kept, so that a scored prompt starts on them", value=scored_blocks)


class ContinuationCacheCollector(Collector):
    """The continuation cache's own counters (Redis errors, dropped writes, breaker...), read at scrape time."""

    COUNTERS = ("lookups", "local_hits", "shared_hits", "misses", "redis_lookups", "redis_skipped", "redis_errors",
                "undecodable_entries", "writes_sent", "writes_dropped", "keys_trimmed")
    GAUGES = ("local_entries", "local_approx_bytes", "pending_writes")

    def __init__(self, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        snap = self.snapshot()
        p = "tandem_coordinator_cache"
        for name in self.COUNTERS:
            yield CounterMetricFamily(f"{p}_{name}", f"continuation cache: {name.replace('_', ' ')}",
                                      value=snap.get(name, 0))
        for name in self.GAUGES:
            yield GaugeMetricFamily(f"{p}_{name}", f"continuation cache: {name.replace('_', ' ')}",
                                    value=snap.get(name, 0))
        yield GaugeMetricFamily(f"{p}_breaker_open", "1 while the Redis circuit breaker is open (local tier only)",
                                value=float(snap.get("breaker_state") == "open"))


class MatchRatesCollector(Collector):
    """Acceptance per kind of n-gram match, as the coordinator's loop plans with it, read at scrape time."""

    def __init__(self, snapshot: Callable[[], list[dict[str, Any]]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Any]:
        labels = ["source", "match_band", "sampled"]
        rate = GaugeMetricFamily("tandem_coordinator_match_acceptance",
                                 "per-token acceptance of n-gram proposals, by source and matched-context band "
                                 "(band n: matches of up to n tokens; the last band: longer)", labels=labels)
        dropped = CounterMetricFamily("tandem_coordinator_match_dropped",
                                      "n-gram proposals not verified (k = 0) because their kind does not pay",
                                      labels=labels)
        for kind in self.snapshot():
            values = [kind["source"], str(kind["band"]), str(kind["sampled"]).lower()]
            rate.add_metric(values, kind["rate"])
            dropped.add_metric(values, kind["dropped"])
        yield rate
        yield dropped


class ReplicaCollector(Collector):
    """Worker replicas the coordinator knows, per role and routing state, read at scrape time."""

    def __init__(self, counts: Callable[[], dict[str, dict[str, int]]]) -> None:
        self.counts = counts

    def collect(self) -> Iterator[Any]:
        family = GaugeMetricFamily("tandem_coordinator_replicas",
                                   "worker replicas by role and state (starting, healthy, unhealthy, leaving, "
                                   "rejected)", labels=["role", "state"])
        for role, states in self.counts().items():
            for state, n in states.items():
                family.add_metric([role, state], n)
        yield family


class BusyWaitsCollector(Collector):
    """Calls that outlasted their hang timeout on a computing worker and waited on, per role, read at scrape time."""

    def __init__(self, waits: Callable[[], dict[str, int]]) -> None:
        self.waits = waits

    def collect(self) -> Iterator[Any]:
        family = CounterMetricFamily("tandem_coordinator_busy_waits",
                                     "worker calls that outlasted their hang timeout while the worker computed other "
                                     "work, and waited on (not taken for hung), by role", labels=["role"])
        for role, n in self.waits().items():
            family.add_metric([role], n)
        yield family


class CoordinatorMetrics:
    """What the coordinator exports: the speculation loop's behaviour per request and per round."""

    def __init__(self, registry: CollectorRegistry, cache_snapshot: Callable[[], dict[str, Any]] | None = None,
                 replica_counts: Callable[[], dict[str, dict[str, int]]] | None = None,
                 match_rates: Callable[[], list[dict[str, Any]]] | None = None,
                 busy_waits: Callable[[], dict[str, int]] | None = None,
                 served_model: Callable[[], str] = lambda: "", kv_usage: Callable[[], float] = lambda: 0.0) -> None:
        p = "tandem_coordinator"
        # the same requests under vLLM's names, for gateways and dashboards built for vLLM (tandem.rpc.vllm_metrics)
        self.vllm = VllmMetrics(registry, served_model, kv_usage)
        self.requests = Counter(f"{p}_requests", "requests by outcome: ok, cancelled (the client left), drained (ended "
                                "as the coordinator's drain grace ran out), error", ["outcome"], registry=registry)
        self.generated_tokens = Counter(f"{p}_generated_tokens", "tokens streamed to clients", registry=registry)
        self.accepted_len = Histogram(f"{p}_accepted_length", "draft tokens accepted per speculative round",
                                      buckets=LENGTH_BUCKETS, registry=registry)
        self.acceptance_rate = Histogram(f"{p}_acceptance_rate", "accepted / drafted per finished request",
                                         buckets=(0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
                                         registry=registry)
        self.chosen_k = Histogram(f"{p}_chosen_k", "k chosen per round (0: plain decoding)",
                                  buckets=LENGTH_BUCKETS, registry=registry)
        self.tokens_per_s = Histogram(f"{p}_request_tokens_per_second", "generated tokens/s per request",
                                      buckets=(1, 2, 4, 6, 8, 12, 16, 24, 32, 64, 128), registry=registry)
        self.ttft = Histogram(f"{p}_time_to_first_token_seconds", "time to first token",
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram(f"{p}_inter_token_latency_seconds", "time between streamed tokens (per token)",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.draft_latency = Histogram(f"{p}_draft_latency_seconds", "Propose call latency",
                                       buckets=LATENCY_BUCKETS, registry=registry)
        self.verify_latency = Histogram(f"{p}_verify_latency_seconds", "Verify call latency",
                                        buckets=LATENCY_BUCKETS, registry=registry)
        self.overhead = Histogram(f"{p}_round_overhead_seconds",
                                  "round time not spent waiting for workers", buckets=LATENCY_BUCKETS,
                                  registry=registry)
        self.active = Gauge(f"{p}_active_requests", "requests in flight", registry=registry)
        self.moves = Counter(f"{p}_replica_moves", "requests moved to another replica after a fault, by role",
                             ["role"], registry=registry)
        self.preemptions = Counter(f"{p}_preemptions", "times a request's target KV was freed for a full pool "
                                   "and rebuilt later", registry=registry)
        # The burst's signal, now that KV-full refusals log at DEBUG: prompts queue here before they preempt anyone.
        self.room_waits = Counter(f"{p}_room_waits", "times a request's Prefill was refused for a full target pool "
                                  "(it held nothing) and waited to ask again", registry=registry)
        self.draft_wait_rounds = Counter(f"{p}_draft_wait_rounds", "rounds a request ran without its draft model "
                                         "because reading what the draft lacked (a long prompt) would not pay yet",
                                         registry=registry)
        # Per proposal source: "ngram" (the request's own text), "cache" (what all requests generated), "draft",
        # "medusa" / "eagle" (the target's heads).
        self.proposals = Counter(f"{p}_proposals", "speculative rounds by proposal source", ["source"],
                                 registry=registry)
        self.proposed_tokens = Counter(f"{p}_proposed_tokens", "draft tokens verified, by source", ["source"],
                                       registry=registry)
        self.accepted_tokens = Counter(f"{p}_accepted_tokens", "draft tokens accepted, by source", ["source"],
                                       registry=registry)
        self.cache_lookups = Counter(f"{p}_cache_lookup_results", "continuation cache lookups by tier that answered",
                                     ["tier"], registry=registry)
        self.cache_lookup_latency = Histogram(f"{p}_cache_lookup_seconds", "continuation cache lookup latency",
                                              buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1),
                                              registry=registry)
        if cache_snapshot is not None:
            registry.register(ContinuationCacheCollector(cache_snapshot))
        if replica_counts is not None:
            registry.register(ReplicaCollector(replica_counts))
        if match_rates is not None:
            registry.register(MatchRatesCollector(match_rates))
        if busy_waits is not None:
            registry.register(BusyWaitsCollector(busy_waits))
