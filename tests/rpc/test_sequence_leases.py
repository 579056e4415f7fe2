"""Sequence leases, in process: who owns what a worker holds, and what it takes back when.

The bookkeeping (``tandem.rpc.leases``) on a clock the test moves; then the target and
draft engines over a tiny model, freeing a silent coordinator's KV on ``reclaim`` (what
the worker runs on its model thread) and nobody else's; then the coordinator's side:
every call and every Info poll names the coordinator, and the poll keeps up with the
lease a worker reports.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.workers import RequestChannel, WorkerClient, WorkerPool
from draft_worker.engine import DraftEngine, ProposeCall
from tandem.config import EngineConfig, ServerOptions, WorkerConfig
from tandem.engine import ModelEngine
from tandem.errors import InvalidRequestError
from tandem.rpc.leases import IDLE, LEASE, Leases
from tandem.rpc.sequence_engine import SequenceOwnedError
from tandem.rpc.status import status_for
from tandem.sampling import SamplingParams
from tandem.v1 import common_pb2, target_pb2
from target_worker.engine import PrefillCall, ReleaseCall, TargetEngine, VerifyCall
from tests.target_worker.test_engine import (
    assert_unchanged,
    ok,
    one_thread,  # noqa: F401 - autouse: one torch thread
    snapshot,
)

PROMPT = [3, 14, 15, 92, 65, 35, 89]
GREEDY = SamplingParams()
A, B = "coordinator-a", "coordinator-b"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


def load(model_dir) -> ModelEngine:
    return ModelEngine.load(EngineConfig(model_dir, dtype="bfloat16", kv_cache_tokens=512, block_size=4))


# ----- the bookkeeping ------------------------------------------------------------------------------
def test_an_owner_unheard_for_a_lease_loses_its_sequences_and_only_its_own(clock):
    leases = Leases(lease_s=30, idle_ttl_s=600, clock=clock)
    leases.hold("a1", A)
    leases.hold("a2", A)
    leases.hold("b1", B)
    clock.now += 20
    leases.renew(B)  # B's heartbeat; A has crashed
    clock.now += 15
    expired = leases.expired()
    assert sorted((e.seq_id, e.owner, e.reason) for e in expired) == [("a1", A, LEASE), ("a2", A, LEASE)]
    for e in expired:
        leases.drop(e.seq_id)
    assert leases.owner_of("b1") == B and leases.owner_of("a1") is None
    clock.now += 10  # B's lease still runs (renewed 25 s ago)
    assert leases.expired() == []


def test_calls_and_heartbeats_keep_a_lease_for_as_long_as_they_come(clock):
    leases = Leases(lease_s=30, idle_ttl_s=0, clock=clock)
    leases.hold("a1", A)
    for _ in range(10):  # 200 s in all, never 30 s without a word from A
        clock.now += 20
        leases.renew(A)
        assert leases.expired() == []
    clock.now += 31
    assert [e.reason for e in leases.expired()] == [LEASE]


def test_a_coordinator_that_comes_back_after_its_lease_renews_afresh(clock):
    leases = Leases(lease_s=30, idle_ttl_s=0, clock=clock)
    leases.hold("a1", A)
    clock.now += 31
    assert [e.seq_id for e in leases.expired()] == ["a1"]
    leases.drop("a1")
    leases.hold("a2", A)  # its next request, after a network partition healed
    clock.now += 29
    assert leases.expired() == []


def test_an_idle_sequence_is_freed_after_its_time_to_live_whatever_its_owner(clock):
    leases = Leases(lease_s=30, idle_ttl_s=120, clock=clock)
    leases.hold("lost", A)  # A lives on, but this sequence's Release never arrived
    leases.hold("anonymous", "")  # a caller that names no owner has no lease: only the time-to-live
    leases.hold("busy", A)
    for _ in range(6):  # 120 s
        clock.now += 20
        leases.renew(A)
        leases.hold("busy", A)
        assert leases.expired() == []
    clock.now += 1
    leases.renew(A)
    assert sorted((e.seq_id, e.reason) for e in leases.expired()) == [("anonymous", IDLE), ("lost", IDLE)]


def test_the_worker_options_refuse_a_lease_no_heartbeat_can_keep(tiny_qwen2_dir):
    engine = EngineConfig(tiny_qwen2_dir, dtype="bfloat16")
    for bad in (dict(lease_s=0.2), dict(lease_s=-1), dict(lease_s=30, idle_ttl_s=10)):
        with pytest.raises(InvalidRequestError, match="--sequence-"):
            WorkerConfig(engine, ServerOptions(), "m", **bad)
    assert WorkerConfig(engine, ServerOptions(), "m", lease_s=2, idle_ttl_s=0).idle_ttl_s == 0


# ----- the engines ------------------------------------------------------------------------------
def test_reclaim_frees_a_silent_coordinators_target_kv_and_leaves_the_others_running(tiny_qwen2_dir, clock):
    target = TargetEngine(load(tiny_qwen2_dir), Leases(lease_s=30, idle_ttl_s=600, clock=clock))
    cache = target.engine.kv_cache
    ok(target.run_batch([PrefillCall("b", PROMPT, GREEDY, owner=B)]))
    with_b = cache.num_free_blocks
    ok(target.run_batch([PrefillCall("a1", PROMPT, GREEDY, owner=A), PrefillCall("a2", PROMPT[:3], GREEDY, owner=A)]))
    assert cache.num_free_blocks < with_b
    before = snapshot(target, "b")
    clock.now += 20
    target.leases.renew(B)  # B's Info heartbeat
    clock.now += 15
    assert sorted(e.seq_id for e in target.reclaim()) == ["a1", "a2"]
    assert cache.num_free_blocks == with_b and set(target.sequences) == {"b"}
    assert not cache.has_sequence("a1") and not cache.has_sequence("a2")
    assert_unchanged(target, "b", before)
    ok(target.run_batch([VerifyCall("b", len(PROMPT) + 1, [5, 6], [], owner=B)]))  # b goes on
    assert target.reclaim() == []


def test_reclaim_frees_a_silent_coordinators_draft_kv(tiny_qwen2_dir, clock):
    draft = DraftEngine(load(tiny_qwen2_dir), Leases(lease_s=30, idle_ttl_s=600, clock=clock))
    cache = draft.engine.kv_cache
    ok(draft.run_batch([ProposeCall("b", 0, PROMPT, 2, GREEDY, owner=B)]))
    ok(draft.run_batch([ProposeCall("a", 0, PROMPT, 2, GREEDY, owner=A)]))
    clock.now += 20
    ok(draft.run_batch([ProposeCall("b", len(PROMPT), [7], 2, GREEDY, owner=B)]))  # a call renews B
    clock.now += 15
    free, held_by_a = cache.num_free_blocks, len(cache.sequence("a").block_ids)
    assert [(e.seq_id, e.reason) for e in draft.reclaim()] == [("a", LEASE)]
    assert cache.num_free_blocks == free + held_by_a and set(draft.sequences) == {"b"}
    assert not cache.has_sequence("a") and cache.has_sequence("b")


def test_a_call_of_another_coordinators_sequence_is_refused_and_changes_nothing(tiny_qwen2_dir, clock):
    target = TargetEngine(load(tiny_qwen2_dir), Leases(clock=clock))
    ok(target.run_batch([PrefillCall("s", PROMPT, GREEDY, owner=A)]))
    before = snapshot(target, "s")
    (refused,) = target.run_batch([VerifyCall("s", len(PROMPT) + 1, [5], [], owner=B)])
    assert isinstance(refused, SequenceOwnedError) and "'s'" in str(refused)
    assert status_for(refused) == grpc.StatusCode.FAILED_PRECONDITION
    assert_unchanged(target, "s", before)
    draft = DraftEngine(load(tiny_qwen2_dir), Leases(clock=clock))
    ok(draft.run_batch([ProposeCall("s", 0, PROMPT, 1, GREEDY, owner=A)]))
    (refused,) = draft.run_batch([ProposeCall("s", 0, PROMPT[:2], 1, GREEDY, owner=B)])  # even starting over
    assert isinstance(refused, SequenceOwnedError)
    assert draft.sequences["s"].tokens[:len(PROMPT)] == PROMPT


def test_a_release_forgets_the_owner(tiny_qwen2_dir, clock):
    target = TargetEngine(load(tiny_qwen2_dir), Leases(lease_s=30, clock=clock))
    ok(target.run_batch([PrefillCall("s", PROMPT, GREEDY, owner=A)]))
    ok(target.run_batch([ReleaseCall("s")]))
    assert target.leases.owner_of("s") is None
    ok(target.run_batch([PrefillCall("s", PROMPT, GREEDY, owner=B)]))  # the id is free again: B may take it
    clock.now += 31
    assert [(e.seq_id, e.owner) for e in target.reclaim()] == [("s", B)]


# ----- the coordinator's side ---------------------------------------------------------------------
class Recorder:
    """A WorkerClient's stub, keeping every request."""

    def __init__(self) -> None:
        self.requests: list = []

    REPLIES = {"Info": common_pb2.WorkerInfo(role="target", tokenizer_fingerprint="fp", lease_s=2.0),
               "Prefill": target_pb2.PrefillResponse(next_token=1), "Verify": target_pb2.VerifyResponse(),
               "Release": common_pb2.ReleaseResponse()}

    def __getattr__(self, method):
        async def call(request, timeout, metadata=None):
            self.requests.append((method, request))
            return self.REPLIES[method]
        return call


def test_the_coordinator_names_itself_in_every_call_and_says_when_it_rebuilds():
    async def scenario():
        client = WorkerClient("127.0.0.1:1", "target", 60.0, owner="me")
        client.stub = recorder = Recorder()
        pool = WorkerPool("target", [client], "fp", owner="me")
        await pool.refresh(client)
        channel = client.for_request(None)
        assert isinstance(channel, RequestChannel)
        await channel.prefill("s", [1, 2], GREEDY)
        await channel.prefill("s", [1, 2, 3], GREEDY, prompt_len=2)  # a rebuild
        await channel.verify("s", 3, [], [])
        await channel.release("s")
        await pool.close()
        return pool, recorder.requests

    pool, requests = asyncio.run(scenario())
    assert [method for method, _ in requests][:2] == ["Info", "Prefill"]
    assert all(request.owner == "me" for method, request in requests if method != "Release")
    prefills = [request for method, request in requests if method == "Prefill"]
    assert [p.replace for p in prefills] == [False, True]
    # A worker with a 2 s lease gets an Info (the heartbeat) every 2/3 s, not once a second.
    assert pool.poll_interval_s(1.0) == pytest.approx(2.0 / 3)


def test_each_pool_names_itself_uniquely_to_the_replicas_that_join():
    async def joined() -> tuple[str, str]:
        pool = WorkerPool("target", [])
        pool.update(["127.0.0.1:1"])
        await pool.close()
        return pool.owner, pool.clients[0].owner

    (first, its_replica), (second, _) = asyncio.run(joined()), asyncio.run(joined())
    assert first == its_replica and first != second
