"""--max-connection-age on the coordinator's real HTTP app (over the scripted target, tests/http/harness.py): a client
is told to reconnect once its connection is older than the age, after its response (a stream included) is whole.
The hook alone, and gRPC's side: tests/rpc/test_connection_age.py."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from tandem.rpc.connection_age import JITTER
from tests.coordinator.inprocess import tiny_tokenizer
from tests.http.harness import http_coordinator
from tests.http.test_http_api import run

AGE_S = 0.3


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def test_an_http_client_is_told_to_reconnect_after_the_age_and_does(tokenizer):
    """Responses on a connection younger than the age keep it alive; the first one after it (a stream included,
    whole) says ``Connection: close``; the client's next request opens a new connection, young again."""
    async def go():
        opened = []  # the client's new connections, as aiohttp's tracing reports them

        async def on_connection(session, context, params) -> None:
            opened.append(params)

        tracing = aiohttp.TraceConfig()
        tracing.on_connection_create_end.append(on_connection)
        async with http_coordinator(tokenizer, connection_age_s=AGE_S) as running, aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=1), trace_configs=[tracing]) as session:
            async def models() -> str:
                async with session.get(running.url + "/models") as reply:
                    assert reply.status == 200
                    await reply.read()
                    return reply.headers.get("Connection", "keep-alive")

            assert (await models(), await models()) == ("keep-alive", "keep-alive") and len(opened) == 1
            await asyncio.sleep(AGE_S * (1 + JITTER) + 0.05)
            body = {"prompt": "hi", "max_tokens": 4, "stream": True}
            async with session.post(running.url + "/completions", json=body) as reply:
                assert reply.status == 200 and reply.headers["Connection"] == "close"
                events = [line async for line in reply.content if line.startswith(b"data: ")]
                assert events[-1] == b"data: [DONE]\n" and len(events) > 2
            assert len(opened) == 1
            assert await models() == "keep-alive" and len(opened) == 2  # a new connection, young again
    run(go())
