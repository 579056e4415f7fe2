"""Clients of the draft and target workers, and the pools that route requests to them.

A ``WorkerClient`` is one replica; ``for_request`` binds it to one request's
deadline, giving the ``Verifier`` / ``DraftChannel`` the speculation loop runs
against (``tandem.spec.transport``). Every call carries the client's deadline,
and has a hang timeout (the internal call timeout, plus the price of the prompt
tokens it reads: ``WorkerClient.hang_timeout``): past it, the worker is asked
whether it is computing, and taken for hung if it does not answer or its
current batch has run past that batch's own price (``RequestChannel._call``).
gRPC failures become the errors a client of the coordinator should see
(``tandem.rpc.status.worker_failure``), naming no internal address.

A pool polls each replica's Info in the background and picks, for a new
request, the healthy replica with the most free KV blocks and the shortest
queue, counting the requests it has itself placed since the last poll so that
a burst spreads out.

Its membership changes while it serves (``update``, fed by discovery,
``coordinator.discovery``): a new replica is used once its Info has answered
with the pool's role and the coordinator's tokenizer fingerprint (another
role or tokenizer: ``rejected``, for as long as its Info says so); a
replica that left is ``leaving``: no new request goes to it, its requests in
flight finish, and it is closed once none is left. One that comes back before
that is simply routable again.

Leases: a pool names itself to its workers with an instance id of its own
(``owner``, made when it starts) in every Prefill, Verify and Propose; each
renews the pool's lease on that worker, and so does every Info poll, which
runs at least every third of the lease a worker reports
(``WorkerInfo.lease_s``). A coordinator that dies or is cut off stops
renewing, and each worker frees the sequences it owned once the lease runs
out (``tandem.rpc.leases``); with many coordinators, only that one's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any

import grpc

from coordinator import prefix_routing
from coordinator.prefix_mirror import PrefixMirror
from tandem.errors import InternalError, WorkerDeadlineError, WorkerUnavailableError
from tandem.rpc.room_waits import MAX_QUEUED
from tandem.rpc.server import GRPC_OPTIONS
from tandem.rpc.status import worker_failure
from tandem.rpc.tls import ClientTLS, open_channel
from tandem.rpc.wire import logprobs_from_proto, proposal_from_proto, sampling_to_proto
from tandem.sampling_params import SamplingParams
from tandem.spec.adaptive import IN_FLIGHT_TOKENS
from tandem.spec.room_queue import RoomQueue
from tandem.spec.transport import Drafted, FittedCost, Prefilled, Verified
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

log = logging.getLogger(__name__)

INFO_TIMEOUT_S = 2.0
RELEASE_TIMEOUT_S = 5.0  # a release is best effort, and runs even after the client's deadline
# A call that reads a prompt may take this many times the prompt's price on its worker (Info's prompt_token_s)
# beyond the internal call timeout before the worker passes for hung: the price is measured on a short prompt,
# attention makes a long one's tokens dearer (about 2x at 16k tokens on a 1.5B model), and the worker computes
# it a chunk per step beside the streams it serves.
PROMPT_TIME_MARGIN = 4.0
REPLACEMENT_POLL_S = 0.5  # while a request waits for a healthy replica to move to
# A call that outlasts its hang timeout while its worker keeps computing waits at most this many more timeouts in all:
# a backstop against a call a working worker never answers (the client's deadline, where it set one, bounds it first).
MAX_BUSY_WAITS = 16
# While a call waits on a computing worker, it looks again (an Info) this fraction of its own hang timeout after the
# batch running there would pass its own price: the slack keeps a look from landing on that instant.
LOOK_SLACK_FRACTION = 1 / 16
HEARTBEAT_FRACTION = 1 / 3  # an Info poll at least this often per worker lease: two may be lost in a row


def new_owner_id() -> str:
    """An id no other coordinator has: host (the pod's name in Kubernetes), pid, and 64 random bits.
    Workers log it when they free what it left behind."""
    return f"{socket.gethostname()}/{os.getpid()}/{uuid.uuid4().hex[:16]}"


class WorkerClient:
    """One worker replica: a channel, its stub, and its last known capacity."""

    def __init__(self, address: str, role: str, call_timeout_s: float, tls: ClientTLS | None = None,
                 owner: str = "") -> None:
        self.address = address
        self.role = role
        self.owner = owner  # the pool's instance id, named in every call ("": none, no lease)
        self.call_timeout_s = call_timeout_s
        self.channel = open_channel(address, tls, GRPC_OPTIONS, aio=True)  # tls None: plaintext
        stub_class = draft_pb2_grpc.DraftWorkerStub if role == "draft" else target_pb2_grpc.TargetWorkerStub
        self.stub: Any = stub_class(self.channel)
        self.info: common_pb2.WorkerInfo | None = None
        self.healthy = False
        self.last_failure = ""  # why its last Info poll failed ("UNAVAILABLE: ..."); "" once one answers
        self.placed_since_poll = 0
        self.active = 0  # this coordinator's requests placed here and not yet finished
        self.verified = False  # its Info answered with the coordinator's tokenizer: requests may go here
        self.rejected = False  # its Info answered with another tokenizer: never used
        self.leaving = False  # discovery no longer lists it: no new requests, closed once idle
        self.closed = False  # its channel is closed: a poll still holding it gets no answer, and no error
        self.prompt_blocks = PrefixMirror()  # a draft's: the prompts this coordinator has seen it cache
        self._asking: asyncio.Future | None = None  # an Info asked for calls past their hang timeout (``computing``)
        self._polls_started = 0  # Info polls asked, numbered in the order they were sent
        self._poll_judged = 0  # the number of the newest poll whose answer (or failure) was taken
        self.busy_waits = 0  # times a call here outlasted its hang timeout and waited on, the worker computing

    async def call(self, method: str, request: Any, timeout: float, deadline_expected: bool = False,
                   metadata: tuple[tuple[str, str], ...] = ()) -> Any:
        """``deadline_expected``: a call that may outlast ``timeout`` without anything being wrong (a release queued
        behind a long step); its ``WorkerDeadlineError`` is not logged as a worker failure. ``metadata``: the request's
        trace context (``tandem.tracing``), so that the worker's span of the call joins the request's trace."""
        try:
            return await getattr(self.stub, method)(request, timeout=timeout, metadata=metadata or None)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNAVAILABLE:
                self.healthy = False  # skipped by new requests until its Info answers again
            expected = deadline_expected and exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            raise worker_failure(exc, self.role, self.address, logged=not expected) from None

    def hang_timeout(self, prompt_tokens: int = 0) -> float:
        """How long a call (or a batch) may take before this worker passes for hung: the internal call timeout, plus,
        for one that reads ``prompt_tokens`` tokens (a prompt, a moved request's history, a draft's catch-up, a
        batch's priced tokens), ``PROMPT_TIME_MARGIN`` times their price on this worker. A 5,128-token prompt takes a
        1.5B model in fp32 152 s on a 2-core CPU: under the bare 60 s its worker was taken for hung and the request
        moved, which read the prompt again from the start, until its moves ran out (a 500 after three minutes)."""
        timeout = self.call_timeout_s
        fit = self.fitted_cost()
        if prompt_tokens > 0 and fit is not None:
            # (the prompt price is measured at warm-up; a forward's per-token slope is the next best guess)
            per_token = fit.prompt_token_s or fit.per_token_s or fit.last_per_token_s
            timeout += PROMPT_TIME_MARGIN * prompt_tokens * per_token
        return timeout

    async def batch_time_left(self) -> float | None:
        """Whether this worker computes, not hangs, and for how long it may go on: the seconds its model thread's
        current batch may still run before it passes its own hang timeout (``hang_timeout`` of the batch's priced
        tokens; between batches, the whole of it). None when it hangs: its Info does not answer, its batch has run
        past that timeout, or it is too old to say (no ``step_running_s``). The calls that outlast their timeouts
        together (a burst's) share one Info."""
        if self._asking is None or self._asking.done():
            self._asking = asyncio.ensure_future(self.refresh())
        if await asyncio.shield(self._asking) != grpc.StatusCode.OK or self.info is None:
            return None
        info = self.info
        if not info.HasField("step_running_s"):
            return None
        left = self.hang_timeout(info.step_tokens) - info.step_running_s
        return left if left >= 0 else None

    async def refresh(self) -> grpc.StatusCode:
        """Ask its Info; the call's status (UNIMPLEMENTED: the server there is no worker of this role).

        Polls overlap (discovery's first one, the periodic one, a look at a slow call), and an answer can come after
        that of a poll sent later: a refusal sent while the worker was still warming up, arriving once a later poll
        found it serving, made a serving worker unhealthy. Only an answer newer than the last one taken counts."""
        self.placed_since_poll = 0
        if self.closed:
            self.healthy = False
            return grpc.StatusCode.UNAVAILABLE
        self._polls_started += 1
        number = self._polls_started
        try:
            # Naming the owner makes the poll the heartbeat that renews this coordinator's lease there.
            info = await self.stub.Info(common_pb2.WorkerInfoRequest(owner=self.owner, sent_at=time.time()),
                                        timeout=INFO_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if number < self._poll_judged:
                return exc.code()  # stale: a poll sent after it has answered
            self._poll_judged = number
            self.healthy = False
            self.last_failure = f"{exc.code().name}: {exc.details()}"
            return exc.code()
        except asyncio.CancelledError:
            # Closing a channel cancels its calls, and grpc.aio raises that in the caller as
            # CancelledError: a replica that drained while an Info poll was on its way must not
            # cancel the poll (nor a client's Info, which then never got its reply).
            task = asyncio.current_task()
            if not self.closed or (task is not None and task.cancelling()):
                raise
            self.healthy = False
            return grpc.StatusCode.UNAVAILABLE
        if number < self._poll_judged:
            return grpc.StatusCode.OK  # stale: a poll sent after it has answered, and its answer stands
        self._poll_judged = number
        self.info = info
        if not self.healthy:
            self.prompt_blocks.clear()  # it stopped answering: it may be back with an empty cache
        self.healthy, self.last_failure = True, ""
        return grpc.StatusCode.OK

    @property
    def state(self) -> str:
        """What routing makes of it: starting, healthy, unhealthy, leaving or rejected."""
        if self.rejected:
            return "rejected"
        if self.leaving:
            return "leaving"
        if not self.verified:
            return "starting"
        return "healthy" if self.healthy else "unhealthy"

    @property
    def routable(self) -> bool:
        return self.verified and not self.leaving and not self.rejected

    def fitted_cost(self) -> FittedCost | None:
        """The worker's own fit of its forward cost (from its last Info), once it has measured one."""
        if self.info is None or self.info.forward_base_s <= 0:
            return None
        info = self.info
        return FittedCost(info.forward_base_s, info.forward_per_token_s, info.last_forward_base_s,
                          info.last_forward_per_token_s, info.prompt_token_s, info.device_key, info.calls_per_batch)

    def sequence_room(self) -> int | None:
        """The most tokens one sequence may reach here: the worker's whole KV pool (from its Info) less the tokens a
        round may hold in flight; None until its Info says."""
        pool = self.pool_tokens()
        return None if pool is None else pool - IN_FLIGHT_TOKENS

    def pool_tokens(self) -> int | None:
        """The tokens its whole KV pool holds (from its Info); None until its Info says."""
        info = self.info
        if info is None or info.total_blocks <= 0 or info.block_size <= 0:
            return None
        return info.total_blocks * info.block_size

    def holds(self, tokens: int) -> bool:
        """Whether a sequence of ``tokens`` (a round in flight included: a request's ``max_len``) fits this replica's
        whole KV pool; yes while its Info has not said."""
        pool = self.pool_tokens()
        return pool is None or tokens <= pool

    def cached_prefix(self, token_ids: Sequence[int]) -> int:
        """Leading tokens of ``token_ids`` this (draft) replica should hold in its prefix cache, as far as
        this coordinator saw it read them (``PrefixMirror``: a hint); 0 with its prefix cache off."""
        if self.info is None or not self.info.prefix_cache.enabled or self.info.block_size < 1:
            return 0
        return self.prompt_blocks.match(token_ids, self.info.block_size)

    def read_prompt(self, prompt_ids: Sequence[int]) -> None:
        """This (draft) replica drafted after reading ``prompt_ids`` (a prompt, or the target's text of a request
        it drafted for): it cached their full blocks."""
        if self.info is not None and self.info.prefix_cache.enabled and self.info.block_size >= 1:
            self.prompt_blocks.record(prompt_ids, self.info.block_size, self.info.total_blocks)

    def for_request(self, deadline: float | None, max_len: int = 0, priority: int = 0,
                    arrival_time: float = 0.0, room: RoomQueue | None = None,
                    metadata: tuple[tuple[str, str], ...] = ()) -> RequestChannel:
        """This worker as one request sees it: calls bounded by the request's deadline (loop time); ``max_len``:
        the most tokens the request's KV may reach, ``priority`` the request's and ``arrival_time`` when it
        arrived (Unix seconds), told to a target with each Prefill (0: not said), with the coordinator's requests
        waiting in ``room`` for this worker; ``metadata`` goes with every call (the request's trace context)."""
        return RequestChannel(self, deadline, self.owner, max_len, priority, arrival_time, room, metadata)

    @property
    def streams(self) -> int:
        """Sequences sharing this worker now: ours, or all of them as its last Info said."""
        return max(self.active, self.info.active_sequences if self.info else 0)

    def score(self) -> tuple[float, float]:
        """Higher is better: free KV (minus what we just placed), then a short queue."""
        if self.info is None:
            return (0.0, 0.0)
        share = self.info.total_blocks / max(1, self.info.active_sequences + 8)
        return (self.info.free_blocks - self.placed_since_poll * share, -self.info.queue_depth)

    async def close(self) -> None:
        self.closed = True
        await self.channel.close()


class RequestChannel:
    """One request's handle on one worker: the ``Verifier`` and ``DraftChannel`` over gRPC."""

    def __init__(self, client: WorkerClient, deadline: float | None, owner: str = "", max_len: int = 0,
                 priority: int = 0, arrival_time: float = 0.0, room: RoomQueue | None = None,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self.client = client
        self.metadata = metadata  # sent with every call: the request's trace context (tandem.tracing); () if none
        self.max_len = max_len  # PrefillRequest.max_len: the room a target keeps free for the sequence to grow
        self.priority = priority  # PrefillRequest.priority: lower goes first where the target's pool runs short
        self.arrival_time = arrival_time  # PrefillRequest.arrival_time: FCFS across coordinators in a full pool
        self.room = room  # the coordinator's requests waiting for room: PrefillRequest.queued
        self.deadline = deadline  # asyncio loop time by which the client wants its answer; None: no limit
        self.owner = owner  # the coordinator's instance id, named in every call (the worker's lease)
        # A draft's sequence as its Proposes built it, and how many of those tokens are the target's text (the
        # last drafting Propose's ``verified_len``): at release the mirror learns the blocks the draft cached of it.
        self._draft_tokens: list[int] = []
        self._verified = 0

    @property
    def worker(self) -> WorkerClient:
        """The worker this channel calls (each request's channels to one worker share it)."""
        return self.client

    def hang_timeout(self, prompt_tokens: int = 0) -> float:
        """How long a call may take before its worker passes for hung (``WorkerClient.hang_timeout``)."""
        return self.client.hang_timeout(prompt_tokens)

    def _time_left(self) -> float | None:
        """Seconds until the client's deadline (None: it set none)."""
        if self.deadline is None:
            return None
        left = self.deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise WorkerDeadlineError("the request's deadline passed")
        return left

    async def _call(self, method: str, request: Any, prompt_tokens: int = 0) -> Any:
        """One call bounded by the request's deadline. When it outlasts its hang timeout (``hang_timeout``), the
        worker is asked whether it is computing (``WorkerClient.batch_time_left``): one that is, in a batch that has
        not run past its own price, is busy with other calls ahead of this one (a burst of long prompts), and the call
        waits on, looking again just after that batch would pass its price. One that does not answer, or whose batch
        has, is hung: it is marked unhealthy and the call reported as unavailable, so that the request moves and new
        requests skip it until its Info answers again. Before workers said what they compute, a healthy target under a
        burst of eight 1,500-token prompts was taken for hung seven times, and each of those requests read its prompt
        again."""
        hang = self.hang_timeout(prompt_tokens)
        loop = asyncio.get_running_loop()
        give_up_at = loop.time() + (MAX_BUSY_WAITS + 1) * hang
        call = asyncio.ensure_future(self.client.call(method, request, self._time_left(), metadata=self.metadata))
        try:
            wait = hang
            while True:
                done, _pending = await asyncio.wait({call}, timeout=wait)
                if done:
                    return call.result()  # the client's own deadline is raised as it is: nothing to move for
                if loop.time() >= give_up_at:
                    log.warning("a %s call on %s waited %.0f s while its worker kept computing; taking it for hung",
                                method, self.client.address, (MAX_BUSY_WAITS + 1) * hang)
                    break
                left = await self.client.batch_time_left()
                if call.done():
                    return call.result()  # it answered while the worker was asked
                if left is None:
                    log.warning("a %s call on %s passed its hang timeout (%.0f s) and the worker is not computing "
                                "(its Info did not answer, or its batch ran past its own price): taking it for hung",
                                method, self.client.address, hang)
                    break
                self.client.busy_waits += 1
                # The next look is just after the batch running now would pass its price. A whole hang timeout
                # later, as before, let a worker that hung just after a look pass for computing for two timeouts.
                wait = min(hang, left + hang * LOOK_SLACK_FRACTION, give_up_at - loop.time())
        finally:
            if not call.done():
                call.cancel()  # cancels the RPC on the worker: its batcher drops the call between steps
        self.client.healthy = False
        raise WorkerUnavailableError(f"a {self.client.role} worker did not answer in time")

    @property
    def streams(self) -> int:
        return self.client.streams

    def fitted_cost(self) -> FittedCost | None:
        return self.client.fitted_cost()

    async def prefill(self, seq_id: str, token_ids: list[int], sampling: SamplingParams, prompt_len: int = 0,
                      propose: int = 0, wait_for_room_s: float = 0.0) -> Prefilled:
        # prompt_len > 0 is a rebuild (the request moved, or was preempted): it may replace what the worker
        # still holds of it. A first Prefill never does: the worker refuses an id that is live there.
        reply = await self._call("Prefill", target_pb2.PrefillRequest(
            seq_id=seq_id, token_ids=token_ids, sampling=sampling_to_proto(sampling), prompt_len=prompt_len,
            owner=self.owner, replace=prompt_len > 0, propose=propose, max_len=self.max_len,
            priority=self.priority, arrival_time=self.arrival_time, queued=self._queued(seq_id),
            wait_for_room_s=wait_for_room_s),
            prompt_tokens=len(token_ids))
        return Prefilled(reply.next_token, proposal_from_proto(reply.proposal) if propose else None,
                         reply.reused_tokens, logprobs_from_proto(reply.logprobs), list(reply.forced_tokens),
                         logprobs_from_proto(reply.prompt_logprobs) if sampling.prompt_logprobs is not None else None)

    def _queued(self, seq_id: str) -> list[target_pb2.QueuedPrompt]:
        """The coordinator's other requests waiting for room whose next Prefill goes to this worker, in order."""
        queued = []
        for turn in self.room.waiting() if self.room is not None else ():
            channel = turn.where() if turn.where is not None else None
            if turn.seq_id == seq_id or getattr(channel, "worker", None) is not self.client:
                continue
            queued.append(target_pb2.QueuedPrompt(seq_id=turn.seq_id, arrival_time=channel.arrival_time,
                                                  tokens=turn.tokens() if turn.tokens is not None else 0,
                                                  max_len=channel.max_len, priority=channel.priority))
            if len(queued) == MAX_QUEUED:
                break
        return queued

    async def verify(self, seq_id: str, committed_len: int, draft_tokens: list[int],
                     draft_probs: Sequence[common_pb2.SparseDistribution],
                     draft_parents: Sequence[int] = (), propose: int = 0) -> Verified:
        # draft_probs are the draft's own messages, passed on untouched: the q it sampled from.
        reply = await self._call("Verify", target_pb2.VerifyRequest(
            seq_id=seq_id, committed_len=committed_len, draft_tokens=draft_tokens, draft_probs=draft_probs,
            draft_parents=draft_parents, owner=self.owner, propose=propose))
        accepted = list(reply.accepted_nodes)
        if len(accepted) != reply.num_accepted or any(not 0 <= n < len(draft_tokens) for n in accepted):
            raise InternalError("a target worker answered an inconsistent verdict")
        return Verified(accepted, reply.next_token, proposal_from_proto(reply.proposal) if propose else None,
                        logprobs_from_proto(reply.logprobs), list(reply.forced_tokens))

    async def propose(self, seq_id: str, committed_len: int, new_tokens: list[int], k: int,
                      sampling: SamplingParams, alternatives: int = 0, prompt_len: int = 0,
                      verified_len: int = 0, stop_below: float = 0.0) -> Drafted:
        reply = await self._call("Propose", draft_pb2.ProposeRequest(
            seq_id=seq_id, committed_len=committed_len, new_tokens=new_tokens, k=k,
            sampling=sampling_to_proto(sampling), alternatives=alternatives, prompt_len=prompt_len,
            owner=self.owner, verified_len=verified_len, stop_below=stop_below), prompt_tokens=len(new_tokens))
        if committed_len == 0 and k > 0 and 0 < prompt_len <= len(new_tokens):
            self.client.read_prompt(new_tokens[:prompt_len])  # (a draft offers a prompt it drafted after)
        del self._draft_tokens[committed_len:]  # (in place: no copy of the whole history per round)
        self._draft_tokens.extend(new_tokens)
        if k > 0:
            self._verified = verified_len
        return Drafted(list(reply.tokens), list(reply.probs), [list(a.token_ids) for a in reply.alternatives])

    def cached_prefix(self, token_ids: Sequence[int]) -> int:
        return self.client.cached_prefix(token_ids)

    def sequence_room(self) -> int | None:
        return self.client.sequence_room()

    async def release(self, seq_id: str) -> None:
        """Best effort: a worker that is gone has freed the KV anyway. A draft that caches the target's text
        (Info's ``prefix_cache.generated``) kept the blocks of what its last drafting Propose said was
        verified: the mirror learns them, so that a conversation's next turn is priced as mostly cached."""
        if self._verified and self.client.info is not None and self.client.info.prefix_cache.generated:
            self.client.read_prompt(self._draft_tokens[:self._verified])
        self._draft_tokens, self._verified = [], 0
        try:
            await self.client.call("Release", common_pb2.ReleaseRequest(seq_id=seq_id), RELEASE_TIMEOUT_S,
                                   deadline_expected=True, metadata=self.metadata)
        except WorkerDeadlineError:  # queued behind a long step (a chunk of a long prompt): it runs when taken
            log.info("release of %s on %s not answered within %.0f s (the worker is in a long step; it frees the "
                     "sequence when it takes the call)", seq_id, self.client.address, RELEASE_TIMEOUT_S)
        except Exception as exc:  # noqa: BLE001
            log.warning("release of %s on %s failed: %s", seq_id, self.client.address, exc)


REPLICA_STATES = ("starting", "healthy", "unhealthy", "leaving", "rejected")


class WorkerPool:
    """The replicas of one role; ``fingerprint`` is the coordinator's tokenizer's (None: not checked);
    ``owner`` the id it names itself by to the replicas that join (made here when not given)."""

    def __init__(self, role: str, clients: list[WorkerClient], fingerprint: str | None = None,
                 call_timeout_s: float = 60.0, tls: ClientTLS | None = None, owner: str | None = None) -> None:
        self.role = role
        self.owner = owner or new_owner_id()
        self.tls = tls  # TLS to every replica of this pool; None: plaintext
        self.clients = clients
        self.fingerprint = fingerprint
        self.call_timeout_s = call_timeout_s
        self._tasks: set[asyncio.Task] = set()  # first Info calls and closes, held until done
        self._closed_busy_waits = 0  # the busy waits of replicas closed since (``busy_waits``)

    def pick(self, avoid: WorkerClient | None = None, key: bytes | None = None, tokens: int = 0) -> WorkerClient:
        """The replica a request should use now; ``avoid`` (one that failed the request) only as a last resort.
        With a prompt's routing ``key``: the one likely to hold its prefix, within a bound on load
        (``coordinator.prefix_routing``); without: the best load score. ``tokens``: the most the request's sequence
        may reach; replicas whose whole KV pool holds that come first (in a pool of unequal replicas a request
        only the larger ones hold goes there, where a smaller one would refuse it as full on every call)."""
        routable = [c for c in self.clients if c.routable]
        if not routable:
            raise WorkerUnavailableError(f"no {self.role} workers available")
        routable = [c for c in routable if c.holds(tokens)] or routable
        healthy = [c for c in routable if c.healthy]
        candidates = [c for c in healthy if c is not avoid] or healthy or routable
        best = prefix_routing.choose(key, candidates) if key is not None else max(candidates, key=lambda c: c.score())
        best.placed_since_poll += 1
        return best

    async def replacement(self, failed: WorkerClient | None, wait_s: float,
                          key: bytes | None = None, tokens: int = 0) -> WorkerClient | None:
        """A healthy replica other than ``failed`` that holds ``tokens``, waiting up to ``wait_s`` for one (a
        restarting replica, ``failed`` itself included once it answers again); None if none turns up. ``key``
        and ``tokens``: as for ``pick`` (a moved request's next choice for its prefix, and its length)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            if any(c.routable and c.healthy and c is not failed and c.holds(tokens) for c in self.clients):
                return self.pick(avoid=failed, key=key, tokens=tokens)
            if loop.time() >= deadline:
                return None
            await asyncio.sleep(REPLACEMENT_POLL_S)
            if failed is not None:
                await self.refresh(failed)  # back (restarted, or no longer hung)? then it counts again
                if failed.healthy and failed.routable:
                    failed = None

    def busy_waits(self) -> int:
        """Calls that outlasted their hang timeout on a computing replica of this pool and waited on (a fleet too small
        for its bursts), since start: ``tandem_coordinator_busy_waits_total``."""
        return self._closed_busy_waits + sum(c.busy_waits for c in self.clients)

    def has_healthy(self) -> bool:
        return any(c.routable and c.healthy for c in self.clients)

    def has_routable(self) -> bool:
        return any(c.routable for c in self.clients)

    def served_model(self) -> str:
        """The model its replicas serve, as they name it ("" before one has answered)."""
        return next((c.info.model for c in self.clients if c.verified and c.info is not None), "")

    def kv_usage(self) -> float:
        """The share of its routable healthy replicas' KV blocks in use (0..1), as their last Info said; 0 with none."""
        infos = [c.info for c in self.clients if c.routable and c.healthy and c.info is not None]
        total = sum(info.total_blocks for info in infos)
        return sum(info.total_blocks - info.free_blocks for info in infos) / total if total > 0 else 0.0

    def heads_kind(self) -> str:
        """The speculation heads every routable replica serves ("" when none, or when they differ:
        a heads request must find its heads wherever it is placed or moved)."""
        kinds = {c.info.heads for c in self.clients if c.routable and c.info is not None}
        return kinds.pop() if len(kinds) == 1 else ""

    def describe(self) -> str:
        """Each replica's address and state, with why its last poll failed: what an operator needs while none
        is usable (a typo in an address, a worker still loading, one of another model)."""
        return ", ".join(f"{c.address} {c.state}" + (f" ({c.last_failure})" if c.last_failure else "")
                         for c in self.clients) or "none listed yet"

    def counts(self) -> dict[str, int]:
        """Replicas per state (every state present, zeros included)."""
        counts = dict.fromkeys(REPLICA_STATES, 0)
        for c in self.clients:
            counts[c.state] += 1
        return counts

    # ----- membership ---------------------------------------------------------------
    def update(self, addresses: Iterable[str]) -> None:
        """Discovery's latest set: add what is new, un-mark what came back, let what left drain."""
        wanted = set(addresses)
        known = {c.address for c in self.clients}
        for client in self.clients:
            if client.address in wanted and client.leaving:
                log.info("%s worker %s is back", self.role, client.address)
                client.leaving = False
            elif client.address not in wanted and not client.leaving:
                log.info("%s worker %s is leaving (%d requests in flight)", self.role, client.address,
                         client.active)
                client.leaving = True
        for address in sorted(wanted - known):
            log.info("%s worker %s listed; used once its Info answers", self.role, address)
            client = WorkerClient(address, self.role, self.call_timeout_s, self.tls, self.owner)
            self.clients.append(client)
            self._spawn(self.refresh(client))  # usable as soon as its first Info answers
        self.sweep()

    def sweep(self) -> None:
        """Close the leaving replicas that no request uses any more."""
        for client in [c for c in self.clients if c.leaving and c.active == 0]:
            self.clients.remove(client)
            self._closed_busy_waits += client.busy_waits
            log.info("%s worker %s drained; closed", self.role, client.address)
            self._spawn(client.close())

    def _spawn(self, work: Any) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ----- health ---------------------------------------------------------------------
    async def refresh(self, client: WorkerClient) -> None:
        """Poll its Info and judge it on every answer: a pod's address may come back with another server."""
        code = await client.refresh()
        if code == grpc.StatusCode.UNIMPLEMENTED:  # a Service or file that names the wrong fleet
            problem = f"serves no {self.role} worker API"
        elif client.info is None:
            return  # not answering (yet): still starting
        elif client.info.role != self.role:
            problem = f"is a {client.info.role or 'unknown'} worker"
        elif self.fingerprint is not None and client.info.tokenizer_fingerprint != self.fingerprint:
            problem = "uses another tokenizer than this coordinator"
        else:
            if client.rejected:
                log.info("%s worker %s now serves our model; using it", self.role, client.address)
            client.verified, client.rejected = True, False
            return
        if not client.rejected:
            log.error("%s worker %s %s; it will not be used", self.role, client.address, problem)
        client.verified, client.rejected = False, True

    async def refresh_all(self) -> None:
        await asyncio.gather(*(self.refresh(c) for c in list(self.clients)))
        self.sweep()

    async def poll_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s(interval_s))
            await self.refresh_all()

    def poll_interval_s(self, interval_s: float) -> float:
        """``interval_s``, or less where a replica's lease needs a heartbeat sooner (see the module doc)."""
        leases = [c.info.lease_s for c in self.clients if c.info is not None and c.info.lease_s > 0]
        return min([interval_s, *(lease * HEARTBEAT_FRACTION for lease in leases)])

    async def close(self) -> None:
        await asyncio.gather(*(c.close() for c in self.clients), *self._tasks)
