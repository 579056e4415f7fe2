"""vLLM's metric names on the coordinator (tandem/rpc/vllm_metrics.py): what each request and round adds, as a
scrape reads it (the official Prometheus text parser), every sample labelled with the served model."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tandem.rpc.metrics import CoordinatorMetrics
from tandem.rpc.vllm_metrics import token_buckets
from tandem.spec.request import GenerationStats


def scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every vllm: sample, by name and labels."""
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            if sample.name.startswith("vllm:"):
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted({"model_name": "qwen", **labels}.items())))]


def test_requests_rounds_and_the_fleet_s_kv_read_as_vllm_names_them():
    registry = CollectorRegistry()
    usage = [0.0]
    metrics = CoordinatorMetrics(registry, served_model=lambda: "qwen", kv_usage=lambda: usage[0]).vllm
    metrics.started()
    metrics.started()
    metrics.waiting.inc()  # one of the two waits for room
    usage[0] = 0.375
    metrics.round(4, 2)  # a chain of 4, its first 2 kept
    metrics.round(3, 0)
    metrics.round(0, 0)  # a plain step: no draft
    samples = scrape(registry)
    assert value(samples, "vllm:num_requests_running") == 1 and value(samples, "vllm:num_requests_waiting") == 1
    assert value(samples, "vllm:kv_cache_usage_perc") == 0.375 == value(samples, "vllm:gpu_cache_usage_perc")
    assert value(samples, "vllm:spec_decode_num_drafts_total") == 2
    assert value(samples, "vllm:spec_decode_num_draft_tokens_total") == 7
    assert value(samples, "vllm:spec_decode_num_accepted_tokens_total") == 2
    assert value(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") == 1
    assert value(samples, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position="1") == 1
    assert ("vllm:spec_decode_num_accepted_tokens_per_pos_total",
            (("model_name", "qwen"), ("position", "2"))) not in samples

    stats = GenerationStats(generated=5, preemptions=1, prompt_tokens_reused=16, queue_s=0.75)
    stats.last_token_at = stats.started_at + 2.0
    metrics.waiting.dec()
    metrics.finished(stats, "ok", "stop", prompt_tokens=40)
    metrics.finished(GenerationStats(), "cancelled", None, prompt_tokens=10)
    samples = scrape(registry)
    assert value(samples, "vllm:num_requests_running") == 0 and value(samples, "vllm:num_requests_waiting") == 0
    assert value(samples, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(samples, "vllm:request_success_total", finished_reason="abort") == 1  # the client left
    assert value(samples, "vllm:prompt_tokens_total") == 50 and value(samples, "vllm:generation_tokens_total") == 5
    assert value(samples, "vllm:prefix_cache_queries_total") == 50
    assert value(samples, "vllm:prefix_cache_hits_total") == 16
    assert value(samples, "vllm:num_preemptions_total") == 1
    assert value(samples, "vllm:e2e_request_latency_seconds_count") == 2
    assert value(samples, "vllm:e2e_request_latency_seconds_sum") == 2.0
    assert value(samples, "vllm:request_queue_time_seconds_sum") == 0.75
    assert value(samples, "vllm:request_queue_time_seconds_bucket", le="0.5") == 1  # the other waited not at all
    assert value(samples, "vllm:request_prompt_tokens_bucket", le="50.0") == 2
    assert value(samples, "vllm:request_prompt_tokens_bucket", le="20.0") == 1


def test_the_model_is_named_once_known_and_token_buckets_are_vllm_s():
    registry = CollectorRegistry()
    name = [""]
    CoordinatorMetrics(registry, served_model=lambda: name[0])
    assert ("vllm:num_requests_waiting", (("model_name", ""),)) in scrape(registry)  # no target has answered yet
    name[0] = "smollm2"
    assert ("vllm:num_requests_waiting", (("model_name", "smollm2"),)) in scrape(registry)
    assert token_buckets(1000) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000)
    assert token_buckets(4096)[-1] == 2000
