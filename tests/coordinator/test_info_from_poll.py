"""The public Info answers from the coordinator's periodic poll of its workers: however often clients
call it, no worker hears of it, and the placement counts that spread a burst are left alone."""

from __future__ import annotations

import asyncio

from tandem.v1 import generation_pb2
from tests.coordinator.inprocess import tiny_tokenizer, warm_coordinator


def test_info_calls_reach_no_worker_and_keep_the_placement_counts_until_the_next_poll(tmp_path):
    tokenizer = tiny_tokenizer(tmp_path)

    async def scenario():
        async with warm_coordinator(tokenizer) as (coordinator, worker, stub):
            client = coordinator.targets.clients[0]
            coordinator.targets.pick()
            coordinator.targets.pick()  # a burst of two placed since the last poll
            polled = worker.calls["Info"]
            for _ in range(20):
                reply = await stub.Info(generation_pb2.InfoRequest(), timeout=5)
                assert reply.target_model == "fake-target"
                assert reply.target_workers[0].info.free_blocks == 90
            assert worker.calls["Info"] == polled
            assert client.placed_since_poll == 2

            worker.free_blocks = 40
            await coordinator.targets.refresh_all()  # the periodic poll (every info_poll_s)
            assert worker.calls["Info"] == polled + 1 and client.placed_since_poll == 0
            reply = await stub.Info(generation_pb2.InfoRequest(), timeout=5)
            assert reply.target_workers[0].info.free_blocks == 40
    asyncio.run(scenario())
