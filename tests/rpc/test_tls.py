"""TLS and mutual TLS on a real ManagedServer (health and reflection only, no models), with certificates made here."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2

from tandem.cluster import wait_serving
from tandem.rpc.tls import ClientTLS, ServerTLS
from tests.serving import health_status, managed_server, serving
from tests.tls_certs import make_pki

SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def mutual_tls(pki) -> ServerTLS:
    return ServerTLS(pki.server_cert, pki.server_key, client_ca=pki.ca)


def our_client(pki) -> ClientTLS:
    """A client with a certificate from the servers' CA."""
    return ClientTLS(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)


async def assert_refused(address: str, clients: list[ClientTLS | None]) -> None:
    """Each client's handshake fails: the call is UNAVAILABLE before any handler runs."""
    for tls in clients:
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await health_status(address, tls, timeout=5)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE, tls


def test_tls_serves_a_client_that_trusts_the_ca_and_refuses_plaintext(pki):
    async def scenario():
        async with serving(managed_server(ServerTLS(pki.server_cert, pki.server_key))) as address:
            assert await health_status(address, ClientTLS(ca=pki.ca)) == SERVING
            # the certificate names 127.0.0.1 and localhost; localhost is checked through the override
            assert await health_status(address, ClientTLS(ca=pki.ca, server_name="localhost")) == SERVING
            await assert_refused(address, [
                None,  # plaintext to a TLS port
                ClientTLS(ca=pki.other_ca),  # a CA that did not sign the server's certificate
                ClientTLS(ca=pki.ca, server_name="not-this-server.example"),  # the wrong name
            ])
    asyncio.run(scenario())


def test_mutual_tls_refuses_clients_without_a_certificate_from_its_ca(pki):
    async def scenario():
        async with serving(managed_server(mutual_tls(pki))) as address:
            assert await health_status(address, our_client(pki)) == SERVING
            await assert_refused(address, [
                ClientTLS(ca=pki.ca),  # no client certificate
                ClientTLS(ca=pki.ca, cert=pki.other_client_cert, key=pki.other_client_key),  # another CA's
                None,  # plaintext
            ])
    asyncio.run(scenario())


def test_wait_serving_health_checks_a_mutual_tls_server(pki):
    """The health check `tandem up` and LocalCluster use speaks TLS when given the client's options."""
    async def scenario():
        async with serving(managed_server(mutual_tls(pki))) as address:
            await asyncio.to_thread(wait_serving, address, 10, our_client(pki))
            with pytest.raises(TimeoutError):
                await asyncio.to_thread(wait_serving, address, 1, None)
    asyncio.run(scenario())


def test_local_cluster_passes_tls_flags_to_every_process(pki):
    """ClusterSpec's TLS files become the `tandem serve` flags of servers, and the coordinator's worker links."""
    server, client = mutual_tls(pki), our_client(pki)
    assert server.flags() == ["--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                              "--tls-client-ca", str(pki.ca)]
    assert client.flags("--worker-tls-") == ["--worker-tls-ca", str(pki.ca), "--worker-tls-cert",
                                             str(pki.client_cert), "--worker-tls-key", str(pki.client_key)]
