"""Two coordinators share one continuation cache through a real redis-server; Redis trouble loses nothing.

One target worker (SmolLM2) serves two coordinator processes, each started
with ``--redis-url`` pointing at a redis-server this module starts on a free
loopback port. Requests use ``method=ngram`` (no draft model), so every
speculative token comes from the request's own text or from the cache.
"""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from tandem.client import TandemClient, build_request
from tandem.cluster import ClusterSpec, LocalCluster
from tests.redis_server import RedisServer, find_redis_server, free_port

pytestmark = pytest.mark.slow

# A prompt whose answer does not copy the prompt: prompt lookup alone finds little to propose.
PROMPT = "Write a short poem about the sea, in four lines."
TOKENS = 48


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    binary = find_redis_server()
    if binary is None:
        pytest.skip("redis-server not installed (apt-get install redis-server; CI installs it)")
    server = RedisServer(binary, free_port(), tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def system(smollm2_dir, redis, tmp_path_factory):
    spec = ClusterSpec(target=str(smollm2_dir), draft=None, dtype="bfloat16", kv_cache_tokens=8192,
                       log_dir=tmp_path_factory.mktemp("logs"), coordinator_args=("--redis-url", redis.url))
    with LocalCluster(spec) as cluster:
        second = cluster.add_coordinator(extra_args=("--redis-url", redis.url))
        with TandemClient(cluster.coordinator.address, timeout_s=120) as one, \
                TandemClient(second.address, timeout_s=120) as two:
            yield cluster, second, one, two


def generate(client, prompt=PROMPT, n=TOKENS):
    return client.generate(build_request(prompt, chat=True, max_new_tokens=n, method="ngram", fixed_k=True,
                                         ignore_eos=True))


def cache_metric(service, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=5).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^tandem_coordinator_{name}\S* (\S+)$", text, re.M))


def wait_for(condition, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_what_one_coordinator_generated_speeds_up_the_other(system):
    cluster, second, one, two = system
    first = generate(one)
    wait_for(lambda: cache_metric(cluster.coordinator, "cache_writes_sent") > 0)  # flushed to Redis
    time.sleep(0.3)
    again = generate(two)
    assert list(again.token_ids) == list(first.token_ids)  # greedy: the cache never changes the output
    assert again.stats.accepted > first.stats.accepted  # ...only how much of it was guessed right
    assert cache_metric(second, 'cache_lookup_results_total{tier="shared"') > 0


def test_killing_redis_mid_stream_loses_no_token_and_a_restart_shares_again(system, redis):
    cluster, second, one, two = system
    prompt = "List ten animals, one per line."
    reference = list(generate(one, prompt, 64).token_ids)
    stream = one.stream(build_request(prompt, chat=True, max_new_tokens=64, method="ngram", fixed_k=True,
                                      ignore_eos=True))
    tokens = list(next(stream).token_ids)
    redis.stop()  # SIGKILL mid-stream
    for chunk in stream:
        tokens.extend(chunk.token_ids)
    assert tokens == reference
    assert list(generate(two, prompt, 64).token_ids) == reference  # the other coordinator too, Redis still down
    wait_for(lambda: cache_metric(cluster.coordinator, "cache_redis_errors") > 0)

    redis.start()  # the same port, empty
    # The breaker closes after its probe succeeds; then what one coordinator learns, the other finds.
    # A new prompt each try: one the second coordinator has not learned locally already.
    novel = iter(f"Name {n} rivers in {place}." for n in ("five", "six", "seven", "eight", "nine")
                 for place in ("Europe", "Asia", "Africa"))

    def shared_again() -> bool:
        prompt = next(novel)
        before = cache_metric(second, 'cache_lookup_results_total{tier="shared"')
        generate(one, prompt, 32)
        time.sleep(0.3)
        generate(two, prompt, 32)
        return cache_metric(second, 'cache_lookup_results_total{tier="shared"') > before

    wait_for(shared_again, timeout_s=60)


def test_the_acceptance_of_each_kind_of_match_is_exported(system):
    cluster, _, one, _ = system
    reply = one.generate(build_request("Count from one to twenty in words, separated by commas.", chat=True,
                                       max_new_tokens=TOKENS, method="ngram", ignore_eos=True))  # adaptive k
    assert reply.stats.generated_tokens == TOKENS
    text = urllib.request.urlopen(f"http://127.0.0.1:{cluster.coordinator.metrics_port}/metrics",
                                  timeout=5).read().decode()
    kinds = []
    for m in re.finditer(r"^tandem_coordinator_match_acceptance\{(?P<labels>[^}]*)\} (?P<rate>\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
        kinds.append((labels["source"], int(labels["match_band"]), labels["sampled"], float(m["rate"])))
    assert kinds, "no kind of match was learned from a greedy n-gram request"
    assert {source for source, *_ in kinds} <= {"ngram", "cache"}
    assert {sampled for *_, sampled, _ in kinds} == {"false"}
    assert all(0.0 < rate < 1.0 for *_, rate in kinds)
