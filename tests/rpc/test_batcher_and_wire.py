"""Continuous batching and the wire format of distributions."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tandem.rpc.batcher import Batcher
from tandem.rpc.wire import MIN_WIRE_PROB, decode_distribution, encode_distribution, wire_roundtrip


def test_calls_waiting_together_run_in_one_batch_within_the_budget():
    seen: list[list[int]] = []
    gate = threading.Event()

    def run_batch(items: list[int]) -> list[int | BaseException]:
        gate.wait(5)  # hold the first batch so the rest queue up behind it
        seen.append(items)
        return [ValueError(f"bad {i}") if i == 13 else i * 10 for i in items]

    async def scenario():
        batcher = Batcher(run_batch, cost=lambda i: 2, token_budget=6)
        batcher.start()
        first = asyncio.create_task(batcher.submit(0))
        await asyncio.sleep(0.05)
        rest = [asyncio.create_task(batcher.submit(i)) for i in (1, 2, 13, 4)]
        await asyncio.sleep(0.05)
        assert batcher.queue_depth == 4
        gate.set()
        results = await asyncio.gather(first, *rest, return_exceptions=True)
        await batcher.stop()
        return results

    results = asyncio.run(scenario())
    assert results[:3] == [0, 10, 20] and results[4] == 40
    assert isinstance(results[3], ValueError) and "bad 13" in str(results[3])
    assert seen == [[0], [1, 2, 13], [4]]  # 3 calls x 2 tokens fill the budget of 6


def test_a_failing_batch_fails_each_of_its_calls_and_the_loop_goes_on():
    calls = []

    def run_batch(items):
        calls.append(items)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return items

    async def scenario():
        batcher = Batcher(run_batch, cost=lambda i: 1, token_budget=10)
        batcher.start()
        with pytest.raises(RuntimeError, match="boom"):
            await batcher.submit(1)
        value = await batcher.submit(2)
        await batcher.stop()
        return value

    assert asyncio.run(scenario()) == 2


def test_batches_wait_for_every_cycling_sequence():
    """Sequences a, b, c called together; when a comes back alone, the batch waits for b and c."""
    seen: list[list[str]] = []

    def run_batch(items):
        seen.append(items)
        return items

    async def scenario(gather_s: float, forget: str | None):
        batcher = Batcher(run_batch, cost=lambda i: 1, token_budget=10, key=lambda item: item[0],
                          gather_wait_s=lambda: gather_s)
        batcher.start()
        await asyncio.gather(*(batcher.submit(s) for s in ("a1", "b1", "c1")))
        if forget:
            batcher.forget(forget)
        first = asyncio.create_task(batcher.submit("a2"))
        await asyncio.sleep(0.1)
        rest = [asyncio.create_task(batcher.submit(s)) for s in ("b2", "c2") if s[0] != forget]
        await asyncio.gather(first, *rest)
        await batcher.stop()

    asyncio.run(scenario(5.0, None))
    assert seen[-1] == ["a2", "b2", "c2"]  # one full batch
    seen.clear()
    asyncio.run(scenario(0.0, None))
    assert seen[1:] == [["a2"], ["b2", "c2"]]  # no gathering: a2 ran alone
    seen.clear()
    asyncio.run(scenario(5.0, "c"))
    assert seen[1:] == [["a2", "b2"]]  # c was released: nobody waits for it


def test_gathering_gives_up_after_its_wait():
    async def scenario():
        batcher = Batcher(lambda items: items, cost=lambda i: 1, token_budget=10, key=lambda item: item[0],
                          gather_wait_s=lambda: 0.2)
        batcher.start()
        await asyncio.gather(batcher.submit("a1"), batcher.submit("b1"))
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        value = await batcher.submit("a2")  # b never calls again
        waited = loop.time() - t0
        await batcher.stop()
        return value, waited

    value, waited = asyncio.run(scenario())
    assert value == "a2" and 0.15 < waited < 3.0


def test_wire_distribution_roundtrip_is_what_both_sides_use():
    q = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 3, -1)
    msg = encode_distribution(q)
    dense = decode_distribution(msg, 1000)
    assert dense.sum().item() == pytest.approx(1.0, abs=1e-6)
    assert torch.equal(dense, decode_distribution(msg, 1000))  # deterministic: draft and target agree exactly
    assert (dense[q < MIN_WIRE_PROB] == 0).all()
    assert (dense - q).abs().max().item() < 1e-3
    assert torch.equal(wire_roundtrip(q[None])[0], dense)


@pytest.mark.parametrize("ids,probs,message", [
    ([1, 2], b"\x00\x3c", "2 token ids but 1 probabilities"),
    ([5000], b"\x00\x3c", "token ids must be in 0..999"),
    ([1], b"\x00\x00", "no probability mass"),
])
def test_malformed_distributions_are_refused(ids, probs, message):
    from tandem.v1 import common_pb2

    with pytest.raises(ValueError, match=message):
        decode_distribution(common_pb2.SparseDistribution(token_ids=ids, probs_fp16=probs), 1000)
