"""The public Generation service: validate, tokenize, run the speculation loop, stream.

Every field is checked before any worker is called, and a bad one is named in
the INVALID_ARGUMENT message.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import Any, AsyncIterator

import grpc

from coordinator.session import Session, StopConditions
from coordinator.speculation import SpeculationRun
from coordinator.workers import WorkerPool
from tandem.config import CoordinatorConfig
from tandem.errors import InvalidRequestError, check_token_ids
from tandem.rpc.metrics import CoordinatorMetrics
from tandem.rpc.server import ManagedServer
from tandem.rpc.wire import sampling_from_proto
from tandem.spec.adaptive import MAX_K, CostModel
from tandem.tokenizer import encode_prompt
from tandem.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

PUBLIC_METHODS = ("auto", "none", "draft", "ngram")


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, cfg: CoordinatorConfig, tokenizer: Any, targets: WorkerPool, drafts: WorkerPool,
                 server: ManagedServer, metrics: CoordinatorMetrics) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.targets = targets
        self.drafts = drafts
        self.server = server
        self.metrics = metrics
        self.vocab_size = 0  # from the target workers' Info, set by the warm-up
        self.max_context = 0
        self.model_stop_ids: frozenset[int] = frozenset()
        self.costs: dict[tuple[str, str, str], CostModel] = {}  # per (method, draft, target) pair

    # ----- RPCs ------------------------------------------------------------
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        session, run = self._start(request)
        async for _ in self._drive(session, run):
            pass
        return generation_pb2.GenerateResponse(
            request_id=session.request_id, text=session.final_text(), token_ids=session.generated,
            finish_reason=session.finish_reason or "length", stats=self._stats(session, run))

    async def GenerateStream(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        session, run = self._start(request)
        async for _ in self._drive(session, run):
            text, tokens = session.take_delta()
            done = session.finish_reason is not None
            if not (text or tokens or done):
                continue
            msg = generation_pb2.GenerateStreamResponse(request_id=session.request_id, text=text, token_ids=tokens)
            if done:
                msg.finish_reason = session.finish_reason
                msg.stats.CopyFrom(self._stats(session, run))
            yield msg

    async def Info(self, request: generation_pb2.InfoRequest, context: grpc.aio.ServicerContext):
        def status(pool: WorkerPool) -> list[generation_pb2.WorkerStatus]:
            return [generation_pb2.WorkerStatus(address=c.address, healthy=c.healthy, info=c.info)
                    for c in pool.clients]
        await self.targets.refresh_all()
        await self.drafts.refresh_all()
        target_info = next((c.info for c in self.targets.clients if c.info), None)
        draft_info = next((c.info for c in self.drafts.clients if c.info), None)
        return generation_pb2.InfoResponse(
            target_model=target_info.model if target_info else "", draft_model=draft_info.model if draft_info else "",
            vocab_size=self.vocab_size, max_context=self.max_context,
            target_workers=status(self.targets), draft_workers=status(self.drafts))

    # ----- the request ---------------------------------------------------------
    def _start(self, request: generation_pb2.GenerateRequest) -> tuple[Session, SpeculationRun]:
        self.server.check_accepting()
        session = self._session(request)
        target = self.targets.pick()
        draft = self.drafts.pick() if session.method == "draft" else None
        key = (session.method, draft.address if draft else "", target.address)
        costs = self.costs.setdefault(key, CostModel())
        run = SpeculationRun(session, target, draft, costs, self.metrics,
                             (self.cfg.ngram_min, self.cfg.ngram_max), self.max_context)
        return session, run

    async def _drive(self, session: Session, run: SpeculationRun) -> AsyncIterator[None]:
        self.metrics.active.inc()
        outcome = "error"
        emitted = 0
        last = session.started_at
        try:
            async for _ in run.run():
                now = time.perf_counter()
                new = len(session.generated) - emitted
                if new:
                    if emitted == 0:
                        self.metrics.ttft.observe(now - session.started_at)
                    else:
                        for _ in range(new):
                            self.metrics.itl.observe((now - last) / new)
                    self.metrics.generated_tokens.inc(new)
                    emitted, last = len(session.generated), now
                yield
            outcome = "ok"
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            self.metrics.active.dec()
            self.metrics.requests.labels(outcome).inc()
            stats = session.stats
            if stats.drafted:
                self.metrics.acceptance_rate.observe(stats.accepted / stats.drafted)
            if stats.rounds:
                waited = stats.draft_wait_s + stats.verify_wait_s
                self.metrics.overhead.observe(max(0.0, stats.round_wall_s - waited) / stats.rounds)
            if stats.last_token_at and outcome == "ok":
                self.metrics.tokens_per_s.observe(len(session.generated) / max(1e-9, stats.last_token_at - session.started_at))

    def _session(self, request: generation_pb2.GenerateRequest) -> Session:
        sampling = _field("sampling", lambda: sampling_from_proto(request.sampling))
        spec = request.speculation
        method = spec.method or "auto"
        if method not in PUBLIC_METHODS:
            raise InvalidRequestError(
                f"speculation.method: unknown method {method!r}; choose one of {', '.join(PUBLIC_METHODS)}")
        if method == "auto":
            method = "draft" if self.drafts.clients else "ngram"
        if method == "draft" and not self.drafts.clients:
            raise InvalidRequestError("speculation.method: 'draft' needs draft workers; this coordinator has none")
        k = spec.k if spec.HasField("k") else self.cfg.default_k
        if not 0 <= k <= MAX_K:
            raise InvalidRequestError(f"speculation.k must be in 0..{MAX_K}, got {k}")
        prompt_ids = self._prompt_ids(request)
        stopping = request.stopping
        max_new = stopping.max_new_tokens or self.cfg.default_max_new_tokens
        if stopping.max_new_tokens < 0:
            raise InvalidRequestError(f"stopping.max_new_tokens must be positive, got {stopping.max_new_tokens}")
        if len(prompt_ids) + max_new > self.max_context:
            raise InvalidRequestError(
                f"stopping.max_new_tokens: prompt ({len(prompt_ids)} tokens) + {max_new} new tokens exceeds "
                f"the model's context of {self.max_context}")
        check_token_ids("stopping.stop_token_ids", stopping.stop_token_ids, self.vocab_size)
        if any(not s for s in stopping.stop_strings):
            raise InvalidRequestError("stopping.stop_strings: empty strings are not allowed")
        stop_ids = frozenset(stopping.stop_token_ids) | (frozenset() if stopping.ignore_eos else self.model_stop_ids)
        stop = StopConditions(max_new, stop_ids, tuple(stopping.stop_strings))
        request_id = request.request_id or uuid.uuid4().hex[:16]
        pipelined = self.cfg.pipelining and not spec.disable_pipelining
        return Session(request_id, prompt_ids, sampling, stop, self.tokenizer, method, k, not spec.fixed_k, pipelined)

    def _prompt_ids(self, request: generation_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("input")
        if which == "token_ids":
            ids = list(request.token_ids.ids)
            if not ids:
                raise InvalidRequestError("token_ids.ids: prompt is empty")
            check_token_ids("token_ids.ids", ids, self.vocab_size)
        else:
            if not request.text:
                raise InvalidRequestError("text: prompt is empty")
            ids = _field("chat", lambda: encode_prompt(self.tokenizer, request.text, request.chat))
        if len(ids) >= self.max_context:
            raise InvalidRequestError(
                f"prompt: {len(ids)} tokens is longer than the model's context of {self.max_context}")
        return ids

    def _stats(self, session: Session, run: SpeculationRun) -> generation_pb2.GenerationStats:
        st = session.stats
        elapsed = (st.last_token_at or session.started_at) - session.started_at
        generated = len(session.generated)
        return generation_pb2.GenerationStats(
            prompt_tokens=len(session.prompt_ids), generated_tokens=generated, drafted=st.drafted,
            accepted=st.accepted, rounds=st.rounds,
            mean_accepted_len=st.accepted / st.spec_rounds if st.spec_rounds else 0.0,
            acceptance_rate=st.accepted / st.drafted if st.drafted else 0.0,
            tokens_per_s=generated / elapsed if elapsed > 0 else 0.0,
            time_to_first_token_s=(st.first_token_at or session.started_at) - session.started_at,
            elapsed_s=elapsed, method=session.method,
            draft_worker=run.draft.address if run.draft else "", target_worker=run.target.address)


def _field(name: str, make: Any) -> Any:
    """Run a validator; prefix its message with the request field it is about."""
    try:
        return make()
    except ValueError as exc:
        raise InvalidRequestError(f"{name}: {exc}") from None
