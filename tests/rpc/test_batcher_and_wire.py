"""Continuous batching (and its model thread), Release through the batcher, and the wire format of distributions."""

from __future__ import annotations

import ast
import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tandem.errors import InvalidRequestError
from tandem.rpc import distributions
from tandem.rpc.batcher import CALLS_SMOOTHING, Batcher
from tandem.rpc.calls import ReleaseCall
from tandem.rpc.distributions import MIN_WIRE_PROB, decode_distributions, encode_distributions, encode_for_sampling
from tandem.v1 import common_pb2


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


def test_the_batcher_counts_the_computing_calls_its_steps_hold():
    """Info's ``calls_per_batch``: releases (cost 0) are not counted, and the first step sets the mean at once."""
    gate = threading.Event()

    def run_batch(items: list[int]) -> list[int]:
        gate.wait(5)
        return items

    async def scenario() -> list[float]:
        batcher = Batcher(run_batch, cost=lambda i: 0 if i < 0 else 1, token_budget=10)
        batcher.start()
        seen = [batcher.calls_per_batch]
        first = asyncio.create_task(batcher.submit(1))
        await asyncio.sleep(0.05)  # the first step runs alone, held at the gate; three calls and a release queue
        rest = [asyncio.create_task(batcher.submit(i)) for i in (2, 3, 4, -1)]
        await asyncio.sleep(0.05)
        seen.append(batcher.calls_per_batch)
        gate.set()
        await asyncio.gather(first, *rest)
        seen.append(batcher.calls_per_batch)
        alone = await batcher.submit(-2)  # a step of releases only counts nothing
        seen.append(batcher.calls_per_batch)
        await batcher.stop()
        assert alone == -2
        return seen

    before, first, both, after_release = asyncio.run(scenario())
    assert before == 0.0 and first == 1.0
    assert both == pytest.approx(1.0 + CALLS_SMOOTHING * (3 - 1.0))  # then a step of 3 computing calls, averaged in
    assert after_release == both


def test_the_batcher_says_how_long_its_running_batch_has_taken_and_zero_between_batches():
    """What a worker's Info reports as ``step_running_s``: a coordinator tells a busy worker from a hung one by it."""
    started, release = threading.Event(), threading.Event()

    def run_batch(items):
        started.set()
        release.wait(10)
        return items

    async def scenario():
        batcher = Batcher(run_batch, cost=lambda i: 1, token_budget=10)
        batcher.start()
        idle = batcher.step_running_s
        call = asyncio.ensure_future(batcher.submit(1))
        await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
        await asyncio.sleep(0.2)
        running = batcher.step_running_s
        release.set()
        await call
        after = batcher.step_running_s
        await batcher.stop()
        return idle, running, after

    idle, running, after = asyncio.run(scenario())
    assert idle == 0.0 and after == 0.0
    assert 0.2 <= running < 10


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


def test_a_sequence_whose_call_failed_is_not_waited_for():
    """A prompt refused for a full pool comes back only after its backoff: the next batch must not wait for it."""
    seen: list[list[str]] = []

    def run_batch(items):
        seen.append(items)
        return [ValueError("refused") if item[0] == "r" else item for item in items]

    async def scenario():
        batcher = Batcher(run_batch, cost=lambda i: 1, token_budget=10, key=lambda item: item[0],
                          gather_wait_s=lambda: 5.0)
        batcher.start()
        results = await asyncio.gather(*(batcher.submit(s) for s in ("a1", "b1", "r1")), return_exceptions=True)
        assert isinstance(results[2], ValueError)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        both = await asyncio.gather(batcher.submit("a2"), batcher.submit("b2"))
        waited = loop.time() - t0
        await batcher.stop()
        return both, waited

    both, waited = asyncio.run(scenario())
    assert both == ["a2", "b2"] and seen[-1] == ["a2", "b2"]
    assert waited < 2.5  # not the 5 s gathering for r


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


def test_batchers_sharing_an_executor_never_compute_at_the_same_time():
    """A draft's and a target's batcher in one process: one model thread, one batch at a time."""
    running, overlaps, threads = [0], [0], set()
    lock = threading.Lock()

    def run_batch(items):
        with lock:
            running[0] += 1
            overlaps[0] = max(overlaps[0], running[0])
            threads.add(threading.get_ident())
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        return items

    shared = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")

    async def scenario():
        batchers = [Batcher(run_batch, cost=lambda i: 1, token_budget=2, executor=shared) for _ in range(2)]
        for b in batchers:
            b.start()
        results = await asyncio.gather(*(batchers[i % 2].submit(i) for i in range(20)))
        for b in batchers:
            await b.stop()
        return results

    assert asyncio.run(scenario()) == list(range(20))
    assert overlaps[0] == 1 and len(threads) == 1
    assert shared.submit(lambda: 7).result(5) == 7  # stop() leaves an executor it does not own running
    shared.shutdown()


def test_batchers_with_their_own_threads_may_compute_at_the_same_time():
    """The default is unchanged: each batcher has its own model thread (so the test above means something)."""
    both_in = threading.Barrier(2, timeout=5)

    def run_batch(items):
        both_in.wait()  # passes only if the two batchers' batches run at once
        return items

    async def scenario():
        batchers = [Batcher(run_batch, cost=lambda i: 1, token_budget=10) for _ in range(2)]
        for b in batchers:
            b.start()
        results = await asyncio.gather(batchers[0].submit("a"), batchers[1].submit("b"))
        for b in batchers:
            await b.stop()
        return results

    assert asyncio.run(scenario()) == ["a", "b"]


def test_release_goes_through_the_batcher_on_the_model_thread():
    from tandem.rpc.worker_service import WorkerServiceBase

    seen = []

    def run_batch(calls):
        seen.append((threading.current_thread().name, calls))
        return [isinstance(c, ReleaseCall) and c.seq_id == "held" for c in calls]

    async def scenario():
        batcher = Batcher(run_batch, cost=lambda c: 0, token_budget=10, key=lambda c: c.seq_id,
                          gather_wait_s=lambda: 5.0)
        batcher.start()
        service = WorkerServiceBase(None, batcher, None, "m", "fp", [])
        replies = [await service.Release(common_pb2.ReleaseRequest(seq_id=s), None) for s in ("held", "other")]
        recent = [set(keys) for keys in batcher._recent]
        await batcher.stop()
        return replies, recent

    replies, recent = asyncio.run(scenario())
    assert [r.released for r in replies] == [True, False]
    assert [(name.startswith("model"), calls) for name, calls in seen] == [
        (True, [ReleaseCall("held")]), (True, [ReleaseCall("other")])]
    assert recent == [set(), set()]  # forgotten: no later batch waits for a released sequence


def test_a_release_whose_caller_gave_up_still_frees_the_sequence():
    """A coordinator's Release can time out while queued behind forward passes; the KV must be freed anyway."""
    from tandem.rpc.worker_service import WorkerServiceBase

    released, busy = [], threading.Event()

    def run_batch(calls):
        if any(c == "forward" for c in calls):
            busy.wait(10)  # a long forward pass: the release queues behind it
        released.extend(c.seq_id for c in calls if isinstance(c, ReleaseCall))
        return [True] * len(calls)

    async def scenario():
        batcher = Batcher(run_batch, cost=lambda c: 0, token_budget=10)
        batcher.start()
        service = WorkerServiceBase(None, batcher, None, "m", "fp", [])
        forward = asyncio.ensure_future(batcher.submit("forward"))
        await asyncio.sleep(0.05)  # the forward is running on the model thread
        release = asyncio.ensure_future(service.Release(common_pb2.ReleaseRequest(seq_id="s1"), None))
        await asyncio.sleep(0.05)
        release.cancel()  # what gRPC does to the handler when the caller's deadline passes
        busy.set()
        await forward
        for _ in range(200):
            if released:
                break
            await asyncio.sleep(0.01)
        await batcher.stop()
        return release.cancelled()

    assert asyncio.run(scenario()) and released == ["s1"]


# ----- distributions on the wire ---------------------------------------------------

VOCAB = 151_936


def reference_encode(row: torch.Tensor) -> common_pb2.SparseDistribution:
    """The straightforward encoder (the old one): one row at a time, ids >= MIN_WIRE_PROB, float16 values."""
    ids = torch.nonzero(row >= MIN_WIRE_PROB).squeeze(-1)
    values = row[ids].to(torch.float16).cpu().numpy().astype("<f2")
    return common_pb2.SparseDistribution(token_ids=ids.tolist(), probs_fp16=values.tobytes())


def random_q(rows: int = 8, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    """Rows from very peaked to flat, some top-k filtered (exact zeros)."""
    gen = torch.Generator().manual_seed(seed)
    scales = torch.linspace(0.5, 12.0, rows)[:, None]
    logits = torch.randn(rows, vocab, generator=gen) * scales
    logits[::3, vocab // 2 :] = float("-inf")
    return torch.softmax(logits, -1)


def test_batched_encoding_equals_the_reference_encoder_row_by_row():
    q = random_q(rows=4, vocab=20_000)
    cut = torch.tensor(MIN_WIRE_PROB, dtype=q.dtype)  # the cut in q's own precision
    q[1, 7] = cut  # exactly at the cut: kept
    q[1, 8] = torch.nextafter(cut, torch.tensor(0.0))  # just under: dropped
    got = encode_distributions(q)
    assert got == [reference_encode(row) for row in q]
    assert 7 in got[1].token_ids and 8 not in got[1].token_ids
    assert encode_distributions(q[:0]) == []


def test_the_draft_samples_from_exactly_what_the_target_decodes():
    """encode_for_sampling: decode(messages) equals, bit for bit, the q the draft draws from."""
    q = random_q()
    wire = encode_for_sampling(q)
    assert wire.messages == encode_distributions(q)
    # What travels through gRPC: serialised and parsed back, then decoded by the target.
    received = [common_pb2.SparseDistribution.FromString(m.SerializeToString()) for m in wire.messages]
    decoded = decode_distributions(received, VOCAB)
    assert torch.equal(decoded, wire.dense())
    for row, (ids, probs) in enumerate(zip(wire.token_ids, wire.probs)):
        assert torch.equal(decoded[row, torch.from_numpy(ids)], probs)
        assert int((decoded[row] != 0).sum()) == len(ids) and bool((probs > 0).all())


def test_decoded_rows_are_distributions_close_to_q():
    q = random_q()
    decoded = decode_distributions(encode_distributions(q), VOCAB)
    assert torch.allclose(decoded.double().sum(-1), torch.ones(len(q), dtype=torch.float64), atol=1e-5)
    assert (decoded[q < MIN_WIRE_PROB] == 0).all() and (decoded[q >= MIN_WIRE_PROB] > 0).all()
    kept = q >= MIN_WIRE_PROB
    dropped_mass = (q * ~kept).sum(-1, keepdim=True)
    # float16 rounding (relative 2^-11; absolute 2^-25 among subnormals), then renormalising without the dropped mass.
    bound = q * (2**-10 + 2 * dropped_mass) + 2**-24
    assert ((decoded - q).abs() <= bound)[kept].all()


def test_encoding_copies_to_the_host_once_and_never_reads_device_memory_otherwise():
    """GPU safety without a GPU: a tensor subclass standing for device memory records every host access."""
    accesses: list[str] = []

    class DeviceTensor(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            name = getattr(func, "__name__", "")
            if name in {"cpu", "numpy", "tolist", "item", "__array__", "__int__", "__float__", "__bool__",
                        "__index__", "__len__", "__iter__"} or (name == "to" and "cpu" in map(str, args[1:])):
                accesses.append(name)
            out = super().__torch_function__(func, types, args, kwargs or {})
            if name == "cpu":  # now on the host: a plain tensor
                return out.as_subclass(torch.Tensor)
            return out

    q = random_q(rows=3, vocab=5_000)
    on_device = q.as_subclass(DeviceTensor)
    assert encode_distributions(on_device) == encode_distributions(q)
    assert accesses == ["cpu"]
    accesses.clear()
    assert encode_for_sampling(on_device).messages == encode_distributions(q)
    assert accesses == ["cpu"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_encoding_a_cuda_tensor():
    q = random_q(rows=4)
    assert encode_distributions(q.cuda()) == encode_distributions(q)
    assert torch.equal(encode_for_sampling(q.cuda()).dense(), encode_for_sampling(q).dense())


@pytest.mark.parametrize("ids,probs,message", [
    ([1, 2], b"\x00\x3c", "2 token ids but 1 probabilities"),
    ([1], b"\x00\x3c\x00", "1 token ids but 1.5 probabilities"),
    ([5000], b"\x00\x3c", "token ids must be in 0..999"),
    ([-1], b"\x00\x3c", "token ids must be in 0..999"),
    ([3, 3], b"\x00\x3c\x00\x3c", "strictly increasing"),
    ([4, 3], b"\x00\x3c\x00\x3c", "strictly increasing"),
    ([1, 2], b"\x00\x3c\x00\x7e", "finite"),  # NaN
    ([1, 2], b"\x00\x3c\x00\x7c", "finite"),  # inf
    ([1, 2], b"\x00\x3c\x00\xbc", ">= 0"),  # -1.0
    ([1], b"\x00\x00", "no probability mass"),
    ([], b"", "no probability mass"),
])
def test_malformed_distributions_are_refused(ids, probs, message):
    with pytest.raises(InvalidRequestError, match=message):
        decode_distributions([common_pb2.SparseDistribution(token_ids=ids, probs_fp16=probs)], 1000)


def test_the_wire_module_stays_torch_free():
    """The coordinator imports tandem.rpc.wire and must not load torch: distributions live elsewhere."""
    tree = ast.parse(Path(distributions.__file__).with_name("wire.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any(name.split(".")[0] in ("torch", "numpy") for name in imported), imported
    assert not any("distribution" in name for name in imported if name), imported
