"""An ended request's sequence is released after its reply (``GenerationService._release_later``): a Release waits
for the batch step under way on the worker, which the client need not wait for; at shutdown the coordinator waits
for the releases still under way (``finish_releases``)."""

from __future__ import annotations

import asyncio
import logging

from tandem.v1 import generation_pb2
from tests.coordinator.inprocess import TOKEN, tiny_tokenizer, warm_coordinator


def test_a_reply_does_not_wait_for_its_release_and_shutdown_does(tmp_path):
    tokenizer = tiny_tokenizer(tmp_path)

    async def scenario():
        async with warm_coordinator(tokenizer) as (coordinator, worker, stub):
            worker.release_gate = asyncio.Event()  # a worker in a long step: each Release waits for it
            request = generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=[3, 4]),
                                                     stopping=generation_pb2.StoppingOptions(max_new_tokens=2))
            reply = await asyncio.wait_for(stub.Generate(request), 5)
            assert list(reply.token_ids) == [TOKEN, TOKEN]  # answered while its release waits
            chunks = [c async for c in stub.GenerateStream(request, timeout=5)]
            assert chunks[-1].finish_reason and worker.calls["Release"] == 0  # the stream ended too
            finishing = asyncio.ensure_future(coordinator.service.finish_releases(5))
            await asyncio.sleep(0.05)
            assert not finishing.done()  # shutdown waits for them
            worker.release_gate.set()
            await finishing
            assert worker.calls["Release"] == 2

    asyncio.run(scenario())


def test_a_release_queued_behind_a_long_step_is_no_warning(tmp_path, monkeypatch, caplog):
    # The worker takes the Release when its step ends, whether or not the coordinator still waits for the answer.
    from coordinator import workers

    monkeypatch.setattr(workers, "RELEASE_TIMEOUT_S", 0.05)
    tokenizer = tiny_tokenizer(tmp_path)

    async def scenario():
        async with warm_coordinator(tokenizer) as (coordinator, worker, _):
            worker.release_gate = asyncio.Event()  # never set while the release waits
            channel = coordinator.targets.clients[0].for_request(None)
            with caplog.at_level(logging.INFO):
                await channel.release("s")
            worker.release_gate.set()

    asyncio.run(scenario())
    released = [r for r in caplog.records if "release of s" in r.getMessage()]
    assert [(r.levelname, "not answered within" in r.getMessage()) for r in released] == [("INFO", True)]
    # (grpc's own server may log that the held handler answered a call whose deadline had passed: not ours)
    ours = [r for r in caplog.records if r.name.startswith(("coordinator", "tandem"))]
    assert not [r for r in ours if r.levelno >= logging.WARNING]
