from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.redis_server import RedisServer, RedisTLS, find_redis_server, free_port


def _server(tmp_path, password: str | None = None, tls: RedisTLS | None = None) -> Iterator[RedisServer]:
    binary = find_redis_server()
    if binary is None:
        pytest.skip("redis-server not installed (apt-get install redis-server; CI installs it)")
    server = RedisServer(binary, free_port(), tmp_path, password, tls)
    try:
        server.start()
    except RuntimeError as exc:
        if tls is not None and "TLS" in str(exc):  # a build without TLS says so in its log
            pytest.skip(f"this redis-server build has no TLS support: {exc}")
        raise
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A fresh redis-server per test (tests kill and restart it), on a free loopback port."""
    yield from _server(tmp_path)


@pytest.fixture
def redis_server_with_password(tmp_path) -> Iterator[RedisServer]:
    """Like ``redis_server`` but requiring the password ``s3cret``."""
    yield from _server(tmp_path, "s3cret")


@pytest.fixture
def redis_server_with_tls_and_password(tmp_path) -> Iterator[RedisServer]:
    """TLS only (a certificate for 127.0.0.1 from a CA made here: ``server.tls.ca``), password ``s3cret``."""
    from tests.tls_certs import make_pki

    pki = make_pki(tmp_path / "pki")
    yield from _server(tmp_path, "s3cret", RedisTLS(pki.server_cert, pki.server_key, pki.ca))
