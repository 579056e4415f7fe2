"""Two coordinators share one continuation cache through a real redis-server; Redis trouble loses nothing.

The session's shared SmolLM2 workers (tests/integration/conftest.py) serve two coordinator processes
of this module's own, each started with ``--redis-url`` pointing at a redis-server this module
starts on a free loopback port. Requests use ``method=ngram`` (no draft model), so every
speculative token comes from the request's own text or from the cache.
"""

from __future__ import annotations

import re
import time
import urllib.request

import pytest

from tandem.client import TandemClient, build_request
from tandem.spec.adaptive import AcceptanceTracker
from tests.integration.conftest import extra_coordinator
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
def system(shared_cluster, redis):
    """(the first coordinator, the second, a client of each): both share the Redis continuation cache."""
    shared = ("--host", "127.0.0.1", "--redis-url", redis.url)
    with extra_coordinator(shared_cluster, shared) as first, extra_coordinator(shared_cluster, shared) as second:
        with TandemClient(first.address, timeout_s=120) as one, TandemClient(second.address, timeout_s=120) as two:
            yield first, second, one, two


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
    coordinator, second, one, two = system
    first = generate(one)
    wait_for(lambda: cache_metric(coordinator, "cache_writes_sent") > 0)  # flushed to Redis
    time.sleep(0.3)
    again = generate(two)
    assert list(again.token_ids) == list(first.token_ids)  # greedy: the cache never changes the output
    assert again.stats.accepted > first.stats.accepted  # ...only how much of it was guessed right
    assert cache_metric(second, 'cache_lookup_results_total{tier="shared"') > 0


def test_killing_redis_mid_stream_loses_no_token_and_a_restart_shares_again(system, redis):
    coordinator, second, one, two = system
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
    wait_for(lambda: cache_metric(coordinator, "cache_redis_errors") > 0)

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


def match_rates(service) -> dict[tuple[str, int, str], float]:
    """The coordinator's exported acceptance per kind of match: (source, band, sampled) -> rate."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{service.metrics_port}/metrics", timeout=5).read().decode()
    rates = {}
    for m in re.finditer(r"^tandem_coordinator_match_acceptance\{(?P<labels>[^}]*)\} (?P<rate>\S+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m["labels"]))
        rates[(labels["source"], int(labels["match_band"]), labels["sampled"])] = float(m["rate"])
    return rates


def test_the_acceptance_of_each_kind_of_match_is_exported(shared_cluster):
    """What the coordinator learned per kind of match reaches its metrics: a new coordinator exports no kind;
    one greedy n-gram request exports the kinds it met; the same request again, whose continuation-cache
    matches replay the first answer (always right under greedy), raises a cache kind's rate."""
    request = build_request("Count from one to twenty in words, separated by commas.", chat=True,
                            max_new_tokens=TOKENS, method="ngram", ignore_eos=True)  # adaptive k
    with extra_coordinator(shared_cluster, ("--host", "127.0.0.1")) as coordinator, \
            TandemClient(coordinator.address, timeout_s=120) as client:
        assert match_rates(coordinator) == {}  # a new coordinator has learned nothing
        first = client.generate(request)
        assert first.stats.generated_tokens == TOKENS
        learned = match_rates(coordinator)
        assert learned, "no kind of match was learned from a greedy n-gram request"
        assert {source for source, *_ in learned} <= {"ngram", "cache"}
        assert {sampled for *_, sampled in learned} == {"false"}
        again = client.generate(request)
        assert list(again.token_ids) == list(first.token_ids)
        rates = match_rates(coordinator)
        assert any(rate > learned.get(kind, AcceptanceTracker().rate)
                   for kind, rate in rates.items() if kind[0] == "cache"), (learned, rates)
