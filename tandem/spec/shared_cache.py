"""The shared tier of the continuation cache: Redis behind a local tier, shared by every coordinator.

Reads. ``lookup`` asks the local tier (``tandem.spec.continuations``) first;
only when that has no long or frequent answer does it make ONE round trip:
a Lua script (``READ_SCRIPT``) over the candidate context keys, longest
first, returning the runs of the first key that holds a well-formed one (a
pipeline of one ``ZREVRANGE`` per key costs four times the CPU and latency).
A shared answer that beats the local one is also stored locally, so the
request's next rounds need not ask again.

Writes. ``learn`` updates the local tier at once and queues the new
(context, run) observations; a background task sends them in batches of
``batch_items`` (identical observations merged), each batch ONE call of a Lua
script (``WRITE_SCRIPT``), off the requests' path.

Keys (``<ns>`` = first 16 hex digits of sha256 of the namespace, i.e. of the
tokenizer fingerprint, so models never mix; ``v1`` = key format version)::

    tandem:v1:<ns>:c:<context>  sorted set: member = run, score = count
                                  <context>: the context's ids, 3 bytes each
                                  member: b"\x01" + run ids (3 bytes each) + crc32(context + run)
    tandem:v1:<ns>:keys         sorted set (the index): every context key, scored by its creation (ms)

A member that does not decode (another format byte, a bad length or
checksum, an id outside the vocabulary, a score that is no positive count,
a key of another type) is skipped and counted, never proposed.

Bounds in Redis, per namespace, whatever ``maxmemory`` says: every context
key holds at most ``shared_runs`` members (the least frequent trimmed on
write) and expires ``ttl_s`` after its last write (so unused contexts
vanish); the index holds every live context key and is trimmed to
``TRIM_TO * max_keys`` (oldest created first, each key deleted with its
entry) whenever a flush finds it above ``max_keys``. So live context keys
<= ``max_keys`` + one batch per concurrently flushing coordinator. With
16-token runs a member is 53 bytes, under Redis's 64-byte listpack limit,
and a full key costs at most ``REDIS_BYTES_PER_KEY`` bytes with its index
entry (``MEMORY USAGE``, checked in tests/spec/test_shared_cache.py): the
default 500,000 keys take at most ~0.4 GB.

Needs a standalone Redis (or a primary with replicas), not Redis Cluster:
the scripts touch keys across hash slots.

Failure policy: Redis trouble never fails a request and barely slows it.
Every call has a timeout (``call_timeout_s`` for reads, ``write_timeout_s``
for writes and probes); after ``breaker_failures`` consecutive errors a
circuit breaker opens for ``breaker_open_s`` (no Redis calls: local tier
only, queued writes dropped and counted); then the background task probes
with PING and closes the breaker when Redis answers. An unreachable Redis at
``start`` logs a warning and starts with the breaker open.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import time
import zlib
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from tandem.errors import InvalidRequestError
from tandem.spec.continuations import (
    SHARED,
    TOKEN_BYTES,
    CacheHit,
    LocalContinuations,
    best_continuation,
    continuation_items,
    learn_offset,
    pack_tokens,
    unpack_runs,
    unpack_tokens,
)

log = logging.getLogger(__name__)

KEY_VERSION = "v1"
MEMBER_FORMAT = b"\x01"
CRC_BYTES = 4
REDIS_BYTES_PER_KEY = 800  # MEMORY USAGE of a full key (shared_runs 16-token runs) plus its index entry: ~780
LATENCY_SAMPLES = 8192  # recent lookups kept for percentiles
TRIM_TO = 0.98  # trim the index below its cap, so one trim serves many flushes
TRIM_TIMEOUTS = 5  # a trim may take this many write timeouts
DEFAULT_PORT = 6379
URL_SCHEMES = ("redis", "rediss")
CERT_REQS = ("required", "optional", "none")

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

# A lookup in one call, longest context first: the first key holding a well-formed member
# (format byte, whole number of ids) answers with its ``ARGV[1]`` most frequent runs. One command
# and one reply instead of a pipeline of one per order: measured on loopback, a quarter of the
# coordinator's CPU and of the latency. pcall: a key of another type is skipped, not fatal.
# Returns {1-based key position or 0, flat member/score list, wrong-type keys, malformed members
# of skipped keys}; the client still checks each member's checksum, ids and score.
READ_SCRIPT = """
local last = tonumber(ARGV[1]) - 1
local wrong, malformed = 0, 0
for i = 1, #KEYS do
  local reply = redis.pcall('ZREVRANGE', KEYS[i], 0, last, 'WITHSCORES')
  if type(reply) == 'table' and reply.err then
    wrong = wrong + 1
  elseif #reply > 0 then
    for j = 1, #reply, 2 do
      local m = reply[j]
      if #m >= 8 and string.byte(m, 1) == 1 and (#m - 5) % 3 == 0 then
        return {i, reply, wrong, malformed}
      end
    end
    malformed = malformed + #reply / 2
  end
end
return {0, {}, wrong, malformed}
"""

# A batch of writes in one call: one command to pack and one reply to parse instead of three per
# observation (redis-py spends ~35 us of the coordinator's CPU on each command of a pipeline).
# KEYS[1] = the index, KEYS[2..] = context keys; ARGV = ttl_ms, runs kept, now_ms, then a
# (member, count) pair per context key. Returns {index size, observations refused}.
# - pcall: a key someone else turned into another type is skipped (and counted), not fatal;
# - only a run new to its key can push the key over its cap or mean the key is new (ZINCRBY
#   returned the increment), so the common case (a known run) costs two calls;
# - the index holds each key from its creation: keys leave it only with trimming (which
#   deletes them) and expired ones linger until trimmed, so no live key is ever outside it.
WRITE_SCRIPT = """
local ttl, keep, now = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local refused = 0
for i = 2, #KEYS do
  local key, count = KEYS[i], ARGV[2 * i + 1]
  local score = redis.pcall('ZINCRBY', key, count, ARGV[2 * i])
  if type(score) == 'table' and score.err then
    refused = refused + 1
  else
    if tonumber(score) == tonumber(count) then
      local size = redis.call('ZCARD', key)
      if size > keep then redis.call('ZREMRANGEBYRANK', key, 0, size - keep - 1) end
      if size == 1 then redis.call('ZADD', KEYS[1], now, key) end
    end
    redis.call('PEXPIRE', key, ttl)
  end
end
redis.call('PEXPIRE', KEYS[1], ttl)
return {redis.call('ZCARD', KEYS[1]), refused}
"""

# Delete the ARGV[1] oldest keys of the index KEYS[1] and their index entries, atomically (so a
# key re-created meanwhile by another coordinator never ends up alive but unindexed).
TRIM_SCRIPT = """
local victims = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[1]) - 1)
for _, key in ipairs(victims) do redis.call('DEL', key) end
if #victims > 0 then redis.call('ZREM', KEYS[1], unpack(victims)) end
return #victims
"""
TRIM_CHUNK = 1000  # keys per trim call: bounds how long one call blocks Redis


# ----- the URL --------------------------------------------------------------
@dataclass(slots=True, frozen=True)
class RedisSettings:
    """Where Redis is and how to reach it, from ``parse_redis_url``."""

    host: str
    port: int = DEFAULT_PORT
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)  # never in logs or reprs
    tls: bool = False
    ssl_ca_certs: str | None = None
    ssl_cert_reqs: str = "required"

    def redacted_url(self) -> str:
        """The URL for logs: the password, if any, as ``***``."""
        auth = ""
        if self.username or self.password:
            auth = f"{self.username or ''}{':***' if self.password else ''}@"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'rediss' if self.tls else 'redis'}://{auth}{host}:{self.port}/{self.db}"

    def client_kwargs(self) -> dict[str, Any]:
        """Connection arguments for ``redis.asyncio.Redis``."""
        kwargs: dict[str, Any] = dict(host=self.host, port=self.port, db=self.db, username=self.username,
                                      password=self.password)
        if self.tls:
            kwargs.update(ssl=True, ssl_cert_reqs=self.ssl_cert_reqs, ssl_ca_certs=self.ssl_ca_certs,
                          ssl_check_hostname=self.ssl_cert_reqs == "required")
        return kwargs


def _bad_url(reason: str) -> InvalidRequestError:
    return InvalidRequestError(f"redis URL: {reason}")


def parse_redis_url(url: str, *, password_env: str | None = "TANDEM_REDIS_PASSWORD",
                    environ: Mapping[str, str] | None = None) -> RedisSettings:
    """Validate ``redis://[user[:password]@]host[:port][/db]`` (``rediss://``: TLS) into settings.

    The password comes from the URL, else from the environment variable named
    ``password_env`` (read now, from ``environ`` or ``os.environ``). TLS
    options as query parameters: ``ssl_cert_reqs`` (required, optional, none)
    and ``ssl_ca_certs`` (a CA bundle path). Anything malformed raises
    ``InvalidRequestError`` naming what was wrong (never echoing a password).
    """
    if not isinstance(url, str) or not url.strip():
        raise _bad_url("empty; expected redis://host[:port][/db] or rediss://...")
    if url != url.strip() or any(c.isspace() for c in url):
        raise _bad_url("contains whitespace")
    scheme, sep, _ = url.partition("://")
    if not sep:
        raise _bad_url("no scheme; expected redis://host[:port][/db] or rediss://...")
    if scheme.lower() not in URL_SCHEMES:
        raise _bad_url(f"scheme {scheme[:20]!r} is not supported; use redis:// or rediss:// (TLS)")
    try:
        parts = urlsplit(url)
        host, username, password = parts.hostname, parts.username, parts.password
    except ValueError as exc:  # e.g. an unclosed IPv6 bracket
        raise _bad_url(f"malformed ({exc})") from None
    if parts.fragment:
        raise _bad_url("has a #fragment")
    if not host:
        raise _bad_url("no host")
    port = _url_port(parts.netloc)
    db = _url_db(parts.path)
    tls = scheme.lower() == "rediss"
    cert_reqs, ca_certs = _url_tls_options(parts.query, tls)
    username = unquote(username) if username else None
    password = unquote(password) if password else None
    if password is None and password_env:
        password = (os.environ if environ is None else environ).get(password_env) or None
    return RedisSettings(host, port, db, username, password, tls, ca_certs, cert_reqs)


def _url_port(netloc: str) -> int:
    hostport = netloc.rpartition("@")[2]
    if hostport.startswith("["):  # IPv6 literal: the port follows "]"
        _, _, rest = hostport.partition("]")
        text = rest[1:] if rest.startswith(":") else None
        if rest and text is None:
            raise _bad_url("garbage after the IPv6 address")
    else:
        _, colon, text = hostport.partition(":")
        text = text if colon else None
    if text is None:
        return DEFAULT_PORT
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise _bad_url(f"bad port {text[:20]!r} (expected a number in 1..65535)")
    return int(text)


def _url_db(path: str) -> int:
    text = path[1:] if path.startswith("/") else path
    if not text:
        return 0
    if not text.isdigit():
        raise _bad_url(f"bad database {text[:20]!r} in the path (expected /<number>)")
    return int(text)


def _url_tls_options(query: str, tls: bool) -> tuple[str, str | None]:
    try:
        params = parse_qs(query, keep_blank_values=True, strict_parsing=bool(query))
    except ValueError:
        raise _bad_url("malformed query string") from None
    unknown = sorted(set(params) - {"ssl_cert_reqs", "ssl_ca_certs"})
    if unknown:
        raise _bad_url(f"unsupported parameter(s) {', '.join(unknown)}")
    if params and not tls:
        raise _bad_url("ssl_* parameters need rediss:// (TLS)")
    cert_reqs = params.get("ssl_cert_reqs", ["required"])[-1].lower()
    if cert_reqs not in CERT_REQS:
        raise _bad_url(f"ssl_cert_reqs must be one of {', '.join(CERT_REQS)}")
    ca_certs = params.get("ssl_ca_certs", [None])[-1] or None
    return cert_reqs, ca_certs


# ----- keys and members -------------------------------------------------------
def namespace_id(namespace: str) -> str:
    """The namespace as it appears in keys: 16 hex digits of its sha256 (short keys, any text)."""
    return hashlib.sha256(namespace.encode()).hexdigest()[:16]


def encode_member(context: bytes, run: bytes) -> bytes:
    """A run as stored under ``context``: format byte, packed ids, crc32 binding it to its context."""
    return MEMBER_FORMAT + run + zlib.crc32(context + run).to_bytes(CRC_BYTES, "big")


def decode_member(context: bytes, member: Any, score: Any, vocab_size: int | None) -> tuple[bytes, int] | None:
    """(run, count) of a stored member, or None when it does not decode (see the module docstring)."""
    if not isinstance(member, bytes) or len(member) < 1 + TOKEN_BYTES + CRC_BYTES:
        return None
    run, crc = member[1:-CRC_BYTES], member[-CRC_BYTES:]
    if member[:1] != MEMBER_FORMAT or len(run) % TOKEN_BYTES:
        return None
    if zlib.crc32(context + run).to_bytes(CRC_BYTES, "big") != crc:
        return None
    if not isinstance(score, (int, float)) or not math.isfinite(score) or score < 1:
        return None
    if vocab_size is not None and max(unpack_tokens(run)) >= vocab_size:
        return None
    return run, int(score)


# ----- circuit breaker --------------------------------------------------------
class CircuitBreaker:
    """Closed: calls go through. Open (after ``failures`` consecutive errors): none for ``open_s``.

    Then half-open: the owner sends one probe; its success closes the breaker,
    its failure opens it again. ``clock`` is injectable for tests.
    """

    def __init__(self, failures: int = 5, open_s: float = 5.0, clock=time.monotonic) -> None:
        self.failures_to_open = max(1, failures)
        self.open_s = open_s
        self.clock = clock
        self.state = CLOSED
        self.consecutive_failures = 0
        self.opened = 0  # how many times it opened
        self._reopen_at = 0.0

    @property
    def allows_calls(self) -> bool:
        return self.state == CLOSED

    def probe_due(self) -> bool:
        """Whether an open breaker's wait is over; if so it turns half-open (the caller probes)."""
        if self.state == OPEN and self.clock() >= self._reopen_at:
            self.state = HALF_OPEN
            return True
        return False

    def record_success(self) -> bool:
        """Returns True when this success closed the breaker."""
        self.consecutive_failures = 0
        was_open, self.state = self.state != CLOSED, CLOSED
        return was_open

    def record_failure(self) -> bool:
        """Returns True when this failure opened the breaker."""
        self.consecutive_failures += 1
        if self.state == HALF_OPEN or (self.state == CLOSED and self.consecutive_failures >= self.failures_to_open):
            self.trip()
            return True
        return False

    def trip(self) -> None:
        """Open now (also used when Redis is unreachable at start)."""
        if self.state != OPEN:
            self.opened += 1
        self.state = OPEN
        self._reopen_at = self.clock() + self.open_s


# ----- metrics ------------------------------------------------------------------
@dataclass(slots=True)
class SharedCacheMetrics:
    """What the shared cache did; ``snapshot()`` for export (the coordinator's Prometheus)."""

    lookups: int = 0
    local_hits: int = 0
    shared_hits: int = 0
    misses: int = 0
    redis_lookups: int = 0  # round trips made by lookups
    redis_skipped: int = 0  # lookups that would have asked Redis but the breaker or the in-flight cap said no
    redis_errors: int = 0  # failed or timed-out Redis calls (reads, writes, probes)
    undecodable_entries: int = 0
    writes_queued: int = 0
    writes_sent: int = 0
    writes_dropped: int = 0  # observations not sent: breaker open, queue full, or their batch failed
    flushes: int = 0
    keys_trimmed: int = 0
    lookup_latency_s: deque = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))

    def latency_percentile(self, q: float) -> float | None:
        """The ``q``-th percentile (0..100) of recent lookup latencies in seconds, None before any."""
        samples = sorted(self.lookup_latency_s)
        if not samples:
            return None
        return samples[min(len(samples) - 1, max(0, math.ceil(q / 100 * len(samples)) - 1))]

    def snapshot(self) -> dict[str, Any]:
        """Counters and latency percentiles as a plain dict."""
        out = {name: getattr(self, name) for name in self.__slots__ if name != "lookup_latency_s"}
        out["lookup_p50_s"] = self.latency_percentile(50)
        out["lookup_p99_s"] = self.latency_percentile(99)
        return out


# ----- the shared tier ------------------------------------------------------------
class SharedContinuations:
    """The continuation cache a coordinator uses: its local tier plus, with ``url``, Redis shared by all.

    Call ``start()`` once inside the event loop and ``close()`` at shutdown;
    ``lookup`` and ``learn`` never raise because of Redis. ``url=None``: the
    local tier only (nothing is queued, no task runs).
    """

    def __init__(self, namespace: str, url: str | None, *, password_env: str = "TANDEM_REDIS_PASSWORD",
                 call_timeout_s: float = 0.05, write_timeout_s: float = 0.2, connect_timeout_s: float = 0.5,
                 min_n: int = 2, max_n: int = 8, max_continuation: int = 16, max_entries: int = 200_000,
                 shared_orders: Sequence[int] | None = None, shared_runs: int = 8,
                 ttl_s: float = 86_400.0, max_keys: int = 500_000,
                 enough_match: int | None = None, enough_count: int = 4,
                 flush_interval_s: float = 0.05, batch_items: int = 512, max_pending: int = 50_000,
                 breaker_failures: int = 5, breaker_open_s: float = 5.0, max_inflight: int = 32,
                 vocab_size: int | None = None, environ: Mapping[str, str] | None = None) -> None:
        self.settings = parse_redis_url(url, password_env=password_env, environ=environ) if url else None
        self.local = LocalContinuations(namespace, max_entries, min_n, max_n, max_continuation)
        self.namespace = namespace
        orders = sorted(set(shared_orders if shared_orders is not None else self.local.orders), reverse=True)
        if any(not min_n <= n <= max_n for n in orders):
            raise ValueError(f"shared_orders must lie in {min_n}..{max_n}, got {orders}")
        self.shared_orders = tuple(orders)  # longest first: the order lookups read them in
        # context sizes in bytes of the shared orders, when they are not all the local ones
        self._shared_spans = None if set(orders) == set(self.local.orders) else {TOKEN_BYTES * n for n in orders}
        self.prefix = f"tandem:{KEY_VERSION}:{namespace_id(namespace)}:".encode()
        self.context_prefix = self.prefix + b"c:"
        self.index_key = self.prefix + b"keys"
        self.call_timeout_s, self.write_timeout_s = call_timeout_s, write_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.shared_runs, self.ttl_ms, self.max_keys = shared_runs, int(ttl_s * 1000), max_keys
        self.enough_match = enough_match if enough_match is not None else max(min_n, max_n - 2)
        self.enough_count = enough_count
        self.flush_interval_s, self.batch_items, self.max_pending = flush_interval_s, batch_items, max_pending
        self.max_inflight = max_inflight
        self.vocab_size = vocab_size  # set it (the target's vocabulary) to refuse out-of-range shared ids
        self.breaker = CircuitBreaker(breaker_failures, breaker_open_s)
        self.metrics = SharedCacheMetrics()
        self._pending: deque[tuple[bytes, bytes]] = deque()
        self._wake = asyncio.Event()
        # Held while a batch is popped and written: flush() and close() wait out a batch the background writer
        # has in flight (returning, or cancelling it, while it was on the wire lost its rows: a test that
        # flushed 300 keys and closed found 256).
        self._writing = asyncio.Lock()
        self._client: Redis | None = None
        self._write_script: Any = None  # registered on first use (redis-py reloads it after a restart)
        self._trim_script: Any = None
        self._read_script: Any = None
        self._task: asyncio.Task | None = None
        self._inflight = 0

    # ----- lifecycle ------------------------------------------------------------
    async def start(self) -> None:
        """Connect and start the writer; an unreachable Redis is a warning, never an error."""
        if self.settings is None or self._task is not None:
            return
        # No socket timeout: every call here runs under asyncio.wait_for already, and redis-py would
        # arm an asyncio timer per reply (CPU on the event loop). No retries: the breaker decides.
        self._client = Redis(**self.settings.client_kwargs(), decode_responses=False, protocol=2,
                             socket_timeout=None, socket_connect_timeout=self.connect_timeout_s,
                             retry=Retry(NoBackoff(), 0), max_connections=self.max_inflight + 4)
        try:
            await asyncio.wait_for(self._client.ping(), self.connect_timeout_s)
            log.info("shared continuation cache on %s", self.settings.redacted_url())
        except Exception as exc:  # noqa: BLE001 - any failure to reach Redis means: local only for now
            self.metrics.redis_errors += 1
            self.breaker.trip()
            log.warning("shared continuation cache: Redis at %s unreachable (%s); local tier only until it answers",
                        self.settings.redacted_url(), _describe(exc))
        self._task = asyncio.create_task(self._background(), name="tandem-shared-continuations")

    async def close(self) -> None:
        """Stop the writer, send what is queued if Redis is up (bounded by the write timeout), disconnect."""
        task, self._task = self._task, None
        if task is not None:
            async with self._writing:  # never cancelled mid-write: what it popped is sent first
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._client is not None:
            await self.flush()
            try:
                await self._client.aclose()
            except Exception as exc:  # noqa: BLE001 - closing a broken connection may fail; nothing to do
                log.debug("shared continuation cache: close: %s", _describe(exc))
            self._client = None

    # ----- lookup -------------------------------------------------------------------
    async def lookup(self, context: Sequence[int], k: int) -> CacheHit | None:
        """Up to ``k`` tokens continuing ``context``: local tier first, then at most one Redis round trip."""
        started = time.perf_counter()
        try:
            hit = await self._lookup(context, k)
        finally:
            self.metrics.lookup_latency_s.append(time.perf_counter() - started)
        m = self.metrics
        m.lookups += 1
        if hit is None:
            m.misses += 1
        elif hit.source == SHARED:
            m.shared_hits += 1
        else:
            m.local_hits += 1
        return hit

    async def _lookup(self, context: Sequence[int], k: int) -> CacheHit | None:
        if k <= 0 or len(context) < self.local.min_n:
            return None
        tail = pack_tokens(list(context[-self.local.max_n :]))
        local = self.local.lookup_packed(tail, k)
        if local is not None and (local.match_len >= self.enough_match or local.count >= self.enough_count):
            return local
        if self._client is None:
            return local
        if not self.breaker.allows_calls or self._inflight >= self.max_inflight:
            self.metrics.redis_skipped += 1
            return local
        found = await self._shared_match(tail, k, local.match_len if local is not None else 1)
        if found is None:
            return local
        n, context_bytes, tokens, count, runs = found
        if local is not None and (local.match_len, local.count) >= (n, count):
            return local
        for run in runs:
            self.local.absorb(context_bytes, run)
        return CacheHit(unpack_tokens(tokens), n, count, SHARED, unpack_runs(runs, k))

    async def _shared_match(self, tail: bytes, k: int,
                            shortest: int) -> tuple[int, bytes, bytes, int, list[bytes]] | None:
        """(match length, context, packed continuation, count, the context's whole runs) from Redis, or None.

        Asks for the suffixes of ``tail`` of ``shortest`` tokens or more (a
        shorter one could not beat the local answer). The runs come most
        frequent first, but the one the continuation was taken from leads: the
        local tier keeps them all in that order, so later rounds find the rest
        of them there (the continuation and a tree's other branches).
        """
        b = TOKEN_BYTES
        length = len(tail) // b
        contexts = [(n, tail[b * (length - n) :]) for n in self.shared_orders if shortest <= n <= length]
        if not contexts:
            return None
        self._inflight += 1
        self.metrics.redis_lookups += 1
        try:
            found, reply = await asyncio.wait_for(self._read([self.context_prefix + c for _, c in contexts]),
                                                  self.call_timeout_s)
        except Exception as exc:  # noqa: BLE001 - Redis trouble must never reach the request
            self._on_error("lookup", exc)
            return None
        finally:
            self._inflight -= 1
        self._on_success()
        if not 1 <= found <= len(contexts):
            return None
        n, context = contexts[found - 1]
        runs = self._decode_reply(context, reply)
        if not runs:
            return None
        tokens, count = best_continuation(runs, k)
        chosen = next(r for r, _ in runs if r.startswith(tokens))
        return n, context, tokens, count, [chosen, *(r for r, _ in runs if r is not chosen)]

    async def _read(self, keys: list[bytes]) -> tuple[int, Any]:
        """(1-based position of the first key with a well-formed run, 0 if none; its flat reply)."""
        assert self._client is not None
        if self._read_script is None:
            self._read_script = self._client.register_script(READ_SCRIPT)
        found, reply, wrong_type, malformed = await self._read_script(keys=keys, args=[self.shared_runs])
        self.metrics.undecodable_entries += wrong_type + malformed
        return found, reply

    def _decode_reply(self, context: bytes, reply: Any) -> list[tuple[bytes, int]]:
        """Decodable (run, count) pairs of a flat member/score reply, highest count first; counts the rest."""
        runs = []
        for i in range(0, len(reply) - 1, 2):
            try:
                score = float(reply[i + 1])
            except (TypeError, ValueError):
                score = math.nan
            decoded = decode_member(context, reply[i], score, self.vocab_size)
            if decoded is None:
                self.metrics.undecodable_entries += 1
            else:
                runs.append(decoded)
        return runs

    # ----- learning -------------------------------------------------------------------
    def learn(self, tokens: Sequence[int], start: int = 0, *, final: bool = False) -> None:
        """Learn into the local tier now and queue the observations for Redis (see ``LocalContinuations.learn``)."""
        if start < 0:
            raise ValueError(f"start must be >= 0, got {start}")
        local = self.local
        skip = learn_offset(start, local.orders, local.max_continuation)  # the tail the new items need, only
        items = list(continuation_items(pack_tokens(tokens[skip:]), start - skip, final, local.orders,
                                        local.max_continuation))
        local.add_items(items)
        if self.settings is None or not items:
            return
        if self._shared_spans is not None:
            items = [item for item in items if len(item[0]) in self._shared_spans]
        room = self.max_pending - len(self._pending) if self.breaker.allows_calls else 0
        if room < len(items):  # Redis away or behind: drop rather than queue without bound
            self.metrics.writes_dropped += len(items) - max(0, room)
            items = items[: max(0, room)]
        self._pending.extend(items)
        self.metrics.writes_queued += len(items)
        if len(self._pending) >= self.batch_items:
            self._wake.set()

    def snapshot(self) -> dict[str, Any]:
        """Everything to export: the metrics, the breaker, the local tier's size, the write queue."""
        out = self.metrics.snapshot()
        out.update(breaker_state=self.breaker.state, breaker_opened=self.breaker.opened,
                   local_entries=self.local.size, local_approx_bytes=self.local.approx_bytes,
                   pending_writes=len(self._pending))
        return out

    @property
    def pending_writes(self) -> int:
        """Observations queued for Redis and not sent yet."""
        return len(self._pending)

    async def flush(self) -> None:
        """Send everything queued now, and wait for what the background task has on the wire (it sends it all
        anyway; for shutdown and tests)."""
        async with self._writing:
            while self._pending and self._client is not None and self.breaker.allows_calls:
                await self._flush_batch()

    # ----- background: flushes and probes -----------------------------------------------
    async def _background(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._wake.wait(), self.flush_interval_s)
            except asyncio.TimeoutError:
                pass
            self._wake.clear()
            try:
                if self.breaker.state != CLOSED:
                    if self.breaker.probe_due():
                        await self._probe()
                    continue
                while self._pending and self.breaker.allows_calls:
                    async with self._writing:
                        await self._flush_batch()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the writer must outlive any bug in one flush
                log.exception("shared continuation cache: background step failed")

    async def _probe(self) -> None:
        assert self._client is not None
        try:
            await asyncio.wait_for(self._client.ping(), self.write_timeout_s)
        except Exception as exc:  # noqa: BLE001
            self.metrics.redis_errors += 1
            self.breaker.record_failure()
            log.debug("shared continuation cache: probe failed: %s", _describe(exc))
            return
        self._on_success()

    async def _flush_batch(self) -> None:
        """Send one batch of queued observations; on failure the batch is dropped (it is a cache)."""
        batch: dict[tuple[bytes, bytes], int] = {}
        for _ in range(min(self.batch_items, len(self._pending))):
            item = self._pending.popleft()
            batch[item] = batch.get(item, 0) + 1
        if not batch:
            return
        sent = sum(batch.values())
        try:
            card = await asyncio.wait_for(self._write(batch), self.write_timeout_s)
            if card > self.max_keys:  # rare, off the request path: a longer leash than one write
                await asyncio.wait_for(self._trim(card), TRIM_TIMEOUTS * self.write_timeout_s)
        except Exception as exc:  # noqa: BLE001
            self.metrics.writes_dropped += sent
            self._on_error("write", exc)
            return
        self._on_success()
        self.metrics.flushes += 1
        self.metrics.writes_sent += sent

    async def _write(self, batch: dict[tuple[bytes, bytes], int]) -> int:
        """One script call: add the counts, cap and expire each key, index the keys; returns the index size."""
        assert self._client is not None
        if self._write_script is None:
            self._write_script = self._client.register_script(WRITE_SCRIPT)
        keys, members = [self.index_key], []
        for (context, run), count in batch.items():
            keys.append(self.context_prefix + context)
            members += (encode_member(context, run), count)
        args = [self.ttl_ms, self.shared_runs, int(time.time() * 1000), *members]
        card, refused = await self._write_script(keys=keys, args=args)
        self.metrics.undecodable_entries += refused
        return card

    async def _trim(self, card: int) -> None:
        """Delete the oldest context keys until the index holds ``TRIM_TO`` of its cap."""
        assert self._client is not None
        if self._trim_script is None:
            self._trim_script = self._client.register_script(TRIM_SCRIPT)
        excess = card - int(self.max_keys * TRIM_TO)
        while excess > 0:
            removed = await self._trim_script(keys=[self.index_key], args=[min(TRIM_CHUNK, excess)])
            self.metrics.keys_trimmed += removed
            if not removed:
                return
            excess -= removed

    # ----- breaker bookkeeping -------------------------------------------------------------
    def _on_success(self) -> None:
        if self.breaker.record_success():
            log.warning("shared continuation cache: Redis answers again; shared tier back on")

    def _on_error(self, what: str, exc: BaseException) -> None:
        self.metrics.redis_errors += 1
        if self.breaker.record_failure():
            dropped = len(self._pending)
            self._pending.clear()
            self.metrics.writes_dropped += dropped
            log.warning("shared continuation cache: Redis %s failed (%s); local tier only for %.1fs "
                        "(%d queued writes dropped)", what, _describe(exc), self.breaker.open_s, dropped)
        else:
            log.debug("shared continuation cache: Redis %s failed: %s", what, _describe(exc))


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
