"""Clients reconnect now and then, so that a Service that balances connections spreads their calls.

A Kubernetes Service (kube-proxy, or any layer-4 balancer) picks a pod per TCP connection, not per
call. A gRPC channel keeps one HTTP/2 connection for all its calls, and an HTTP client reuses its
kept-alive connections: a client that connected when one coordinator replica was up sends every call
to it, however many replicas the autoscaler adds, and two clients may load one replica while another
idles. gRPC's answer is server-side connection management (gRPC proposal A9): once a connection is
``max_connection_age`` old (jittered by +-10%, so that a fleet of clients does not reconnect at
once), the server sends GOAWAY; calls in flight finish on it (the grace below is unbounded: a long
generation is never cut), and the client's next calls open a new connection, which the Service may
send elsewhere. The HTTP API does the same with ``Connection: close`` on the first response after
the age (``ConnectionAge``): the client's pool opens a new connection for its next request.
"""

from __future__ import annotations

import random
import time
import weakref
from collections.abc import Callable
from typing import Any

# grpc-core's jitter on the age (MAX_CONNECTION_AGE_JITTER), copied for the HTTP side.
JITTER = 0.1
# The longest grace gRPC takes (INT_MAX ms, about 24.8 days): calls in flight are never cut for the connection's age.
UNBOUNDED_GRACE_MS = 2**31 - 1


def grpc_options(max_age_s: float | None) -> list[tuple[str, int]]:
    """The server options that make gRPC send GOAWAY to connections older than ``max_age_s`` (none for None)."""
    if max_age_s is None:
        return []
    return [("grpc.max_connection_age_ms", max(1, round(max_age_s * 1000))),
            ("grpc.max_connection_age_grace_ms", UNBOUNDED_GRACE_MS)]


class ConnectionAge:
    """An aiohttp ``on_response_prepare`` hook: a response on a connection older than its (jittered) age closes it.

    A connection's age counts from its first request here (when it is first seen), which for a client that
    connects to send is when it connected. The header goes out with the response, so a streamed response closes
    its connection when the stream ends, and the client knows not to reuse it.
    """

    def __init__(self, max_age_s: float, clock: Callable[[], float] = time.monotonic,
                 rng: random.Random | None = None) -> None:
        self.max_age_s = max_age_s
        self._clock = clock
        self._rng = rng or random.Random()
        # transport -> when it must close; weak, so that a closed connection leaves nothing behind
        self._deadlines: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()

    async def on_response_prepare(self, request: Any, response: Any) -> None:
        transport = request.transport
        if transport is None:  # (the client is gone already)
            return
        now = self._clock()
        deadline = self._deadlines.get(transport)
        if deadline is None:
            deadline = now + self.max_age_s * self._rng.uniform(1 - JITTER, 1 + JITTER)
            self._deadlines[transport] = deadline
        if now >= deadline:
            response.force_close()  # the server closes the connection once this response is whole
            # aiohttp has written its Connection header into the response's headers before this hook runs (and
            # sends them after it), so the client hears of it only from this line.
            response.headers["Connection"] = "close"
