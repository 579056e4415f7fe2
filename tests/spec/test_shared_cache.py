"""The shared continuation cache against a real redis-server: sharing, failures, bounds, bad data, URLs.

Each test gets its own redis-server (tests/spec/conftest.py) and kills,
freezes or restarts it as the scenario needs; nothing here is mocked but
the clock of the breaker's unit test.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import pytest
import redis

from tandem.errors import InvalidRequestError
from tandem.spec.continuations import pack_tokens
from tandem.spec.shared_cache import (
    CLOSED,
    HALF_OPEN,
    OPEN,
    REDIS_BYTES_PER_KEY,
    CircuitBreaker,
    SharedContinuations,
    encode_member,
    parse_redis_url,
)
from tests.redis_server import RedisServer, find_redis_server, free_port

SEQ = list(range(1000, 1040))  # what one coordinator's request generated
OTHER = list(range(5000, 5040))


def make(url: str | None, namespace: str = "fingerprint-a", **kwargs) -> SharedContinuations:
    """A cache with test-friendly timings; ``environ={}`` so the runner's own env never leaks in.

    Reads and writes get 2 s, not the 50 / 200 ms a coordinator uses: on a loaded 2-core machine a
    read or the flush can take longer, and a test of sharing once saw that (correct) timeout as a
    miss. Tests of timeouts pass their own."""
    kwargs = {"flush_interval_s": 0.01, "breaker_open_s": 0.2, "environ": {}, "call_timeout_s": 2.0,
              "write_timeout_s": 2.0, **kwargs}
    return SharedContinuations(namespace, url, **kwargs)


async def until(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def sync_client(server: RedisServer) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=server.port, password=server.password)


# ----- sharing ------------------------------------------------------------------
def test_what_one_coordinator_learned_the_other_finds_after_the_flush(redis_server):
    async def scenario() -> None:
        a, b = make(redis_server.url), make(redis_server.url)
        await a.start()
        await b.start()
        try:
            a.learn(SEQ, final=True)
            assert await a.lookup([7, 7, *SEQ[:8]], 4) is not None  # a knows it locally at once
            assert a.metrics.redis_lookups == 0  # a long local match: no round trip
            await a.flush()
            hit = await b.lookup([7, 7, *SEQ[:8]], 4)
            assert hit is not None and hit.source == "shared"
            assert (hit.tokens, hit.match_len, hit.count) == (SEQ[8:12], 8, 1)
            # the shared run is kept locally: the request's next round continues without Redis
            lookups = b.metrics.redis_lookups
            nxt = await b.lookup(SEQ[:12], 4)
            assert nxt is not None and nxt.tokens == SEQ[12:16] and nxt.source == "local"
            assert b.metrics.redis_lookups == lookups
            assert (b.metrics.shared_hits, b.metrics.local_hits, b.metrics.redis_errors) == (1, 1, 0)
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_counts_from_every_coordinator_add_up_and_the_most_frequent_run_wins(redis_server):
    async def scenario() -> None:
        caches = [make(redis_server.url) for _ in range(3)]
        reader = make(redis_server.url)
        for c in [*caches, reader]:
            await c.start()
        try:
            for c in caches:
                c.learn([1, 2, 3, 40, 41, 42], final=True)
                await c.flush()
            caches[0].learn([1, 2, 3, 50, 51, 52], final=True)
            await caches[0].flush()
            hit = await reader.lookup([1, 2, 3], 3)
            assert (hit.tokens, hit.match_len, hit.count, hit.source) == ([40, 41, 42], 3, 3, "shared")
        finally:
            for c in [*caches, reader]:
                await c.close()

    asyncio.run(scenario())


def test_a_shared_hit_carries_the_contexts_runs_and_the_local_tier_keeps_them_all(redis_server):
    async def scenario() -> None:
        writer, reader = make(redis_server.url), make(redis_server.url)
        await writer.start()
        await reader.start()
        try:
            for _ in range(2):
                writer.learn([1, 2, 3, 40, 41, 42], final=True)
            writer.learn([1, 2, 3, 50, 51, 52], final=True)
            await writer.flush()
            hit = await reader.lookup([1, 2, 3], 3)
            assert hit.source == "shared" and hit.runs == ((40, 41, 42), (50, 51, 52))
            local = reader.local.lookup([1, 2, 3], 3)  # the next rounds: the local tier knows both
            assert local.tokens == [40, 41, 42] and local.runs == hit.runs
            assert reader.local.lookup([1, 2, 3, 50], 2).tokens == [51, 52]  # and what follows inside each run
        finally:
            await writer.close()
            await reader.close()

    asyncio.run(scenario())


def test_namespaces_never_mix_on_one_redis(redis_server):
    async def scenario() -> None:
        a, b = make(redis_server.url, "tokenizer-a"), make(redis_server.url, "tokenizer-b")
        await a.start()
        await b.start()
        try:
            a.learn(SEQ, final=True)
            await a.flush()
            assert await b.lookup(SEQ[:8], 4) is None
            assert b.metrics.redis_lookups == 1 and b.metrics.undecodable_entries == 0
            keys = sync_client(redis_server).keys("*")
            assert keys and all(key.startswith(a.prefix) for key in keys) and a.prefix != b.prefix
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


# ----- Redis trouble ------------------------------------------------------------------
def test_killed_redis_leaves_the_local_tier_answering_and_recovers_after_restart(redis_server):
    async def scenario() -> None:
        a, b = make(redis_server.url), make(redis_server.url, breaker_failures=3)
        await a.start()
        await b.start()
        try:
            a.learn(SEQ, final=True)
            await a.flush()
            b.learn(OTHER, final=True)  # b's own text, in its local tier
            await b.flush()
            assert (await b.lookup(SEQ[:8], 4)).source == "shared"

            redis_server.stop()  # a crash, mid-use
            for i in range(6):  # contexts b does not know locally: each would need Redis
                started = time.perf_counter()
                assert await b.lookup([9, 9, 9, i], 4) is None
                assert time.perf_counter() - started < 0.5
            local = await b.lookup(OTHER[:8], 4)
            assert local is not None and local.tokens == OTHER[8:12] and local.source == "local"
            assert b.metrics.redis_errors >= 3 and b.breaker.opened >= 1  # (a probe may have failed too)
            assert b.breaker.state in (OPEN, HALF_OPEN) and b.metrics.redis_skipped >= 3
            dropped = b.metrics.writes_dropped
            b.learn(list(range(7000, 7040)), final=True)  # while Redis is away: dropped, not queued
            assert b.metrics.writes_dropped > dropped and b.pending_writes == 0

            redis_server.start()  # same port, empty (nothing was persisted)
            await until(lambda: b.breaker.state == CLOSED)  # the background probe closed it
            fresh = list(range(9000, 9040))
            a.learn(fresh, final=True)
            await a.flush()
            hit = await b.lookup(fresh[:8], 4)
            assert hit is not None and hit.source == "shared" and hit.tokens == fresh[8:12]
        finally:
            await a.close()
            await b.close()

    asyncio.run(scenario())


def test_a_frozen_redis_costs_a_lookup_at_most_its_timeout_and_opens_the_breaker(redis_server):
    async def scenario() -> None:
        c = make(redis_server.url, call_timeout_s=0.05, breaker_failures=3, breaker_open_s=60)
        await c.start()
        redis_server.process.send_signal(signal.SIGSTOP)  # hung, not gone: connections just stall
        try:
            for i in range(5):
                started = time.perf_counter()
                assert await c.lookup([9, 9, 9, i], 4) is None
                assert time.perf_counter() - started < 0.3  # 50 ms timeout, generous for shared CPUs
            assert c.metrics.redis_errors == 3 and c.breaker.state == OPEN
            assert c.metrics.redis_lookups == 3 and c.metrics.redis_skipped == 2
        finally:
            redis_server.process.send_signal(signal.SIGCONT)
            await c.close()

    asyncio.run(scenario())


def test_unreachable_redis_at_start_warns_runs_local_and_connects_later(tmp_path, caplog):
    binary = find_redis_server()
    if binary is None:
        pytest.skip("redis-server not installed (apt-get install redis-server; CI installs it)")
    server = RedisServer(binary, free_port(), tmp_path)

    async def scenario() -> None:
        c = make(server.url, connect_timeout_s=0.3)
        with caplog.at_level(logging.WARNING, logger="tandem.spec.shared_cache"):
            await c.start()  # must not raise
        try:
            assert "unreachable" in caplog.text and c.breaker.state == OPEN
            c.learn(SEQ, final=True)
            assert (await c.lookup(SEQ[:8], 4)).source == "local"
            assert c.metrics.writes_dropped > 0 and c.pending_writes == 0
            server.start()
            await until(lambda: c.breaker.state == CLOSED)
            c.learn(OTHER, final=True)
            await c.flush()
            other = make(server.url)
            await other.start()
            try:
                assert (await other.lookup(OTHER[:8], 4)).source == "shared"
            finally:
                await other.close()
        finally:
            await c.close()
            server.stop()

    asyncio.run(scenario())


def test_writes_never_queue_without_bound():
    c = make("redis://127.0.0.1:1/0", max_pending=100)  # never started: nothing drains the queue
    c.learn(SEQ, final=True)
    assert c.pending_writes == 100 and c.metrics.writes_queued == 100
    assert c.metrics.writes_dropped == c.local.stats.learned - 100


def test_local_only_without_a_url():
    async def scenario() -> None:
        c = make(None)
        await c.start()
        c.learn(SEQ, final=True)
        hit = await c.lookup(SEQ[:4], 4)
        assert hit is not None and hit.source == "local" and c.pending_writes == 0
        assert await c.lookup([1, 2, 3], 4) is None
        snap = c.snapshot()
        assert snap["local_hits"] == 1 and snap["misses"] == 1 and snap["lookup_p50_s"] is not None
        await c.close()

    asyncio.run(scenario())


def test_breaker_opens_after_consecutive_failures_and_half_opens_for_one_probe():
    now = [0.0]
    breaker = CircuitBreaker(failures=3, open_s=10.0, clock=lambda: now[0])
    assert not breaker.record_failure() and not breaker.record_failure()
    breaker.record_success()  # consecutive: a success in between resets
    assert [breaker.record_failure() for _ in range(3)] == [False, False, True]
    assert breaker.state == OPEN and not breaker.allows_calls and not breaker.probe_due()
    now[0] = 10.0
    assert breaker.probe_due() and breaker.state == HALF_OPEN and not breaker.allows_calls
    assert breaker.record_failure() and breaker.state == OPEN  # a failed probe re-opens at once
    now[0] = 20.0
    assert breaker.probe_due() and breaker.record_success() and breaker.allows_calls
    assert breaker.opened == 2


# ----- bad data -----------------------------------------------------------------------
def test_undecodable_entries_are_ignored_counted_and_never_proposed(redis_server):
    context = list(range(100, 108))
    good, other_good = pack_tokens([300, 301, 302, 303]), pack_tokens([310, 311])
    c = make(redis_server.url, vocab_size=5000)
    ctx7 = pack_tokens(context[1:])
    r = sync_client(redis_server)
    r.set(c.context_prefix + pack_tokens(context), b"not a sorted set")  # the 8-token key: WRONGTYPE
    r.zadd(c.context_prefix + ctx7, {
        b"garbage": 50,
        b"\x02" + good + encode_member(ctx7, good)[-4:]: 49,  # another format version
        encode_member(ctx7, good)[:-4] + b"\0\0\0\0": 48,  # bad checksum
        encode_member(pack_tokens(context[:7]), good): 47,  # a run stored under another context
        encode_member(ctx7, pack_tokens([300, 6000])): 46,  # an id outside the vocabulary
        b"\x01" + good[:4] + b"\0\0\0\0": 45,  # not a whole number of ids
        encode_member(ctx7, other_good): 0.5,  # a score that is no count
        encode_member(ctx7, good): 2,  # the only valid entry
    })
    only_garbage = list(range(200, 208))
    r.zadd(c.context_prefix + pack_tokens(only_garbage[-2:]), {b"\xff" * 20: 9, b"": 3})

    async def scenario() -> None:
        await c.start()
        try:
            hit = await c.lookup(context, 4)
            assert (hit.tokens, hit.match_len, hit.count, hit.source) == ([300, 301, 302, 303], 7, 2, "shared")
            assert c.metrics.undecodable_entries == 8 and c.metrics.redis_errors == 0
            assert await c.lookup(only_garbage, 4) is None
            assert c.metrics.undecodable_entries == 10 and c.breaker.state == CLOSED
        finally:
            await c.close()

    asyncio.run(scenario())


def test_a_key_of_another_type_refuses_writes_without_failing_the_batch(redis_server):
    c = make(redis_server.url, shared_orders=[2])
    sync_client(redis_server).set(c.context_prefix + pack_tokens([1, 2]), b"someone else's")

    async def scenario() -> None:
        await c.start()
        try:
            c.learn([1, 2, 3, 4, 5, 6], final=True)
            await c.flush()
            assert c.metrics.undecodable_entries == 1 and c.metrics.redis_errors == 0
            assert c.metrics.writes_sent == c.metrics.writes_queued == 4
            reader = make(redis_server.url, shared_orders=[2])
            await reader.start()
            try:
                assert (await reader.lookup([9, 3, 4], 2)).tokens == [5, 6]  # the rest of the batch landed
            finally:
                await reader.close()
        finally:
            await c.close()

    asyncio.run(scenario())


def test_the_longer_match_wins_between_the_tiers(redis_server):
    async def scenario() -> None:
        writer, reader = make(redis_server.url), make(redis_server.url, enough_match=8, enough_count=100)
        await writer.start()
        await reader.start()
        try:
            writer.learn([1, 2, 3, 4, 5, 6, 7, 8, 50, 51, 52, 53], final=True)  # shared: 8-token context
            await writer.flush()
            reader.learn([70, 6, 7, 8, 60, 61, 62, 63], final=True)  # local: only "6 7 8" (n = 4 at most)
            hit = await reader.lookup([1, 2, 3, 4, 5, 6, 7, 8], 4)
            assert (hit.tokens, hit.match_len, hit.source) == ([50, 51, 52, 53], 8, "shared")
            # the local tier knows a 4-token context the shared tier lacks: local wins
            hit = await reader.lookup([70, 6, 7, 8], 2)
            assert (hit.tokens, hit.match_len, hit.source) == ([60, 61], 4, "local")
        finally:
            await writer.close()
            await reader.close()

    asyncio.run(scenario())


# ----- bounds in Redis ------------------------------------------------------------------
def test_redis_keys_are_capped_per_context_expire_and_are_trimmed_to_max_keys(redis_server):
    r = sync_client(redis_server)

    async def scenario() -> None:
        c = make(redis_server.url, shared_runs=3, ttl_s=60, max_keys=300, shared_orders=[2])
        await c.start()
        try:
            for _ in range(4):
                c.learn([1, 2, 40, 41], final=True)
            for t in range(20):  # many other runs after the same context
                c.learn([1, 2, 60 + t, 0], final=True)
            await c.flush()
            key = c.context_prefix + pack_tokens([1, 2])
            members = r.zrevrange(key, 0, -1, withscores=True)
            assert len(members) == 3 and members[0] == (encode_member(pack_tokens([1, 2]), pack_tokens([40, 41])), 4.0)
            assert 0 < r.pttl(key) <= 60_000 and 0 < r.pttl(c.index_key) <= 60_000

            for i in range(10):  # ~5000 distinct contexts, far over max_keys
                c.learn([(i * 7919 + j * 104729) % 100_000 for j in range(500)], final=True)
                await c.flush()
                assert r.zcard(c.index_key) <= 300
            assert c.metrics.keys_trimmed > 4000
            assert r.dbsize() <= 301  # the context keys plus the index, nothing orphaned
        finally:
            await c.close()

    asyncio.run(scenario())


def test_a_full_key_uses_at_most_the_stated_redis_bytes(redis_server):
    r = sync_client(redis_server)
    n_keys = 300
    # One flush of 2,400 runs (5 batches). Keys went missing here twice (236, then 256 of 300): the background
    # writer's last batch was cancelled by close() while on the wire (see the test above). A slow machine may
    # still take over make()'s 2 s for a batch, and a timed-out write is dropped by design: not a test of that.
    c = make(redis_server.url, max_keys=10 * n_keys, write_timeout_s=60.0)

    async def scenario() -> None:
        await c.start()
        try:
            for i in range(n_keys):  # every context with shared_runs distinct 16-token runs
                context = pack_tokens([(i * 8 + j) % 150_000 + 1000 for j in range(8)])
                for run in range(c.shared_runs):
                    c._pending.append((context, pack_tokens([150_000 + run * 16 + t + i for t in range(16)])))
            await c.flush()
        finally:
            await c.close()

    asyncio.run(scenario())
    keys = [k for k in r.keys("*") if k != c.index_key]
    assert len(keys) == n_keys and all(r.zcard(k) == c.shared_runs == 8 for k in keys)
    per_key = (sum(r.memory_usage(k) for k in keys) + r.memory_usage(c.index_key, samples=0)) / n_keys
    assert per_key <= REDIS_BYTES_PER_KEY, per_key


def test_close_waits_for_the_batch_the_background_writer_has_on_the_wire(redis_server):
    """Regression: close() cancelled the writer while its last batch was in flight, and the rows were lost
    (a flush of 300 keys then a close left 256 in CI: the last partial batch)."""
    r = sync_client(redis_server)
    c = make(redis_server.url, write_timeout_s=60.0)
    n_keys = 40  # one batch: the background writer takes all of it at once

    async def scenario() -> None:
        await c.start()
        for i in range(n_keys):
            context = pack_tokens([(i * 8 + j) % 150_000 + 2000 for j in range(8)])
            c._pending.append((context, pack_tokens([150_000 + t + i for t in range(16)])))
        c._wake.set()
        while c._pending:  # the writer has popped the batch: it is on the wire now
            await asyncio.sleep(0)
        await c.close()

    asyncio.run(scenario())
    assert len([k for k in r.keys("*") if k != c.index_key]) == n_keys


# ----- URLs and passwords ---------------------------------------------------------------------
@pytest.mark.parametrize("url, reason", [
    ("", "empty"),
    ("localhost:6379", "no scheme"),
    ("http://localhost:6379", "scheme 'http'"),
    ("unix:///tmp/redis.sock", "scheme 'unix'"),
    ("redis://", "no host"),
    ("redis://localhost:abc", "bad port 'abc'"),
    ("redis://localhost:0", "bad port '0'"),
    ("redis://localhost:70000", "bad port '70000'"),
    ("redis://localhost:", "bad port ''"),
    ("redis://localhost/x", "bad database 'x'"),
    ("redis://localhost/0/1", "bad database '0/1'"),
    ("redis://local host", "whitespace"),
    ("redis://localhost#frag", "fragment"),
    ("redis://localhost?foo=1", "unsupported parameter(s) foo"),
    ("redis://localhost?ssl_cert_reqs=none", "need rediss://"),
    ("rediss://localhost?ssl_cert_reqs=maybe", "ssl_cert_reqs must be"),
    ("redis://[::1]x:6379", "IPv6"),
    ("redis://[::1:6379", "malformed"),
])
def test_malformed_urls_are_refused_naming_the_reason(url, reason):
    with pytest.raises(InvalidRequestError, match="redis URL") as err:
        parse_redis_url(url, environ={})
    assert reason in str(err.value)


def test_urls_parse_into_settings():
    s = parse_redis_url("redis://cache.internal", environ={})
    assert (s.host, s.port, s.db, s.password, s.tls) == ("cache.internal", 6379, 0, None, False)
    s = parse_redis_url("rediss://app:p%40ss@cache:6380/3?ssl_cert_reqs=none&ssl_ca_certs=/ca.pem", environ={})
    assert (s.host, s.port, s.db, s.username, s.password, s.tls) == ("cache", 6380, 3, "app", "p@ss", True)
    assert (s.ssl_cert_reqs, s.ssl_ca_certs) == ("none", "/ca.pem")
    kwargs = s.client_kwargs()
    assert kwargs["ssl"] is True and kwargs["ssl_cert_reqs"] == "none" and kwargs["ssl_check_hostname"] is False
    assert "p@ss" not in repr(s) and s.redacted_url() == "rediss://app:***@cache:6380/3"
    s = parse_redis_url("rediss://cache", environ={})
    assert s.tls and s.client_kwargs()["ssl_cert_reqs"] == "required" and s.client_kwargs()["ssl_check_hostname"]
    assert "ssl" not in parse_redis_url("redis://cache", environ={}).client_kwargs()
    s = parse_redis_url("redis://[::1]:7000/2", environ={})
    assert (s.host, s.port, s.db) == ("::1", 7000, 2) and s.redacted_url() == "redis://[::1]:7000/2"


def test_password_from_the_environment_unless_the_url_has_one(monkeypatch):
    env = {"TANDEM_REDIS_PASSWORD": "from-env", "OTHER": "other"}
    assert parse_redis_url("redis://h", environ=env).password == "from-env"
    assert parse_redis_url("redis://:in-url@h", environ=env).password == "in-url"
    assert parse_redis_url("redis://h", password_env="OTHER", environ=env).password == "other"
    assert parse_redis_url("redis://h", environ={}).password is None
    monkeypatch.setenv("TANDEM_REDIS_PASSWORD", "real-env")  # read at call time, not at import
    assert parse_redis_url("redis://h").password == "real-env"
    with pytest.raises(InvalidRequestError, match="bad port"):
        SharedContinuations("ns", "redis://h:x")  # the constructor validates too


def test_password_protected_redis_with_the_password_from_env(redis_server_with_password, caplog):
    server = redis_server_with_password

    async def scenario() -> None:
        good = make(server.url, environ={"TANDEM_REDIS_PASSWORD": "s3cret"})
        wrong = make(server.url, environ={"TANDEM_REDIS_PASSWORD": "nope"})
        await good.start()
        with caplog.at_level(logging.WARNING, logger="tandem.spec.shared_cache"):
            await wrong.start()  # refused by Redis: a warning, not an exception
        try:
            assert good.breaker.state == CLOSED and wrong.breaker.state == OPEN
            assert "unreachable" in caplog.text and "s3cret" not in caplog.text and "nope" not in caplog.text
            good.learn(SEQ, final=True)
            await good.flush()
            assert good.metrics.writes_sent > 0 and good.metrics.redis_errors == 0
            reader = make(server.url, environ={"TANDEM_REDIS_PASSWORD": "s3cret"})
            await reader.start()
            try:
                assert (await reader.lookup(SEQ[:8], 4)).source == "shared"
            finally:
                await reader.close()
            assert await wrong.lookup(SEQ[:8], 4) is None
        finally:
            await good.close()
            await wrong.close()

    asyncio.run(scenario())
