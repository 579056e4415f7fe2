"""Prometheus metrics of each role, registered in the server's own registry (no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
        self.queue_depth = Gauge(f"{prefix}_queue_depth", "calls waiting for the next batch", registry=registry)
        self.kv_blocks_used = Gauge(f"{prefix}_kv_blocks_used", "KV cache blocks in use", registry=registry)
        self.kv_blocks_total = Gauge(f"{prefix}_kv_blocks_total", "KV cache blocks in the pool", registry=registry)
        self.active_sequences = Gauge(f"{prefix}_active_sequences", "sequences holding KV", registry=registry)


class CoordinatorMetrics:
    """What the coordinator exports: the speculation loop's behaviour per request and per round."""

    def __init__(self, registry: CollectorRegistry) -> None:
        p = "tandem_coordinator"
        self.requests = Counter(f"{p}_requests", "requests by outcome", ["outcome"], registry=registry)
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
