"""vLLM's metrics, under vLLM's names, on the coordinator's /metrics: what is built to read vLLM reads Tandem.

The Kubernetes Gateway API Inference Extension's endpoint picker (and llm-d, built on it) chooses among a pool's
model servers by two numbers it scrapes, read under vLLM's names unless it is configured otherwise: the queue,
``vllm:num_requests_waiting``, and the KV cache's use, ``vllm:kv_cache_usage_perc`` (``vllm:gpu_cache_usage_perc``
in its older releases; both are served). vLLM's Grafana dashboard, KEDA scalers and guidellm-style scrapers read the
request metrics. Seen from a gateway, a coordinator is the model server: it takes the OpenAI API and places
requests on the target and draft fleets itself. Every sample carries ``model_name`` (the served model, as
``/v1/models`` names it). What each counts here:

- ``vllm:num_requests_waiting``: requests in flight at this coordinator whose target call is waiting: refused for
  room in a full KV pool (a prompt not admitted yet, or a preempted sequence to be rebuilt), or waiting for a
  healthy replica after its own failed, until that call is served (``tandem.spec.failover``);
  ``vllm:num_requests_running``: the others in flight.
- ``vllm:kv_cache_usage_perc``: the share of the target fleet's KV blocks in use (0..1), over the routable healthy
  targets as their last Info poll said (every ``--info-poll-s``, 1 s by default: not per step as in vLLM).
- per finished request: ``vllm:request_success_total`` by ``finished_reason`` (``stop``, ``length``; a client that
  left: ``abort``; an error: ``error``), ``vllm:prompt_tokens_total`` and ``vllm:generation_tokens_total``,
  ``vllm:e2e_request_latency_seconds``, ``vllm:request_queue_time_seconds`` (the time its target calls waited, as
  the waiting count counts them: ``GenerationStats.queue_s``), ``vllm:request_prompt_tokens`` and
  ``vllm:request_generation_tokens``,
  ``vllm:num_preemptions_total``, ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` (prompt
  tokens asked / found in the target's prefix cache at the first Prefill);
- per streamed token: ``vllm:time_to_first_token_seconds``, ``vllm:inter_token_latency_seconds``;
- speculation: ``vllm:spec_decode_num_drafts_total`` (rounds that verified proposed tokens),
  ``vllm:spec_decode_num_draft_tokens_total``, ``vllm:spec_decode_num_accepted_tokens_total`` and
  ``vllm:spec_decode_num_accepted_tokens_per_pos_total`` by ``position`` (0: a round's first proposed token), from
  every proposal source together (Tandem's own ``tandem_coordinator_*`` metrics split them by source).

The metrics are kept unregistered and given to the registry through one collector that adds the model's name when
scraped: the name is known only once a target has answered, after the metrics are made.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:  # (workers import the metrics too, and need nothing of the speculation loop)
    from tandem.spec.request import GenerationStats

# vLLM's buckets, so that a dashboard's quantiles read the same
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0)
# The request's outcome as the coordinator counts it (tandem_coordinator_requests) -> vLLM's finished_reason
OUTCOME_REASONS = {"cancelled": "abort", "drained": "abort", "error": "error"}
MAX_LEN_BUCKETED = 131072  # request token histograms' last bucket: 100,000 (the served context is not known yet)


def token_buckets(max_len: int) -> tuple[int, ...]:
    """vLLM's 1-2-5 buckets up to the served context: 1, 2, 5, 10, 20, 50, ..."""
    buckets, scale = [], 1
    while True:
        for step in (1, 2, 5):
            if step * scale > max_len:
                return tuple(buckets)
            buckets.append(step * scale)
        scale *= 10


class VllmMetrics:
    """The coordinator's vLLM-named metrics. ``model``: the served model's name; ``kv_usage``: the target fleet's KV
    use (0..1). ``waiting`` is the tally each request's ``FailoverVerifier`` counts itself in while it waits;
    ``in_flight`` the requests between ``started`` and ``finished``."""

    def __init__(self, registry: CollectorRegistry, model: Callable[[], str], kv_usage: Callable[[], float],
                 max_len: int = MAX_LEN_BUCKETED) -> None:
        self.waiting = _Tally()
        self.in_flight = 0
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              buckets=TTFT_BUCKETS, registry=None)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             buckets=ITL_BUCKETS, registry=None)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             buckets=REQUEST_LATENCY_BUCKETS, registry=None)
        self.queue_time = Histogram("vllm:request_queue_time_seconds",
                                    "Histogram of time spent in WAITING phase for request.",
                                    buckets=REQUEST_LATENCY_BUCKETS, registry=None)
        lengths = token_buckets(max_len)
        self.request_prompt_tokens = Histogram("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                               buckets=lengths, registry=None)
        self.request_generation_tokens = Histogram("vllm:request_generation_tokens",
                                                   "Number of generation tokens processed.", buckets=lengths,
                                                   registry=None)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", registry=None)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         registry=None)
        self.request_success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                       ["finished_reason"], registry=None)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                   registry=None)
        self.prefix_queries = Counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.", registry=None)
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
                                   registry=None)
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", registry=None)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                                         registry=None)
        self.spec_accepted_tokens = Counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                                            registry=None)
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Accepted tokens per draft position.", ["position"], registry=None)
        metrics = [self.ttft, self.itl, self.e2e, self.queue_time, self.request_prompt_tokens,
                   self.request_generation_tokens, self.prompt_tokens, self.generation_tokens, self.request_success,
                   self.preemptions,
                   self.prefix_queries, self.prefix_hits, self.spec_drafts, self.spec_draft_tokens,
                   self.spec_accepted_tokens, self.spec_accepted_per_pos]
        gauges: list[tuple[str, str, Callable[[], float]]] = [
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             lambda: max(0, self.in_flight - self.waiting.value)),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", lambda: self.waiting.value),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", kv_usage),
            ("vllm:gpu_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage. (vLLM's older name.)", kv_usage),
        ]
        registry.register(_WithModelName(model, gauges, metrics))

    def started(self) -> None:
        self.in_flight += 1

    def round(self, drafted: int, accepted: int) -> None:
        """A speculation round: ``drafted`` proposed tokens verified, of which the first ``accepted`` along the path
        the target kept (positions 0 .. accepted - 1)."""
        if drafted:
            self.spec_drafts.inc()
            self.spec_draft_tokens.inc(drafted)
            self.spec_accepted_tokens.inc(accepted)
            for position in range(accepted):
                self.spec_accepted_per_pos.labels(str(position)).inc()

    def finished(self, stats: GenerationStats, outcome: str, finish_reason: str | None, prompt_tokens: int) -> None:
        """A request has ended: ``outcome`` as ``tandem_coordinator_requests`` counts it (ok, cancelled, drained,
        error), ``finish_reason`` the request's own (stop or length)."""
        self.in_flight -= 1
        reason = OUTCOME_REASONS.get(outcome) or finish_reason or "length"
        self.request_success.labels(reason).inc()
        self.e2e.observe(stats.elapsed_s)
        self.queue_time.observe(stats.queue_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(stats.generated)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(stats.generated)
        self.preemptions.inc(stats.preemptions)
        self.prefix_queries.inc(prompt_tokens)
        self.prefix_hits.inc(stats.prompt_tokens_reused)


class _Tally:
    """Requests waiting now (``tandem.spec.failover.Tally``)."""

    def __init__(self) -> None:
        self.value = 0

    def inc(self) -> None:
        self.value += 1

    def dec(self) -> None:
        self.value -= 1


class _WithModelName(Collector):
    """The gauges, computed when scraped, and the metrics' samples, each labelled with the served model's name."""

    def __init__(self, model: Callable[[], str], gauges: list[tuple[str, str, Callable[[], float]]],
                 metrics: list[Any]) -> None:
        self.model = model
        self.gauges = gauges
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        model = self.model()
        for name, documentation, value in self.gauges:
            family = GaugeMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric([model], value())
            yield family
        for metric in self.metrics:
            for family in metric.collect():
                named = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    named.add_sample(sample.name, {"model_name": model, **sample.labels}, sample.value,
                                     sample.timestamp, sample.exemplar)
                yield named
