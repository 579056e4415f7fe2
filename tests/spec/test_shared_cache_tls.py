"""The shared continuation cache over TLS to a real redis-server that also requires a password.

The certificates are made in the test (tests/tls_certs.py); the server listens
on TLS only, so anything that reaches the cache went through the handshake,
verified against the test's CA, and AUTH.
"""

from __future__ import annotations

import asyncio

from tandem.spec.shared_cache import CLOSED, OPEN, SharedContinuations
from tests.tls_certs import make_pki

SEQ = list(range(1000, 1040))
PASSWORD = {"TANDEM_REDIS_PASSWORD": "s3cret"}


def cache(url: str, environ: dict[str, str]) -> SharedContinuations:
    return SharedContinuations("fingerprint-tls", url, flush_interval_s=0.01, environ=environ)


def test_rediss_with_password_shares_what_coordinators_learn_and_refuses_what_lacks_either(
        redis_server_with_tls_and_password, tmp_path):
    server = redis_server_with_tls_and_password
    verified = f"{server.url}?ssl_ca_certs={server.tls.ca}"
    stranger_ca = make_pki(tmp_path / "other").other_ca

    async def scenario() -> None:
        writer, reader = cache(verified, PASSWORD), cache(verified, PASSWORD)
        refused = [
            cache(verified, {"TANDEM_REDIS_PASSWORD": "wrong"}),  # TLS fine, wrong password
            cache(verified, {}),  # no password
            cache(f"{server.url}?ssl_ca_certs={stranger_ca}", PASSWORD),  # a CA that did not sign Redis's cert
            cache(server.url.replace("rediss://", "redis://"), PASSWORD),  # plaintext to a TLS port
        ]
        for c in (writer, reader, *refused):
            await c.start()
        try:
            assert writer.breaker.state == CLOSED and reader.breaker.state == CLOSED
            assert [c.breaker.state for c in refused] == [OPEN] * len(refused)
            writer.learn(SEQ, final=True)
            await writer.flush()
            assert writer.metrics.writes_sent > 0 and writer.metrics.redis_errors == 0
            hit = await reader.lookup(SEQ[:8], 4)
            assert hit is not None and hit.source == "shared" and list(hit.tokens) == SEQ[8:12]
            assert [await c.lookup(SEQ[:8], 4) for c in refused] == [None] * len(refused)
        finally:
            for c in (writer, reader, *refused):
                await c.close()

    asyncio.run(scenario())
