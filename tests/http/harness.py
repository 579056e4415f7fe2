"""A coordinator with its HTTP API inside the test's event loop, over a fake target worker: fast, no model.

Wired as coordinator/main.py wires it (one AccessControl for both APIs, the real
GenerationService and HttpApi on a ManagedServer), over ``ScriptedTarget``: a fake
target (tests/coordinator/inprocess.py's) that emits ``TOKENS`` in turn, answers
log-probabilities when asked (the prompt's too), can hold its Verify calls (``gate``) and counts
the sequences it holds (``live``), so a test can see a request's KV freed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from coordinator.access import AccessControl
from coordinator.http import HttpApi
from coordinator.service import GenerationService
from coordinator.workers import WorkerPool
from tandem.block_pool import prefix_limit
from tandem.config import CoordinatorConfig, ServerOptions
from tandem.rpc.auth import BearerAuth
from tandem.rpc.metrics import CoordinatorMetrics
from tandem.rpc.tls import ServerTLS
from tandem.spec.proposers import common_prefix_len
from tandem.tokenizer import tokenizer_fingerprint
from tandem.v1 import common_pb2, generation_pb2_grpc, target_pb2, target_pb2_grpc
from tests.coordinator.inprocess import FakeTarget
from tests.serving import managed_server, serving

TOKENS = (7, 9, 11, 13)  # what the scripted target emits, in turn, for every sequence
LOGPROB = -0.25  # the log-probability it gives every emitted token
PROMPT_LOGPROB = -0.5  # prompt token i's log-probability is i times this (echo with logprobs)
MODEL = "fake-target"  # its Info's model: the served model's id
CACHE_BLOCK = 16  # the block size of its pretend prefix cache


class ScriptedTarget(FakeTarget):
    def __init__(self, fingerprint: str) -> None:
        super().__init__(fingerprint)
        self.gate = asyncio.Event()  # Verify waits for it: set (open) by default
        self.gate.set()
        self.live: dict[str, int] = {}  # seq_id -> tokens emitted; a released sequence is gone
        self.logprobs: dict[str, int] = {}  # seq_id -> alternatives asked
        self.prompts: list[list[int]] = []
        self.samplings: list[common_pb2.SamplingOptions] = []  # each Prefill's, in order
        self.max_lens: list[int] = []  # each Prefill's max_len, in order
        self.priorities: list[int] = []  # each Prefill's priority, in order
        self.arrivals: list[float] = []  # each Prefill's arrival_time, in order (refused ones included)
        self.room_holds: list[float] = []  # each Prefill's wait_for_room_s, in order (refused ones included)
        self.queued: list[tuple[str, list[str]]] = []  # each Prefill's seq_id and the seq_ids it said queue behind
        self.info_sent_at: list[float] = []  # each Info poll's sent_at (the coordinator's clock)
        self.script: list[int] = []  # emitted first, before TOKENS in turn (a text the test spells)
        self.info: dict[str, Any] = {}  # Info fields other than the fake's (vocab_size, max_context)

    def _emit(self, seq_id: str, count: int) -> tuple[list[int], list[common_pb2.TokenLogprobs]]:
        start = self.live.get(seq_id, 0)
        tokens = [self.script[i] if i < len(self.script) else TOKENS[i % len(TOKENS)]
                  for i in range(start, start + count)]
        self.live[seq_id] = start + count
        top = self.logprobs.get(seq_id)
        scores = [] if top is None else [common_pb2.TokenLogprobs(
            logprob=LOGPROB, top_ids=[t, 3][:top], top_logprobs=[LOGPROB, -2.0][:top]) for t in tokens]
        return tokens, scores

    async def Prefill(self, request, context):
        self.calls["Prefill"] += 1
        self.arrivals.append(request.arrival_time)
        self.room_holds.append(request.wait_for_room_s)
        self.queued.append((request.seq_id, [q.seq_id for q in request.queued]))
        if self.full_prefills:
            self.full_prefills -= 1
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"KV cache full: sequence {request.seq_id!r} needs 2 more blocks than are free; "
                                "retry later")
        prompt = list(request.token_ids)
        # As a prefix cache answers: whole blocks of the longest earlier prompt this one starts with, at most
        # all but its last token.
        seen = max((common_prefix_len(earlier, prompt) for earlier in self.prompts), default=0)
        reused = min(seen, prefix_limit(len(prompt))) // CACHE_BLOCK * CACHE_BLOCK
        self.prompts.append(prompt)
        self.samplings.append(request.sampling)
        self.max_lens.append(request.max_len)
        self.priorities.append(request.priority)
        if request.sampling.HasField("logprobs"):
            self.logprobs[request.seq_id] = request.sampling.logprobs
        [token], scores = self._emit(request.seq_id, 1)
        reply = target_pb2.PrefillResponse(next_token=token, logprobs=scores, reused_tokens=reused)
        if request.sampling.HasField("prompt_logprobs"):  # token i scored PROMPT_LOGPROB * i, its id top, rank 1
            top = request.sampling.prompt_logprobs
            reply.prompt_logprobs.extend(common_pb2.TokenLogprobs(
                logprob=PROMPT_LOGPROB * i, top_ids=[t, 3][:top], top_logprobs=[PROMPT_LOGPROB * i, -9.0][:top],
                rank=1) for i, t in enumerate(prompt[1:], start=1))
        return reply

    async def Verify(self, request, context):
        self.calls["Verify"] += 1
        await self.gate.wait()
        [token], scores = self._emit(request.seq_id, 1)  # method none: no drafts, one token a round
        return target_pb2.VerifyResponse(num_accepted=0, next_token=token, logprobs=scores)

    async def Release(self, request, context):
        self.calls["Release"] += 1
        self.live.pop(request.seq_id, None)
        self.logprobs.pop(request.seq_id, None)
        return common_pb2.ReleaseResponse(released=True)

    async def Info(self, request, context):
        self.info_sent_at.append(request.sent_at)
        info = await super().Info(request, context)
        info.model = MODEL
        for name, value in self.info.items():
            setattr(info, name, value)
        return info


@dataclass
class Running:
    url: str  # the HTTP API's base URL, http://127.0.0.1:PORT/v1
    grpc_address: str
    target: ScriptedTarget
    service: GenerationService
    server: Any  # the coordinator's ManagedServer
    http: HttpApi

    @property
    def root(self) -> str:
        return self.url[: -len("/v1")]


@contextlib.asynccontextmanager
async def http_coordinator(tokenizer: Any, *, tokens: tuple[str, ...] = (), serve: bool = True,
                           tls: ServerTLS | None = None, info: dict[str, Any] | None = None,
                           connection_age_s: float | None = None, **limits: Any) -> AsyncIterator[Running]:
    """The coordinator (gRPC and HTTP) over one scripted target; ``tokens``: bearer auth with these;
    ``limits``: CoordinatorConfig fields (max_concurrent_per_client, max_request_bytes, ...). ``serve=False``:
    still starting (no warm-up). ``tls``: the coordinator's (both ports). ``info``: the target's Info fields
    other than the fake's (a bigger tokenizer's vocab_size). ``connection_age_s``: the HTTP API's
    --max-connection-age."""
    auth = BearerAuth(tokens) if tokens else None
    cfg = CoordinatorConfig(server=ServerOptions(host="127.0.0.1", port=0, drain_grace_s=0, tls=tls,
                                                 max_connection_age_s=connection_age_s),
                            tokenizer_dir=Path("unused"), target_addrs=["127.0.0.1:1"], auth=auth, http_port=0,
                            default_k=0, **{"default_max_new_tokens": 8, **limits})
    fingerprint = tokenizer_fingerprint(tokenizer)
    targets, drafts = WorkerPool("target", [], fingerprint), WorkerPool("draft", [], fingerprint)
    access = AccessControl(auth, cfg.max_concurrent_per_client)
    server = managed_server(tls, role="coordinator", interceptors=[access], max_receive_bytes=cfg.max_request_bytes)
    metrics = CoordinatorMetrics(server.registry, served_model=lambda: service.target_model(),
                                 kv_usage=targets.kv_usage)
    service = GenerationService(cfg, tokenizer, targets, drafts, server, metrics)
    server.add_service(generation_pb2_grpc.add_GenerationServicer_to_server, service, "tandem.v1.Generation")
    http = HttpApi(service, access, cfg, tokenizer, server.registry)
    target = ScriptedTarget(fingerprint)
    target.info = dict(info or {})
    worker = managed_server(role="target")
    worker.add_service(target_pb2_grpc.add_TargetWorkerServicer_to_server, target, "tandem.v1.TargetWorker")
    await server.start()
    port = await http.start()
    try:
        async with serving(worker) as target_address:
            if serve:
                targets.update({target_address})
                while not targets.has_healthy():
                    await asyncio.sleep(0.01)
                info = next(c.info for c in targets.clients if c.routable and c.healthy)
                service.vocab_size, service.max_context = info.vocab_size, info.max_context
                service.model_stop_ids = frozenset(info.stop_token_ids)
                await server.set_serving()
            scheme = "https" if tls else "http"
            yield Running(f"{scheme}://127.0.0.1:{port}/v1", f"127.0.0.1:{server.port}", target, service, server, http)
    finally:
        await http.stop()
        await server.server.stop(0)
        await targets.close()
        await drafts.close()


def record_starts(running: Running, read: Any) -> list[Any]:
    """What ``read`` takes from each request the coordinator starts (its ``_Request``: state, options), in order."""
    seen: list[Any] = []
    start = running.service.start

    def spy(request, remaining, *trace):
        run = start(request, remaining, *trace)
        seen.append(read(run))
        return run
    running.service.start = spy
    return seen
