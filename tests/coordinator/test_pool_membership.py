"""A pool whose membership changes while it serves: new replicas wait for their Info, leaving ones drain."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.workers import WorkerClient, WorkerPool
from tandem import errors
from tandem.v1 import common_pb2


def usable(address: str, free: int = 50) -> WorkerClient:
    """A replica whose Info has answered (with the pool's tokenizer); its channel points nowhere and is never used."""
    client = WorkerClient(address, "target", 60.0)
    client.info = common_pb2.WorkerInfo(total_blocks=100, free_blocks=free, tokenizer_fingerprint="fp")
    client.healthy = client.verified = True
    return client


def test_a_leaving_replica_gets_no_new_requests_drains_and_is_closed_once_idle():
    async def scenario():
        a, b = usable("127.0.0.1:1", free=90), usable("127.0.0.1:2", free=10)
        pool = WorkerPool("target", [a, b], "fp")
        assert pool.pick() is a
        a.active = 1  # a request runs on a
        pool.update({"127.0.0.1:2"})
        assert a.state == "leaving" and a in pool.clients  # still there: its request goes on
        assert {pool.pick() for _ in range(5)} == {b}
        pool.update({"127.0.0.1:1", "127.0.0.1:2"})  # back before it was closed: simply routable again
        assert a.state == "healthy" and pool.pick() is a
        pool.update({"127.0.0.1:2"})
        a.active = 0  # its request finished
        await pool.refresh_all()  # the poll closes what drained
        assert pool.clients == [b] and pool.counts()["leaving"] == 0
        await pool.close()

    asyncio.run(scenario())


def test_a_new_replica_is_not_used_until_its_info_answers():
    async def scenario():
        pool = WorkerPool("target", [], "fp", call_timeout_s=5.0)
        pool.update({"127.0.0.1:1"})  # nothing listens there: its Info never answers
        assert pool.counts() == {"starting": 1, "healthy": 0, "unhealthy": 0, "leaving": 0, "rejected": 0}
        with pytest.raises(errors.WorkerUnavailableError, match="no target workers available"):
            pool.pick()
        await pool.refresh_all()
        assert pool.clients[0].state == "starting" and not pool.has_healthy()
        pool.update(set())  # gone before it ever answered: closed at once
        assert pool.clients == []
        await pool.close()

    asyncio.run(scenario())


def test_a_replica_is_judged_on_every_info_a_stranger_never_gets_requests_until_it_serves_our_model():
    answers = iter([("target", "other-fp"), ("draft", "fp"), ("target", "fp")])

    async def info_answers(self) -> grpc.StatusCode:  # what the replica's Info says, poll after poll
        role, fingerprint = next(answers)
        self.info = common_pb2.WorkerInfo(role=role, tokenizer_fingerprint=fingerprint, total_blocks=10)
        self.healthy = True
        return grpc.StatusCode.OK

    async def scenario():
        client = WorkerClient("127.0.0.1:1", "target", 60.0)
        client.refresh = info_answers.__get__(client)
        pool = WorkerPool("target", [client], "fp")
        seen = []
        for _ in range(3):
            await pool.refresh_all()
            seen.append(client.state)
            if client.state == "rejected":
                with pytest.raises(errors.WorkerUnavailableError):
                    pool.pick()
        assert pool.pick() is client
        await pool.close()
        return seen

    assert asyncio.run(scenario()) == ["rejected", "rejected", "healthy"]


def test_a_replica_closed_while_its_info_poll_is_on_the_way_ends_the_poll_quietly():
    """grpc.aio cancels a closed channel's calls and raises CancelledError in their callers: a replica
    that drains while an Info poll waits for it must end that poll (the periodic poll every request's
    routing reads) with an answer, not cancel it. Seen in CI as a coordinator Info that never replied,
    when the public Info still polled every replica itself."""
    from tandem.v1 import target_pb2_grpc
    from tests.serving import managed_server, serving

    class SlowInfo(target_pb2_grpc.TargetWorkerServicer):
        def __init__(self) -> None:
            self.asked = asyncio.Event()

        async def Info(self, request, context):
            self.asked.set()
            await asyncio.sleep(1.5)
            return common_pb2.WorkerInfo(role="target", tokenizer_fingerprint="fp")

    async def scenario():
        servicer = SlowInfo()
        server = managed_server(role="target")
        server.add_service(target_pb2_grpc.add_TargetWorkerServicer_to_server, servicer, "tandem.v1.TargetWorker")
        async with serving(server) as address:
            pool = WorkerPool("target", [usable(address)], "fp")
            poll = asyncio.create_task(pool.refresh_all())
            await servicer.asked.wait()
            pool.update(set())  # it left, idle: closed at once, its Info still on the way
            assert pool.clients == []
            await asyncio.wait_for(poll, timeout=5)  # neither cancelled nor hanging
            await pool.refresh_all()  # later polls go on without it
            await pool.close()

    asyncio.run(scenario())


def test_waiting_for_a_first_target_says_what_each_listed_one_answers(monkeypatch, caplog):
    """A coordinator given a wrong --target-addr said "joined" and then nothing for ten minutes."""
    import coordinator.main as coordinator_main

    monkeypatch.setattr(coordinator_main, "WAIT_REPORT_S", 0.2)
    monkeypatch.setattr(coordinator_main, "WAIT_POLL_S", 0.05)

    async def scenario():
        pool = WorkerPool("target", [], "fp", call_timeout_s=5.0)
        pool.update({"127.0.0.1:1"})  # nothing listens there
        try:
            with caplog.at_level("WARNING", logger="coordinator.main"):
                await coordinator_main.wait_for_target(pool, timeout_s=1.0)
        finally:
            await pool.close()

    with pytest.raises(errors.WorkerUnavailableError, match=r"no usable target worker after 1s "
                                                           r"\(127\.0\.0\.1:1 starting \(UNAVAILABLE: "):
        asyncio.run(scenario())
    reports = [r.getMessage() for r in caplog.records if r.name == "coordinator.main"]
    assert reports and all("127.0.0.1:1 starting (UNAVAILABLE: " in m and "giving up after 1s" in m for m in reports)
