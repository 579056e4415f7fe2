"""Routing between replicas, the client's deadline on worker calls, and what a worker's failure becomes."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc.aio import Metadata

from coordinator.workers import RequestChannel, WorkerClient, WorkerPool
from tandem import errors
from tandem.rpc.status import status_for, worker_failure
from tandem.sampling_params import SamplingParams
from tandem.v1 import common_pb2, draft_pb2, target_pb2
from tests.virtual_clock import run_on_virtual_clock


def client(address: str, free: int, queue: int = 0, healthy: bool = True, active: int = 0) -> WorkerClient:
    c = WorkerClient.__new__(WorkerClient)  # no channel: routing reads only the last Info
    c.address, c.role, c.call_timeout_s = address, "target", 60.0
    c.info = common_pb2.WorkerInfo(total_blocks=100, free_blocks=free, queue_depth=queue, active_sequences=active)
    c.healthy, c.placed_since_poll, c.active = healthy, 0, 0
    c.verified, c.rejected, c.leaving = True, False, False  # its Info answered with our tokenizer
    c._polls_started = c._poll_judged = 0
    return c


def test_pick_prefers_free_kv_then_a_short_queue_and_skips_unhealthy_replicas():
    pool = WorkerPool("target", [client("a", 50), client("b", 90, healthy=False), client("c", 70, queue=3),
                                 client("d", 70, queue=1)])
    assert pool.pick().address == "d"


def test_a_burst_spreads_over_replicas_before_the_next_poll():
    pool = WorkerPool("target", [client("a", 100), client("b", 95)])
    picks = [pool.pick().address for _ in range(4)]
    assert set(picks) == {"a", "b"}


def test_with_every_replica_unhealthy_the_pool_still_tries_one_and_with_none_it_says_so():
    assert WorkerPool("target", [client("a", 1, healthy=False)]).pick().address == "a"
    with pytest.raises(errors.WorkerUnavailableError, match="no target workers"):
        WorkerPool("target", []).pick()


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, Metadata(), Metadata(), details=details)


@pytest.mark.parametrize("code,kind,status", [
    (grpc.StatusCode.INVALID_ARGUMENT, errors.InternalError, grpc.StatusCode.INTERNAL),
    (grpc.StatusCode.NOT_FOUND, errors.InternalError, grpc.StatusCode.INTERNAL),
    (grpc.StatusCode.FAILED_PRECONDITION, errors.InternalError, grpc.StatusCode.INTERNAL),
    (grpc.StatusCode.INTERNAL, errors.InternalError, grpc.StatusCode.INTERNAL),
    (grpc.StatusCode.UNAVAILABLE, errors.WorkerUnavailableError, grpc.StatusCode.UNAVAILABLE),
    (grpc.StatusCode.DEADLINE_EXCEEDED, errors.WorkerDeadlineError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.KVCacheExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
])
def test_a_worker_failure_is_never_the_clients_fault_and_names_no_address(code, kind, status):
    exc = worker_failure(rpc_error(code, "sequence 'r-1' unknown on 10.0.0.7:50052"), "target", "10.0.0.7:50052")
    assert isinstance(exc, kind) and status_for(exc) == status
    assert "10.0.0.7" not in str(exc) and "r-1" not in str(exc)


def test_a_full_kv_pool_is_flow_control_and_is_not_logged_as_a_warning(caplog):
    """A burst refuses prompts as full hundreds of times a minute (each request waits and comes back): those go
    to DEBUG; any other refusal, gRPC's own RESOURCE_EXHAUSTED (a message over its limit) included, warns."""
    import torch

    from tandem.kv_cache import PagedKVCache

    cache = PagedKVCache(num_layers=1, num_blocks=1, block_size=4, num_kv_heads=1, head_dim=2, dtype=torch.float32)
    with pytest.raises(errors.KVCacheExhaustedError) as full:  # the worker's own message, as it is sent
        cache.append_slots({"a": 8})
    caplog.set_level("DEBUG", logger="tandem.rpc.status")
    for details in (str(full.value), "KV cache full: sequence 's' needs 2 more blocks than are free; retry later",
                    "Received message larger than max (5000000 vs. 4194304)"):
        worker_failure(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, details), "target", "10.0.0.7:50052")
    worker_failure(rpc_error(grpc.StatusCode.INTERNAL, "boom"), "target", "10.0.0.7:50052")
    assert [r.levelname for r in caplog.records] == ["DEBUG", "DEBUG", "WARNING", "WARNING"]


class RecordingClient(WorkerClient):  # (hang_timeout from WorkerClient)
    call_timeout_s = 60.0
    streams = 1

    def __init__(self) -> None:
        self.timeouts: list[float] = []

    async def call(self, method, request, timeout, deadline_expected=False, metadata=()):
        self.timeouts.append(timeout)
        return target_pb2.PrefillResponse(next_token=7) if method == "Prefill" else common_pb2.ReleaseResponse()

    def fitted_cost(self):
        return None


def test_worker_calls_carry_the_clients_remaining_time():
    async def scenario():
        recorder = RecordingClient()
        now = asyncio.get_running_loop().time()
        await RequestChannel(recorder, now + 2.0).release("s")  # a release keeps its own short timeout
        assert (await RequestChannel(recorder, now + 2.0).prefill("s", [1], SamplingParams())).next_token == 7
        await RequestChannel(recorder, None).release("s")
        late = RequestChannel(recorder, now - 1.0)
        with pytest.raises(errors.WorkerDeadlineError):
            await late.prefill("s", [1], SamplingParams())
        return recorder.timeouts

    release_timeout, prefill_timeout, _ = run_on_virtual_clock(scenario())
    assert prefill_timeout <= 2.0 and release_timeout == 5.0


def test_a_workers_info_carries_the_last_trusted_line_to_the_heads_budget():
    """Through services a heads loop reads the fit from Info: once its tree sizes stop varying, the current
    slope reads 0, and without the last line the budget fell back to 8 nodes (1.7 steps on a CPU)."""
    from tandem.spec.heads_trees import heads_budget
    from tandem.spec.options import SpecOptions
    from tandem.spec.request import RequestState, StopConditions

    c = client("a", 100)
    c.info = common_pb2.WorkerInfo(forward_base_s=0.095, forward_per_token_s=0.0, last_forward_base_s=0.05,
                                   last_forward_per_token_s=0.005)
    fit = c.fitted_cost()
    assert (fit.last_base_s, fit.last_per_token_s) == (0.05, 0.005)
    assert fit.prompt_token_s == 0.0  # not measured yet: a loop then never keeps its draft waiting
    c.info.prompt_token_s = 0.0016
    assert c.fitted_cost().prompt_token_s == 0.0016  # what a draft's read of a long prompt is weighed with
    state = RequestState([1, 2, 3], SamplingParams(), StopConditions(100))
    assert heads_budget(SpecOptions("eagle", 4), state, 1000, fit) == 2


class TimedClient(WorkerClient):
    """A worker whose every call takes ``seconds[method]`` and whose Info says its model thread has been
    in its current batch for ``batch_running_s`` (None: its Info does not answer; the default: short batches, one
    after another), a batch priced at ``batch_tokens``. A call past the time it is given raises what gRPC's
    DEADLINE_EXCEEDED becomes."""

    call_timeout_s = 60.0
    streams = 1
    address = "10.0.0.7:50052"

    def __init__(self, seconds: dict[str, float], prompt_token_s: float = 0.03,
                 batch_running_s: float | None = 0.5, batch_tokens: int = 0) -> None:
        from tandem.spec.transport import FittedCost

        self.seconds, self.timeouts, self.healthy, self.role = seconds, {}, True, "target"
        self.fit = FittedCost(0.3, 0.02, prompt_token_s=prompt_token_s)
        self.batch_running_s, self.batch_tokens = batch_running_s, batch_tokens
        self.asked = 0  # times it was asked whether it computes
        self.busy_waits = 0
        self.hangs_at: float | None = None  # its model thread stops in a batch this long after its first call
        self.started = 0.0

    async def call(self, method, request, timeout, deadline_expected=False, metadata=()):
        self.timeouts[method] = timeout
        self.started = self.started or asyncio.get_running_loop().time()
        seconds = self.seconds[method]
        if timeout is not None and seconds > timeout:
            await asyncio.sleep(timeout)
            raise errors.WorkerDeadlineError("deadline exceeded")
        await asyncio.sleep(seconds)
        replies = {"Prefill": target_pb2.PrefillResponse(next_token=7), "Verify": target_pb2.VerifyResponse(),
                   "Propose": draft_pb2.ProposeResponse()}
        return replies[method]

    async def batch_time_left(self) -> float | None:  # WorkerClient.batch_time_left's rule, over the Info described
        self.asked += 1
        running = self.batch_running_s
        if self.hangs_at is not None:  # short batches until then, and then one that never ends
            since = asyncio.get_running_loop().time() - self.started - self.hangs_at
            running = max(0.0, since)
        if running is None or running > self.hang_timeout(self.batch_tokens):
            return None
        return self.hang_timeout(self.batch_tokens) - running

    def fitted_cost(self):
        return self.fit

    def read_prompt(self, prompt_ids) -> None:
        pass


def test_a_long_prompt_is_work_not_a_hang_and_the_hang_timeout_still_catches_a_stuck_call():
    """A 5,128-token prompt took a 1.5B target 152 s on a 2-core CPU: under the bare 60 s call timeout its worker
    was taken for hung and the request moved, reading the prompt again each time, until it failed."""
    long_prompt = list(range(5128))

    async def scenario(client, deadline_s=None):
        now = asyncio.get_running_loop().time()
        channel = RequestChannel(client, None if deadline_s is None else now + deadline_s)
        return await channel.prefill("s", long_prompt, SamplingParams()), channel

    worker = TimedClient({"Prefill": 152.0, "Verify": 61.0}, batch_running_s=70.0)  # one batch, 70 s and counting
    prefilled, channel = run_on_virtual_clock(scenario(worker))
    assert prefilled.next_token == 7 and worker.healthy and worker.asked == 0  # within its price: never in doubt
    assert channel.hang_timeout(len(long_prompt)) == pytest.approx(60.0 + 4 * 5128 * 0.03)  # its price x 4
    assert worker.timeouts["Prefill"] is None  # the gRPC call carries the client's deadline only
    # a call with no prompt to read keeps the bare timeout: past it, with the worker's batch older than that, the
    # worker is hung, and the request moves
    with pytest.raises(errors.WorkerUnavailableError, match="did not answer in time"):
        run_on_virtual_clock(channel.verify("s", 5128, [1, 2], []))
    assert worker.asked == 1 and not worker.healthy

    # so is a prompt read that outlasts its price by more than the margin
    stuck = TimedClient({"Prefill": 60.0 + 4 * 5128 * 0.03 + 200}, batch_running_s=700.0, batch_tokens=5128)
    with pytest.raises(errors.WorkerUnavailableError):
        run_on_virtual_clock(scenario(stuck))
    assert not stuck.healthy
    # and the client's own deadline still bounds it, without blaming the worker
    impatient = TimedClient({"Prefill": 152.0})
    with pytest.raises(errors.WorkerDeadlineError):
        run_on_virtual_clock(scenario(impatient, deadline_s=100.0))
    assert impatient.timeouts["Prefill"] <= 100.0 and impatient.healthy


def test_a_call_queued_behind_a_busy_workers_batches_waits_and_a_silent_or_stuck_worker_is_hung():
    """A burst of eight 1,500-token prompts on one 1.5B target: each prompt was read a chunk per step beside the
    others, the last ones answered after about 300 s, past their 183 s hang timeout, and the coordinator took the
    healthy worker for hung seven times (each request read its prompt again)."""
    async def verify(client, deadline_s=None):
        now = asyncio.get_running_loop().time()
        channel = RequestChannel(client, None if deadline_s is None else now + deadline_s)
        return await channel.verify("s", 10, [1, 2], [])

    busy = TimedClient({"Verify": 200.0})  # three hang timeouts and more, while batches of 0.5 s come and go
    run_on_virtual_clock(verify(busy))
    assert busy.healthy and busy.asked == 3 and busy.busy_waits == 3  # (tandem_coordinator_busy_waits_total)
    # a batch of many prompts at once (chunking off) runs long, and is still work: its price says how long
    burst = TimedClient({"Verify": 200.0}, batch_running_s=150.0, batch_tokens=15 * 2000)
    run_on_virtual_clock(verify(burst))
    assert burst.healthy and burst.asked == 3
    silent = TimedClient({"Verify": 200.0}, batch_running_s=None)  # its Info does not answer (a stopped process)
    with pytest.raises(errors.WorkerUnavailableError):
        run_on_virtual_clock(verify(silent))
    assert not silent.healthy and silent.asked == 1 and silent.busy_waits == 0
    stuck = TimedClient({"Verify": 200.0}, batch_running_s=90.0, batch_tokens=6)  # a 6-token batch running 90 s
    with pytest.raises(errors.WorkerUnavailableError):
        run_on_virtual_clock(verify(stuck))
    assert not stuck.healthy and stuck.asked == 1
    # a worker that computes yet never answers this call is taken for hung after MAX_BUSY_WAITS more timeouts
    from coordinator.workers import MAX_BUSY_WAITS

    never = TimedClient({"Verify": 1e9})
    waited = run_on_virtual_clock(timed(verify(never)))
    assert isinstance(waited[1], errors.WorkerUnavailableError)
    assert not never.healthy and never.asked == MAX_BUSY_WAITS
    assert waited[0] == pytest.approx((MAX_BUSY_WAITS + 1) * 60.0)
    # the client's deadline ends the wait first, and is the client's, not the worker's, fault
    patient_until = TimedClient({"Verify": 1e9})
    with pytest.raises(errors.WorkerDeadlineError):
        run_on_virtual_clock(verify(patient_until, deadline_s=150.0))
    assert patient_until.healthy and patient_until.asked == 2


async def timed(call) -> tuple[float, Exception | None]:
    """Seconds ``call`` took (loop time), and what it raised."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    try:
        await call
    except Exception as exc:  # noqa: BLE001 (the caller asserts what it was)
        return loop.time() - start, exc
    return loop.time() - start, None


def test_a_worker_that_hangs_just_after_a_look_is_hung_once_that_batch_passes_its_price_not_a_timeout_later():
    """A call outlasts its 60 s hang timeout; the worker's Info says a batch has run 55 s of the 60 s its price allows,
    and that batch never ends. The next look used to come a whole timeout later (120 s); it comes just after the batch
    passes its price."""
    async def verify(client):
        return await RequestChannel(client, None).verify("s", 10, [1, 2], [])

    hung = TimedClient({"Verify": 1e9})
    hung.hangs_at = 5.0  # its model thread stops 5 s after the call starts
    seconds, raised = run_on_virtual_clock(timed(verify(hung)))
    assert isinstance(raised, errors.WorkerUnavailableError) and not hung.healthy
    assert hung.asked == 2 and hung.busy_waits == 1  # computing at 60 s (5 s left), hung at the next look
    assert seconds == pytest.approx(60.0 + 5.0 + 60.0 / 16)  # where a look a timeout later took 120 s
    # a worker whose batches stay within their price is still waited on, one look per timeout
    busy = TimedClient({"Verify": 130.0})
    assert run_on_virtual_clock(timed(verify(busy)))[1] is None and busy.asked == 2 and busy.healthy


def test_a_worker_is_computing_when_its_info_says_a_young_batch_runs_and_not_when_it_cannot_say():
    class Stub:
        def __init__(self, reply):
            self.reply, self.calls = reply, 0

        async def Info(self, request, timeout):
            self.calls += 1
            await asyncio.sleep(0.01)
            if isinstance(self.reply, Exception):
                raise self.reply
            return self.reply

    async def computing(reply, callers=1):
        worker = client("a", 100)  # call timeout 60 s
        worker.closed, worker.owner, worker._asking, worker.prompt_blocks = False, "", None, None
        worker.stub = Stub(reply)
        answers = await asyncio.gather(*(worker.batch_time_left() for _ in range(callers)))
        answers = [None if left is None else round(left, 6) for left in answers]
        return answers, worker.stub.calls

    def info(running_s=None, tokens=0):
        return common_pb2.WorkerInfo(step_running_s=running_s, step_tokens=tokens, forward_base_s=0.3,
                                     prompt_token_s=0.03)

    # the seconds its current batch may still run before it passes its own price; None: hung
    assert run_on_virtual_clock(computing(info(0.0))) == ([60.0], 1)  # between batches
    assert run_on_virtual_clock(computing(info(12.0, tokens=8))) == ([60.0 + 4 * 8 * 0.03 - 12.0], 1)
    # 8 tokens may take 60 s + 4 x their price
    assert run_on_virtual_clock(computing(info(75.0, tokens=8))) == ([None], 1)
    assert run_on_virtual_clock(computing(info(75.0, tokens=2000))) == ([225.0], 1)  # 2,000 may take 60 s + 240 s
    assert run_on_virtual_clock(computing(info(301.0, tokens=2000))) == ([None], 1)
    assert run_on_virtual_clock(computing(common_pb2.WorkerInfo())) == ([None], 1)  # a worker too old to say
    assert run_on_virtual_clock(computing(rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Info"))) == ([None], 1)
    # the calls that outlast their timeouts together ask once
    assert run_on_virtual_clock(computing(info(1.0), callers=5)) == ([59.0] * 5, 1)


def test_an_info_answer_that_comes_after_a_newer_polls_does_not_overrule_it():
    """Discovery's first poll of a worker still warming up was refused; its refusal reached the coordinator after a
    later poll had found the worker serving, and the serving worker was marked unhealthy (a CI failure)."""
    from coordinator.prefix_mirror import PrefixMirror

    class Stub:  # every Info waits until the test answers it
        def __init__(self):
            self.pending: list[asyncio.Future] = []

        async def Info(self, request, timeout):
            self.pending.append(asyncio.get_running_loop().create_future())
            return await self.pending[-1]

    async def scenario():
        worker = client("a", 100, healthy=False)
        worker.closed, worker.owner, worker._asking, worker.prompt_blocks = False, "", None, PrefixMirror()
        worker.stub = Stub()
        serving = common_pb2.WorkerInfo(role="target", free_blocks=80)
        refused = rpc_error(grpc.StatusCode.UNAVAILABLE, "the target worker is starting")
        while_warming, once_serving = (asyncio.ensure_future(worker.refresh()) for _ in range(2))
        await asyncio.sleep(0)
        worker.stub.pending[1].set_result(serving)
        assert await once_serving == grpc.StatusCode.OK and worker.healthy
        worker.stub.pending[0].set_exception(refused)
        assert await while_warming == grpc.StatusCode.UNAVAILABLE
        assert worker.healthy and worker.info is serving and worker.last_failure == ""
        # and the other way round: a worker found gone is not made healthy by an older poll's late answer
        before_it_died, after = (asyncio.ensure_future(worker.refresh()) for _ in range(2))
        await asyncio.sleep(0)
        worker.stub.pending[3].set_exception(refused)
        assert await after == grpc.StatusCode.UNAVAILABLE and not worker.healthy
        worker.stub.pending[2].set_result(common_pb2.WorkerInfo(role="target", free_blocks=1))
        await before_it_died
        assert not worker.healthy and worker.info is serving

    run_on_virtual_clock(scenario())


def test_a_draft_reading_a_prompt_gets_the_time_its_price_says():
    async def scenario():
        draft = TimedClient({"Propose": 70.0}, prompt_token_s=0.007, batch_running_s=65.0)
        draft.role = "draft"
        channel = RequestChannel(draft, None)
        await channel.propose("s", 0, list(range(5128)), 4, SamplingParams(), prompt_len=5128)
        with pytest.raises(errors.WorkerUnavailableError):  # a round's few new tokens: about the bare timeout
            await RequestChannel(draft, None).propose("s", 5130, [1, 2], 4, SamplingParams())
        return draft.asked

    assert run_on_virtual_clock(scenario()) == 1


def test_a_pools_busy_waits_are_counted_across_its_replicas_and_kept_when_one_is_closed():
    from prometheus_client import CollectorRegistry, generate_latest

    from tandem.rpc.metrics import CoordinatorMetrics

    a, b = client("a", 100), client("b", 100)
    a.busy_waits, b.busy_waits = 3, 2
    pool = WorkerPool("target", [a, b])
    assert pool.busy_waits() == 5
    b.leaving, b.active = True, 0
    pool._spawn = lambda work: work.close()  # (sweep closes the channel in the background; there is none here)
    pool.sweep()
    assert pool.clients == [a] and pool.busy_waits() == 5  # a counter never goes back
    registry = CollectorRegistry()
    CoordinatorMetrics(registry, busy_waits=lambda: {"target": pool.busy_waits(), "draft": 0})
    text = generate_latest(registry).decode()
    assert 'tandem_coordinator_busy_waits_total{role="target"} 5.0' in text
    assert 'tandem_coordinator_busy_waits_total{role="draft"} 0.0' in text


def test_a_prefill_tells_its_target_of_the_waiting_requests_placed_there_only_in_order():
    """``PrefillRequest.queued``: the coordinator's other requests waiting for room whose next Prefill goes to the same
    worker, in the room queue's order, each with its arrival, tokens, max_len and priority; not itself, and not those
    placed on another replica (they would hold room there for prompts that never come)."""
    from tandem.spec.room_queue import RoomQueue

    here, there = client("a", 10), client("b", 10)
    room = RoomQueue()
    channels = {name: RequestChannel(here if name != "elsewhere" else there, None, "", 40 + i, 0, 100.0 + i, room)
                for i, name in enumerate(["asker", "second", "elsewhere", "third"])}
    for i, name in enumerate(channels):
        room.join((0, float(i)), name, lambda name=name: channels[name], lambda i=i: 10 * (i + 1))
    queued = channels["asker"]._queued("asker")
    assert [(q.seq_id, q.arrival_time, q.tokens, q.max_len) for q in queued] == [
        ("second", 101.0, 20, 41), ("third", 103.0, 40, 43)]
