from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.redis_server import RedisServer, find_redis_server, free_port


def _server(tmp_path, password: str | None = None) -> Iterator[RedisServer]:
    binary = find_redis_server()
    if binary is None:
        pytest.skip("redis-server not installed (apt-get install redis-server; CI installs it)")
    server = RedisServer(binary, free_port(), tmp_path, password)
    server.start()
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
