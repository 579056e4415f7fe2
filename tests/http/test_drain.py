"""A coordinator draining after SIGTERM: requests in flight finish within the grace, and those still running when
it runs short are ended by the coordinator with an error that says why (coordinator/in_flight.py), on both APIs,
their KV released; before, gRPC clients got CANCELLED and HTTP streams a dropped connection."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import grpc
import pytest

from coordinator.in_flight import InFlight
from tandem.errors import ShuttingDownError
from tandem.rpc.tls import open_channel
from tandem.v1 import generation_pb2, generation_pb2_grpc
from tests.coordinator.inprocess import tiny_tokenizer
from tests.http.harness import http_coordinator

TEXT = "&(*,"  # what the scripted target writes (harness.TOKENS), as the tiny tokenizer spells it
WAIT_S = 20.0  # the most any step here waits before the test fails instead of hanging


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


async def sse_events(reply: aiohttp.ClientResponse) -> list:
    """Every server-sent event's data until the stream closes: parsed JSON, or the text ``[DONE]``."""
    events = []
    async for line in reply.content:
        line = line.strip()
        if line.startswith(b"data: "):
            data = line[len(b"data: "):].decode()
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def read_all(call) -> list:
    """A gRPC stream's messages to its end (its error raised)."""
    return [message async for message in call]


async def until(condition, what: str) -> None:
    for _ in range(int(WAIT_S / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"waited {WAIT_S} s for {what}")


def test_requests_still_running_when_the_drain_grace_runs_out_end_saying_so_on_both_apis(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            server = running.server
            server.drain_work = running.service.drain  # as coordinator/main.py wires it
            server.options.drain_grace_s = 1.5
            running.target.gate.clear()  # every request waits in its first round: none can finish in the grace
            async with aiohttp.ClientSession() as session, open_channel(running.grpc_address, None,
                                                                          aio=True) as channel:
                stream = await session.post(running.url + "/completions",
                                            json={"prompt": "hi", "max_tokens": 8, "stream": True})
                whole = asyncio.ensure_future(session.post(running.url + "/completions",
                                                           json={"prompt": "hi", "max_tokens": 8}))
                call = generation_pb2_grpc.GenerationStub(channel).GenerateStream(generation_pb2.GenerateRequest(
                    text="hi", stopping=generation_pb2.StoppingOptions(max_new_tokens=8)))
                grpc_reply = asyncio.ensure_future(read_all(call))
                await until(lambda: len(running.target.live) == 3, "three requests on the target")
                await asyncio.wait_for(server.drain_and_stop(), WAIT_S)

                events = await asyncio.wait_for(sse_events(stream), WAIT_S)
                assert events[-1] == "[DONE]"
                error = events[-2]["error"]
                assert error["code"] == "draining" and error["type"] == "service_unavailable_error"
                assert "drain grace (1.5 s) ran out" in error["message"]
                reply = await asyncio.wait_for(whole, WAIT_S)
                body = await reply.json()
                assert reply.status == 503 and body["error"]["code"] == "draining"
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await asyncio.wait_for(grpc_reply, WAIT_S)
                # UNAVAILABLE: what a gRPC client retries, here or on another coordinator
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "send the request again" in refused.value.details()
            await until(lambda: not running.target.live, "their KV released")
            running.target.gate.set()
            registry = running.server.registry
            assert registry.get_sample_value("tandem_coordinator_requests_total", {"outcome": "drained"}) == 3
    asyncio.run(go())


def test_requests_that_finish_within_the_grace_are_not_ended(tokenizer):
    async def go():
        async with http_coordinator(tokenizer) as running:
            running.target.gate.clear()
            async with aiohttp.ClientSession() as session:
                whole = asyncio.ensure_future(session.post(running.url + "/completions",
                                                           json={"prompt": "hi", "max_tokens": 3}))
                await until(lambda: running.target.live, "the request on the target")
                draining = asyncio.ensure_future(running.service.in_flight.drain(WAIT_S))
                await asyncio.sleep(0.2)
                assert not draining.done()  # it waits for the request
                running.target.gate.set()
                reply = await asyncio.wait_for(whole, WAIT_S)
                assert reply.status == 200 and (await reply.json())["choices"][0]["text"] == TEXT[:3]
                assert await asyncio.wait_for(draining, WAIT_S) == 0  # ended none
    asyncio.run(go())


def test_only_the_drains_own_cancellation_becomes_the_error():
    """A request cancelled by its client (gone) stays cancelled; one ended by the drain while at its own work raises
    ShuttingDownError, once (its task's cancellation is taken back, so it can still write its error); one handed to
    its API between rounds is not cancelled (that would cancel the write) and ends when it asks for its next."""
    async def request(in_flight: InFlight, started: asyncio.Event, rounds: list) -> str:
        with in_flight.running() as tracked:
            try:
                started.set()
                for _ in range(3):
                    await asyncio.sleep(WAIT_S)  # its own work: a worker call
                    rounds.append(1)
            except asyncio.CancelledError:
                ended = tracked.ended()
                if ended is None:
                    raise
                assert isinstance(ended, ShuttingDownError)
                await asyncio.sleep(0)  # (not cancelled again: it can write its error)
                return str(ended)
        return "finished"

    async def between_rounds(in_flight: InFlight, handed: asyncio.Event, go_on: asyncio.Event) -> str:
        with in_flight.running() as tracked:
            tracked.inside = False  # handed to its API, which writes a message meanwhile
            handed.set()
            await go_on.wait()  # (a write: cancelling the task here would cancel it)
            tracked.inside = True
            try:
                tracked.check()
            except ShuttingDownError as exc:
                return f"ended at its next round: {exc}"
        return "finished"

    async def go():
        in_flight = InFlight()
        started, rounds = asyncio.Event(), []
        gone = asyncio.ensure_future(request(in_flight, started, rounds))
        await started.wait()
        started.clear()
        ended = asyncio.ensure_future(request(in_flight, started, rounds))
        await started.wait()
        handed, go_on = asyncio.Event(), asyncio.Event()
        writing = asyncio.ensure_future(between_rounds(in_flight, handed, go_on))
        await handed.wait()
        assert len(in_flight) == 3
        gone.cancel()  # the client's doing
        with pytest.raises(asyncio.CancelledError):
            await gone
        assert in_flight.end_all("stopping") == 2
        assert await ended == "stopping"
        await asyncio.sleep(0.05)
        assert not writing.done()  # not cancelled mid-write
        go_on.set()
        assert await writing == "ended at its next round: stopping"
        assert len(in_flight) == 0 and await in_flight.wait_idle(0.0) and rounds == []
    asyncio.run(go())
