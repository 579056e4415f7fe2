"""A sequence id names one request on a worker: a Prefill never takes over a live one by accident.

Clients reuse request ids, so two requests could once land on one worker with one sequence id,
and the second Prefill replaced the first request's state (one client could then receive the
other's tokens). Now a Prefill of a live id is refused (FAILED_PRECONDITION, naming the id) and
the live sequence is left exactly as it was; only a rebuild, which says so (``replace``), may
replace it. In the engine, then through a real TargetService over gRPC.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch

from tandem.compute_thread import CallingThreadExecutor
from tandem.config import EngineConfig
from tandem.engine import ModelEngine
from tandem.rpc.batcher import Batcher
from tandem.rpc.sequence_engine import SequenceOwnedError
from tandem.sampling import SamplingParams
from tandem.v1 import target_pb2, target_pb2_grpc
from target_worker.engine import PrefillCall, TargetEngine, VerifyCall
from target_worker.service import TargetService
from tests.serving import managed_server, serving
from tests.target_worker.test_engine import (
    assert_unchanged,
    kv_of,
    ok,
    one_thread,  # noqa: F401 - autouse: one torch thread
    snapshot,
)

PROMPT = [3, 14, 15, 92, 65, 35, 89]
GREEDY = SamplingParams()


@pytest.fixture
def target(tiny_qwen2_dir) -> TargetEngine:
    return TargetEngine(ModelEngine.load(
        EngineConfig(tiny_qwen2_dir, dtype="bfloat16", kv_cache_tokens=512, block_size=4)))


def test_a_second_prefill_of_a_live_id_is_refused_and_the_first_sequence_is_untouched(target):
    ok(target.run_batch([PrefillCall("r-1", PROMPT, SamplingParams(temperature=1.0, seed=3), owner="c")]))
    ok(target.run_batch([VerifyCall("r-1", len(PROMPT) + 1, [5, 6], [], owner="c")]))
    before = snapshot(target, "r-1")
    free = target.engine.kv_cache.num_free_blocks
    # Another request with the same id (or a stray repeat), from the same coordinator and from another.
    for owner in ("c", "other"):
        (refused,) = target.run_batch([PrefillCall("r-1", [7, 8, 9], GREEDY, owner=owner)])
        assert isinstance(refused, SequenceOwnedError) and "'r-1'" in str(refused)
        assert_unchanged(target, "r-1", before)
        assert target.sequences["r-1"].sampling.temperature == 1.0
        assert target.engine.kv_cache.num_free_blocks == free


def test_a_rebuild_that_says_so_replaces_a_live_sequence(target):
    ok(target.run_batch([PrefillCall("s", PROMPT, GREEDY, owner="c")]))
    for drafts in ([1, 2, 3], [4, 5]):
        ok(target.run_batch([VerifyCall("s", len(target.sequences["s"].history), drafts, [], owner="c")]))
    history = list(target.sequences["s"].history)
    kv = kv_of(target.engine, "s").clone()
    ok(target.run_batch([VerifyCall("s", len(history), [6, 7, 8], [], owner="c")]))  # moves on past `history`
    # The coordinator rebuilds s from the history it committed (a preemption, or a replica that came back).
    (echo,) = ok(target.run_batch([PrefillCall("s", history, GREEDY, prompt_len=len(PROMPT), owner="c",
                                               replace=True)]))
    assert echo.next_token == history[-1] and target.sequences["s"].history == history
    assert torch.equal(kv_of(target.engine, "s"), kv)


def test_over_grpc_a_duplicate_prefill_is_failed_precondition_and_a_rebuild_is_accepted(target):
    async def scenario():
        # On the thread that built the engine (the loop's), as a worker's one model thread does.
        batcher = Batcher(target.run_batch, target.call_cost, 2048, key=lambda call: call.seq_id,
                          executor=CallingThreadExecutor())
        batcher.start()
        server = managed_server(role="target")
        server.add_service(target_pb2_grpc.add_TargetWorkerServicer_to_server,
                           TargetService(target, batcher, server, "tiny", "fp", []), "tandem.v1.TargetWorker")
        try:
            async with serving(server) as address, grpc.aio.insecure_channel(address) as channel:
                stub = target_pb2_grpc.TargetWorkerStub(channel)
                first = await stub.Prefill(target_pb2.PrefillRequest(seq_id="req-7", token_ids=PROMPT, owner="c"))
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await stub.Prefill(target_pb2.PrefillRequest(seq_id="req-7", token_ids=[9, 9], owner="c"))
                history = [*PROMPT, first.next_token]
                assert list(target.sequences["req-7"].history) == history
                rebuilt = await stub.Prefill(target_pb2.PrefillRequest(
                    seq_id="req-7", token_ids=history, prompt_len=len(PROMPT), owner="c", replace=True))
                return refused.value, rebuilt.next_token, history
        finally:
            await batcher.stop()

    refused, echo, history = asyncio.run(scenario())
    assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION and "req-7" in refused.details()
    assert echo == history[-1]
