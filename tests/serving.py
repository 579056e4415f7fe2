"""A ManagedServer running inside a test's event loop, on 127.0.0.1, with no models behind it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.config import ServerOptions
from tandem.rpc.server import ManagedServer
from tandem.rpc.tls import ClientTLS, ServerTLS, open_channel


def managed_server(tls: ServerTLS | None = None, role: str = "test", **kwargs) -> ManagedServer:
    return ManagedServer(role, ServerOptions(host="127.0.0.1", port=0, drain_grace_s=0, tls=tls), **kwargs)


@contextlib.asynccontextmanager
async def serving(server: ManagedServer) -> AsyncIterator[str]:
    """Start ``server``, mark it SERVING, yield its address; stop it afterwards."""
    await server.start()
    await server.set_serving()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        await server.server.stop(0)


async def health_status(address: str, tls: ClientTLS | None = None, metadata=(), timeout: float = 5.0) -> int:
    """grpc.health.v1 Check of the whole server, over a fresh channel."""
    async with open_channel(address, tls, aio=True) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""),
                                                                timeout=timeout, metadata=metadata)
        return reply.status
