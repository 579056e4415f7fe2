"""The HTTP API's edges: HTTPS and mutual TLS with the coordinator's certificate, /v1/models inside the client
budget, and its port through the configuration, the READY line and `tandem up`."""

from __future__ import annotations

import asyncio
import logging
import ssl

import aiohttp
import pytest

from coordinator.http.protocol_log import MalformedRequestsOnOneLine
from tandem.cluster import READY
from tandem.config import CoordinatorConfig, ServerOptions
from tandem.errors import InvalidRequestError
from tandem.rpc.tls import ServerTLS
from tests.coordinator.inprocess import tiny_tokenizer
from tests.http.harness import http_coordinator
from tests.tls_certs import make_pki

BODY = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def client_context(pki, cert=None, key=None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=str(pki.ca))
    if cert is not None:
        context.load_cert_chain(cert, key)
    return context


async def status(url: str, context: ssl.SSLContext | bool | None = None) -> int:
    async with aiohttp.ClientSession() as session, session.post(url + "/completions", json=BODY,
                                                                ssl=context) as reply:
        return reply.status


def test_https_with_the_coordinators_certificate(tokenizer, pki):
    async def go():
        async with http_coordinator(tokenizer, tls=ServerTLS(pki.server_cert, pki.server_key)) as running:
            assert running.url.startswith("https://")
            assert await status(running.url, client_context(pki)) == 200
            with pytest.raises(aiohttp.ClientError):  # a client that does not trust the certificate
                await status(running.url, ssl.create_default_context(cafile=str(pki.other_ca)))
            with pytest.raises(aiohttp.ClientError):  # plaintext to the TLS port
                await status(running.url.replace("https://", "http://"))
    asyncio.run(go())


def test_mutual_tls_needs_a_client_certificate_from_the_clients_ca(tokenizer, pki):
    async def go():
        tls = ServerTLS(pki.server_cert, pki.server_key, pki.ca)
        async with http_coordinator(tokenizer, tls=tls) as running:
            assert await status(running.url, client_context(pki, pki.client_cert, pki.client_key)) == 200
            for refused in (client_context(pki), client_context(pki, pki.other_client_cert, pki.other_client_key)):
                with pytest.raises(aiohttp.ClientError):
                    await status(running.url, refused)
    asyncio.run(go())


def test_models_counts_against_the_client_budget_like_grpc_info(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, max_concurrent_per_client=1) as running:
            running.target.gate.clear()
            held = asyncio.ensure_future(status(running.url))
            while not running.target.live:
                await asyncio.sleep(0.01)
            async with aiohttp.ClientSession() as session, session.get(running.url + "/models") as reply:
                assert reply.status == 429 and reply.headers["Retry-After"] == "1"
            running.target.gate.set()
            assert await held == 200
            async with aiohttp.ClientSession() as session, session.get(running.url + "/models") as reply:
                assert reply.status == 200
    asyncio.run(go())


# ----- the port's configuration --------------------------------------------------------------------------

@pytest.mark.parametrize("http_port,grpc_port,complaint", [(70000, 0, "0..65535"), (-1, 0, "0..65535"),
                                                           (9000, 9000, "gRPC --port too")])
def test_http_port_is_checked_where_the_configuration_is(http_port, grpc_port, complaint):
    with pytest.raises(InvalidRequestError, match="--http-port") as refused:
        CoordinatorConfig(server=ServerOptions(port=grpc_port), tokenizer_dir="t", target_addrs=["h:1"],
                          http_port=http_port)
    assert complaint in str(refused.value)
    for fine in (None, 0, 8000):
        assert CoordinatorConfig(server=ServerOptions(port=50051), tokenizer_dir="t", target_addrs=["h:1"],
                                 http_port=fine).http_port == fine


def test_the_ready_line_names_the_http_port_and_old_lines_still_match():
    old = READY.search("TANDEM_READY role=target port=50052 metrics_port=9102")
    assert old is not None and old.group(4) is None
    new = READY.search("TANDEM_READY role=coordinator port=50051 metrics_port=9100 http_port=8000")
    assert new is not None and new.groups() == ("coordinator", "50051", "9100", "8000")


def up_args(*flags: str) -> list[str]:
    from tandem.cli import build_parser
    from tandem.cli.up import cluster_spec

    return list(cluster_spec(build_parser().parse_args(["up", "--target", "t", "--draft", "d", *flags]))
                .coordinator_args)


def test_tandem_up_serves_http_by_default_and_passes_the_port():
    def http_port(args):
        return args[args.index("--http-port") + 1] if "--http-port" in args else None

    assert http_port(up_args()) == "8000"
    assert http_port(up_args("--port", "0")) == "0"  # free ports asked for: the HTTP one too
    assert http_port(up_args("--http-port", "9001")) == "9001"
    assert http_port(up_args("--no-http")) is None


def test_serve_coordinator_leaves_http_off_unless_asked():
    from tandem.cli import build_parser

    parser = build_parser()
    base = ["serve", "coordinator", "--tokenizer", "t", "--target-addr", "h:1"]
    assert parser.parse_args(base).http_port is None
    assert parser.parse_args([*base, "--http-port", "0"]).http_port == 0


@pytest.mark.parametrize("draft_stops", [True, False])
def test_the_coordinators_draft_stops_switch_reaches_every_requests_options(tokenizer, draft_stops):
    """``--no-draft-stops`` (CoordinatorConfig.draft_stops): the draft drafts every token of a round's k."""
    from tests.http.harness import MODEL, record_starts
    from tests.http.test_http_api import client

    async def go():
        async with http_coordinator(tokenizer, draft_stops=draft_stops) as running:
            seen = record_starts(running, lambda run: run.options.draft_stops)
            await client(running).completions.create(model=MODEL, prompt="hi", max_tokens=2)
            assert seen == [draft_stops]
    asyncio.run(go())
    from tandem.cli import build_parser
    from tandem.cli.up import cluster_spec

    flags = [] if draft_stops else ["--no-draft-stops"]
    assert ("--no-draft-stops" in cluster_spec(build_parser().parse_args(["up", "--target", "t", *flags]))
            .coordinator_args) is not draft_stops  # tandem up passes it on


def test_an_empty_messages_list_is_called_empty_not_a_list():
    """"a non-empty list ..., got a list" named the wrong fault."""
    from coordinator.http.schema import parse_messages

    with pytest.raises(Exception, match=r"messages: a non-empty list of \{role, content\} objects, got an empty list"):
        parse_messages([])
    with pytest.raises(Exception, match="got an object"):
        parse_messages({"role": "user"})


def test_a_malformed_request_is_a_400_and_one_warning_line_not_a_traceback(tokenizer, caplog):
    """aiohttp logs a request it cannot parse with a traceback at ERROR; the coordinator's log keeps one
    warning line naming what was wrong, and the server goes on answering."""
    async def raw(port: int, data: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        await writer.drain()
        head = await reader.read(200)
        writer.close()
        return head

    async def go():
        async with http_coordinator(tokenizer) as running:
            port = int(running.url.rsplit(":", 1)[1].split("/")[0])
            with caplog.at_level(logging.DEBUG, logger="coordinator.http.protocol"):
                head = await raw(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nno colon here\r\n\r\n")
                await asyncio.sleep(0.05)  # the handler logs after it answers
            assert head.split(b"\r\n")[0].endswith(b" 400 Bad Request")
            async with aiohttp.ClientSession() as session, session.get(running.url + "/models") as reply:
                assert reply.status == 200  # still serving
        records = [r for r in caplog.records if r.name == "coordinator.http.protocol"]
        assert records, "aiohttp logged nothing for the malformed request"
        assert all(r.levelno == logging.WARNING and r.exc_info is None for r in records)
        message = records[0].getMessage()
        assert "malformed request refused with 400: Invalid header token" in message and "\n" not in message
    asyncio.run(go())


def test_other_exceptions_keep_their_traceback_at_error():
    record = logging.LogRecord("coordinator.http.protocol", logging.ERROR, __file__, 1, "Error handling request",
                               None, (RuntimeError, RuntimeError("boom"), None))
    assert MalformedRequestsOnOneLine().filter(record)
    assert record.levelno == logging.ERROR and record.exc_info is not None
