"""DNS discovery: the A/AAAA records of a headless Service, re-resolved every few seconds.

A headless Service's name resolves to one record per ready pod, and to no
record (NXDOMAIN) when none is ready: that empties the set. Any other failure
(a resolver timeout) keeps the current set, so a DNS hiccup does not drain
the fleet.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator

log = logging.getLogger(__name__)

# The name exists but has no address, or does not exist: no replica is ready.
NO_RECORDS = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}


def host_port(host: str, port: int) -> str:
    """A gRPC target for one address: IPv6 literals in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class DnsSource:
    def __init__(self, role: str, name: str, port: int, interval_s: float = 5.0) -> None:
        self.role = role
        self.name = name
        self.port = port
        self.interval_s = interval_s

    async def resolve(self) -> frozenset[str] | None:
        """The addresses the name has now; None when the resolver failed (keep what we have)."""
        loop = asyncio.get_running_loop()
        try:
            infos = await loop.getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in NO_RECORDS:
                return frozenset()
            log.warning("resolving %s (%s workers) failed: %s; keeping the current set", self.name, self.role, exc)
            return None
        return frozenset(host_port(str(info[4][0]), self.port) for info in infos)

    async def watch(self) -> AsyncIterator[frozenset[str]]:
        last: frozenset[str] | None = None
        while True:
            addresses = await self.resolve()
            if addresses is not None and addresses != last:
                last = addresses
                yield addresses
            await asyncio.sleep(self.interval_s)
