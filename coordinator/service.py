"""The public Generation service: validate, tokenize, run the speculation loop, stream.

Every field is checked before any worker is called, and a bad one is named in
the INVALID_ARGUMENT message; so are the operator's limits (prompt tokens, new
tokens). Replies name worker replicas by opaque names (``target-0``) unless
the operator chose ``--expose-worker-addresses``. The loop itself is
``tandem.spec.loop``, the same one ``tandem generate`` runs in process; here
it talks to gRPC workers.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import grpc

from coordinator import request_spans
from coordinator.chat import TemplateVariablesError, chat_template_refusals, conversation, tool_use
from coordinator.in_flight import InFlight
from coordinator.placement import Placement
from coordinator.prefix_routing import client_key, routing_key
from coordinator.replica_state import PairCosts, ReplicaNames
from coordinator.request_log import request_line
from coordinator.workers import WorkerPool
from tandem.config import CoordinatorConfig
from tandem.errors import ContextLengthError, InvalidRequestError, PromptTooLongError, check_token_ids, token_count_text
from tandem.infill import InfillFormat, no_infill_message
from tandem.rpc.metrics import CoordinatorMetrics
from tandem.rpc.server import ManagedServer
from tandem.rpc.wire import logprobs_to_proto, sampling_from_proto
from tandem.spec.adaptive import IN_FLIGHT_TOKENS, MAX_K, MatchRates
from tandem.spec.failover import FailoverDraft, FailoverVerifier
from tandem.spec.heads_payoff import HeadsVerdicts
from tandem.spec.heads_trees import heads_budget
from tandem.spec.loop import SpeculationLoop
from tandem.spec.options import REMOTE_METHODS, SpecOptions, check_tree_mode, heads_fallback, resolve_method
from tandem.spec.proposers import ContinuationCache
from tandem.spec.request import RequestState, StopConditions
from tandem.spec.room_queue import RoomQueue
from tandem.structured_output import check_response_format
from tandem.text_stream import TextStream
from tandem.tokenizer import bad_word_ids, encode_messages, encode_prompt, template_kwargs
from tandem.tool_call_deltas import ToolCallDelta
from tandem.tool_calls import HermesFormat, ToolCall, ToolCallParser, ToolUse, check_tool_schemas
from tandem.tracing import RequestTrace, carrier
from tandem.v1 import generation_pb2, generation_pb2_grpc

log = logging.getLogger(__name__)

# A client's request id is echoed in every reply chunk and carried in every worker call's sequence id and log line.
MAX_REQUEST_ID_CHARS = 128
MAX_CACHE_KEY_CHARS = 256  # GenerateRequest.cache_key (OpenAI's prompt_cache_key): a name, hashed for routing


@dataclass(slots=True)
class _Request:
    """One request in the coordinator: its state, its loop and the replicas it runs on."""

    request_id: str
    state: RequestState
    options: SpecOptions
    placement: Placement
    loop: SpeculationLoop
    emitted_tokens: int = 0
    tool_calls: ToolCallParser | None = None  # with tools shown: the text split into content and calls
    prompt_scores_sent: bool = False  # asked (sampling.prompt_logprobs): the first message carried them
    prompt_ids_asked: bool = False  # return_prompt_token_ids: the reply carries the prompt's tokens, scored or not
    trace: RequestTrace = field(default_factory=RequestTrace)  # its span (tandem.tracing); does nothing untraced


class _MetricsObserver:
    """The loop's round events, as Prometheus metrics."""

    def __init__(self, metrics: CoordinatorMetrics) -> None:
        self.metrics = metrics

    def on_round(self, k: int, drafted: int, accepted: int, source: str) -> None:
        self.metrics.chosen_k.observe(k)
        self.metrics.vllm.round(drafted, accepted)
        if drafted:
            self.metrics.accepted_len.observe(accepted)
            self.metrics.proposals.labels(source).inc()
            self.metrics.proposed_tokens.labels(source).inc(drafted)
            self.metrics.accepted_tokens.labels(source).inc(accepted)

    def on_verify(self, seconds: float) -> None:
        self.metrics.verify_latency.observe(seconds)

    def on_draft(self, seconds: float) -> None:
        self.metrics.draft_latency.observe(seconds)

    def on_cache_lookup(self, seconds: float, tier: str | None) -> None:
        self.metrics.cache_lookup_latency.observe(seconds)
        self.metrics.cache_lookups.labels(tier or "miss").inc()


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, cfg: CoordinatorConfig, tokenizer: Any, targets: WorkerPool, drafts: WorkerPool,
                 server: ManagedServer, metrics: CoordinatorMetrics, cache: ContinuationCache | None = None,
                 match_rates: MatchRates | None = None) -> None:
        self.cfg = cfg
        self.cache = cache  # the continuation cache every request learns from and proposes with
        self.tokenizer = tokenizer
        self.targets = targets
        self.drafts = drafts
        self.server = server
        self.metrics = metrics
        self.observer = _MetricsObserver(metrics)
        self.vocab_size = 0  # from the target workers' Info, set by the warm-up
        self.max_context = 0
        self.model_stop_ids: frozenset[int] = frozenset()
        self.costs = PairCosts(self._present)  # per (method, draft, target) pair of replicas the pools hold
        self.match_rates = match_rates or MatchRates()  # acceptance per kind of n-gram match, over every request here
        self.heads_verdicts = HeadsVerdicts()  # which way (the heads or not) the requests here found faster
        self.public_name = ReplicaNames(cfg.expose_worker_addresses, self._present)
        self.tool_format = HermesFormat.of(tokenizer)  # None: the chat template shows the model no tools
        self.infill_format = InfillFormat.of(tokenizer)  # None: the model has no fill-in-the-middle tokens
        self._releases: set[asyncio.Task] = set()  # ended requests' sequences being released on their workers
        # Requests waiting for room in a full target pool, taking their turns by priority and age
        self.room_queue = RoomQueue()
        # The requests running now: a drain waits for them, and ends with a clear error those its grace cannot
        self.in_flight = InFlight()

    # ----- releases --------------------------------------------------------
    def _release_later(self, release: Coroutine[Any, Any, None]) -> None:
        """An ended request's release, run after its reply: it waits for the batch step under way on each worker
        (a chunk of a long prompt: seconds on a CPU), which the client need not wait for. Its sequence's Release
        is queued on the worker before anything the client sends next."""
        task = asyncio.ensure_future(release)
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        task.add_done_callback(lambda _: self.room_queue.room_freed())  # the first waiting for room asks now
        task.add_done_callback(lambda done: done.cancelled() or done.exception())  # (each release logs its own)

    async def drain(self, grace_s: float) -> None:
        """Draining (no new requests are taken): those in flight get ``grace_s`` to finish, and those still running
        shortly before it is up are ended with an error that says why (``coordinator.in_flight``)."""
        if len(self.in_flight):
            log.info("coordinator: %d request(s) in flight get up to %.1fs to finish", len(self.in_flight), grace_s)
        ended = await self.in_flight.drain(grace_s)
        if ended:
            log.warning("coordinator: ended %d request(s) still running as the drain grace (%.1fs, --drain-grace) "
                        "ran out; their clients were told to send them again", ended, grace_s)

    async def finish_releases(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the releases under way (at shutdown, before the worker channels close)."""
        if self._releases:
            await asyncio.wait(list(self._releases), timeout=timeout_s)

    # ----- RPCs ------------------------------------------------------------
    async def Generate(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        run = self.start(request, context.time_remaining(), carrier(context.invocation_metadata()))
        async for _ in self._drive(run):
            pass
        text, calls = run.state.text.text, []
        if run.tool_calls is not None:
            text, calls = run.tool_calls.feed(text, final=True)
        return generation_pb2.GenerateResponse(
            request_id=run.request_id, text=text, token_ids=run.state.generated,
            finish_reason=_finish_reason(run), stats=self._stats(run),
            logprobs=logprobs_to_proto(run.state.logprobs), tool_calls=_calls_to_proto(calls),
            **_prompt_scores(run.state, run.prompt_ids_asked))

    async def GenerateStream(self, request: generation_pb2.GenerateRequest, context: grpc.aio.ServicerContext):
        run = self.start(request, context.time_remaining(), carrier(context.invocation_metadata()))
        async for msg in self.stream(run):
            yield msg

    async def Info(self, request: generation_pb2.InfoRequest, context: grpc.aio.ServicerContext):
        """The fleet as the last periodic poll of the workers saw it (every ``info_poll_s``, 1 s): a client's Info
        calls no worker, and leaves the placement counts that spread a burst alone."""
        def status(pool: WorkerPool) -> list[generation_pb2.WorkerStatus]:
            return [generation_pb2.WorkerStatus(address=self.public_name(c), healthy=c.healthy, info=c.info,
                                                state=c.state, active_requests=c.active) for c in pool.clients]
        draft_info = next((c.info for c in self.drafts.clients if c.verified), None)
        return generation_pb2.InfoResponse(
            target_model=self.target_model(), draft_model=draft_info.model if draft_info else "",
            vocab_size=self.vocab_size, max_context=self.served_context(),
            target_workers=status(self.targets), draft_workers=status(self.drafts))

    def target_model(self) -> str:
        """The served model's name in replies: the first ``--served-model-name``, else its target workers' name
        (empty before one has answered)."""
        return self.cfg.served_model_names[0] if self.cfg.served_model_names else self.targets.served_model()

    def model_names(self) -> tuple[str, ...]:
        """Every name a request may call the served model by (``--served-model-name``, else the workers' one)."""
        return self.cfg.served_model_names or (self.targets.served_model(),)

    # ----- the request path, written once for both APIs (gRPC here, HTTP in coordinator/http) -----------
    def start(self, request: generation_pb2.GenerateRequest, remaining_s: float | None,
              trace_headers: Mapping[str, str] | None = None) -> _Request:
        """The request validated and placed on its replicas, ready to ``stream``; nothing is sent to a worker yet.
        Raises ``InvalidRequestError`` naming a bad field, ``ShuttingDownError`` while draining. ``remaining_s``:
        the client's deadline, passed on to every worker call (None: none); ``trace_headers``: the caller's W3C
        trace context (``tandem.tracing.carrier``), which the request's span joins when tracing is on."""
        self.server.check_accepting()
        state, options, tools = self._validate(request)
        deadline = None if remaining_s is None else asyncio.get_running_loop().time() + remaining_s
        request_id = request.request_id or uuid.uuid4().hex[:16]
        trace = self.server.tracing.request(trace_headers or {}, state.stats.started_at, request_spans.opening(
            request_id, self.target_model(), state, options, request.priority))
        try:  # (a request refused here, say with no healthy replica, still ends its span: as an error)
            placement = Placement(self.targets, self.drafts, options.uses_draft, deadline, self.cfg.max_moves,
                                  self.cfg.move_wait_s, on_move=lambda role: self._moved(role, trace),
                                  key=self._routing_key(state.prompt_ids, request.cache_key),
                                  max_len=len(state.prompt_ids) + state.stop.max_new_tokens + IN_FLIGHT_TOKENS,
                                  priority=request.priority,
                                  # (the wall clock: targets compare it with other coordinators' requests)
                                  arrival_time=time.time() - (time.perf_counter() - state.stats.started_at),
                                  room=self.room_queue, metadata=trace.metadata)
            costs = self.costs.get(options.method, placement.draft, placement.target)
            # Request ids are the client's and get reused: 122 random bits make the sequence id unique on every
            # worker (a worker refuses a Prefill of a live id rather than hand one request's state to another).
            seq_id = f"{request_id}-{uuid.uuid4().hex}"
            # The request's channels survive their replicas (moves, preemption) by the placement's pools.
            verifier = FailoverVerifier(placement.verifier(), placement, state, lambda target: heads_budget(
                options, state, self.max_context, target.fitted_cost(), first=True), waiting=self.metrics.vllm.waiting,
                room=self.room_queue, queue_key=(request.priority, state.stats.started_at),
                room_hold_s=self.cfg.room_hold_s, on_refused=partial(self._refused_for_room, trace))
            channel = placement.draft_channel()
            draft = FailoverDraft(channel, placement, state.stats) if channel is not None else None
            loop = SpeculationLoop(state, seq_id, options, verifier, draft, costs, self.max_context, self.observer,
                                   self.cache, match_rates=self.match_rates, heads_verdicts=self.heads_verdicts,
                                   release_later=self._release_later)
            parser = None
            if tools is not None and tools.shown:  # auto's calls may be plain JSON too; enforced ones are blocks
                parser = ToolCallParser(frozenset() if tools.enforced else frozenset(t.name for t in tools.callable()))
            return _Request(request_id, state, options, placement, loop, tool_calls=parser,
                            prompt_ids_asked=request.return_prompt_token_ids, trace=trace)
        except Exception as exc:
            _end_refused(trace, f"{type(exc).__name__}: {exc}")
            raise

    @staticmethod
    def abandon(run: _Request, reason: str) -> None:
        """A started request that will not run (another choice of its HTTP request was refused): nothing was sent
        to a worker, so only its span is left to end, as refused."""
        _end_refused(run.trace, reason)

    @staticmethod
    def _refused_for_room(trace: RequestTrace, preempted: bool, held_s: float) -> None:
        # (the wait that follows shows as the gap before its next call's span; all of them: time_in_queue)
        trace.event("preempted" if preempted else "refused_for_room", **{"tandem.refused_after_s": round(held_s, 6)})

    def _moved(self, role: str, trace: RequestTrace) -> None:
        self.metrics.moves.labels(role).inc()
        trace.event("moved", **{"tandem.role": role})  # (its new replica: the span's tandem.*_worker at the end)

    async def stream(self, run: _Request) -> AsyncIterator[generation_pb2.GenerateStreamResponse]:
        """Run a started request: a message per round with what it added; the last has finish_reason and stats.
        Closing the iterator early (the client went away) cancels the request and frees its KV."""
        async for _ in self._drive(run):
            state = run.state
            text = state.text.take()
            start, run.emitted_tokens = run.emitted_tokens, state.num_generated
            tokens = state.generated[start:]
            done = state.finish_reason is not None
            calls: list[ToolCall] = []
            deltas: list[ToolCallDelta] = []
            if run.tool_calls is not None:  # calls out of the text, as written and once complete; the rest: content
                text, calls = run.tool_calls.feed(text, final=done)
                deltas = run.tool_calls.take_deltas()
            if not (text or tokens or done or calls or deltas):
                continue
            msg = generation_pb2.GenerateStreamResponse(
                request_id=run.request_id, text=text, token_ids=tokens, tool_calls=_calls_to_proto(calls),
                tool_call_deltas=[generation_pb2.ToolCallDelta(id=d.id, name=d.name, arguments=d.arguments)
                                  for d in deltas])
            if state.logprobs is not None:
                msg.logprobs.extend(logprobs_to_proto(state.logprobs[start:run.emitted_tokens]))
            if not run.prompt_scores_sent:
                run.prompt_scores_sent = True
                for name, value in _prompt_scores(state, run.prompt_ids_asked).items():
                    getattr(msg, name).extend(value)
            if done:
                msg.finish_reason = _finish_reason(run)
                msg.stats.CopyFrom(self._stats(run))
            yield msg

    async def _drive(self, run: _Request) -> AsyncIterator[None]:
        state, metrics = run.state, self.metrics
        metrics.active.inc()
        metrics.vllm.started()
        run.placement.enter()
        outcome = "error"
        error: str | None = None
        emitted = 0
        last = state.stats.started_at
        with self.in_flight.running() as tracked:  # (around the except below, which asks whose cancellation it was)
            try:
                async for _ in run.loop.run():
                    now = time.perf_counter()
                    new = state.num_generated - emitted
                    if new:
                        if emitted == 0:
                            run.trace.event("first_token")
                            metrics.ttft.observe(now - state.stats.started_at)
                            metrics.vllm.ttft.observe(now - state.stats.started_at)
                        else:
                            for _ in range(new):
                                metrics.itl.observe((now - last) / new)
                                metrics.vllm.itl.observe((now - last) / new)
                        metrics.generated_tokens.inc(new)
                        emitted, last = state.num_generated, now
                    tracked.inside = False  # (handed to the API: a drain ending it now waits for its next round)
                    yield
                    tracked.inside = True
                    tracked.check()
                outcome = "ok"
            except asyncio.CancelledError:
                ended = tracked.ended()  # the drain grace ran out: the client hears why (coordinator.in_flight)
                if ended is None:
                    outcome = "cancelled"
                    raise
                raise ended from None
            except GeneratorExit:
                outcome = "cancelled"
                raise
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"
                raise
            finally:
                if outcome == "error" and tracked.reason:
                    outcome = "drained"  # ended by the coordinator's drain (coordinator.in_flight)
                    error = error or tracked.reason
                if run.trace.recording:
                    run.trace.finish(request_spans.closing(state, outcome, self.public_name(run.placement.target),
                                                           self.public_name(run.placement.draft)),
                                     error=error or ("the request failed" if outcome in ("error", "drained") else None))
                if self.cfg.log_requests:
                    draft = run.placement.draft  # (addresses, as the rest of the operator's log names workers)
                    log.info("%s", request_line(run.request_id, run.options.method, state, outcome,
                                                run.placement.target.address, draft.address if draft else "", error))
                run.placement.leave()
                metrics.active.dec()
                metrics.requests.labels(outcome).inc()
                stats = state.stats
                metrics.vllm.finished(stats, outcome, state.finish_reason, len(state.prompt_ids))
                if stats.preemptions:
                    metrics.preemptions.inc(stats.preemptions)
                if stats.room_waits:
                    metrics.room_waits.inc(stats.room_waits)
                if stats.draft_wait_rounds:
                    metrics.draft_wait_rounds.inc(stats.draft_wait_rounds)
                if stats.drafted:
                    metrics.acceptance_rate.observe(stats.acceptance_rate)
                if stats.rounds:
                    waited = stats.draft_wait_s + stats.verify_wait_s
                    metrics.overhead.observe(max(0.0, stats.round_wall_s - waited) / stats.rounds)
                if outcome == "ok" and stats.elapsed_s > 0:
                    metrics.tokens_per_s.observe(stats.tokens_per_s)

    def _validate(self, request: generation_pb2.GenerateRequest
                  ) -> tuple[RequestState, SpecOptions, ToolUse | None]:
        """The request's state, speculation options and tools; INVALID_ARGUMENT naming the field on bad input."""
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError(f"request_id: at most {MAX_REQUEST_ID_CHARS} characters, "
                                      f"got {len(request.request_id)}")
        if not request.request_id.isprintable():  # a newline in it would forge lines in every log that names it
            raise InvalidRequestError("request_id: printable characters only (no control or format characters)")
        if len(request.cache_key) > MAX_CACHE_KEY_CHARS:
            raise InvalidRequestError(f"cache_key: at most {MAX_CACHE_KEY_CHARS} characters, "
                                      f"got {len(request.cache_key)}")
        if request.priority and self.cfg.scheduling_policy != "priority":
            raise InvalidRequestError(f"priority: this server schedules first come, first served, so a priority "
                                      f"must be 0, got {request.priority} (start the coordinator with "
                                      "--scheduling-policy priority to use them)")
        sampling = _field("sampling", lambda: sampling_from_proto(request.sampling))
        if request.sampling.bad_words:
            sampling = replace(sampling, bad_word_ids=(*sampling.bad_word_ids,
                                                       *_field("bad_words", lambda: bad_word_ids(
                                                           self.tokenizer, request.sampling.bad_words))))
        spec = request.speculation
        # auto drafts with a model only while a draft replica is healthy (n-gram until one is); an explicit
        # draft method needs one that is at least usable.
        requested = spec.method or "auto"
        has_draft = self.drafts.has_healthy() if requested == "auto" else self.drafts.has_routable()
        heads = self.targets.heads_kind()
        method = _field("speculation.method", lambda: resolve_method(requested, has_draft, REMOTE_METHODS, heads))
        k = spec.k if spec.HasField("k") else self.cfg.default_k
        if not 0 <= k <= MAX_K:
            raise InvalidRequestError(f"speculation.k must be in 0..{MAX_K}, got {k}")
        if not 0 <= spec.heads_nodes <= MAX_K:
            raise InvalidRequestError(f"speculation.heads_nodes must be in 0..{MAX_K} (0: chosen by the target's "
                                      f"forward cost), got {spec.heads_nodes}")
        tools = self._tools(request)
        if tools is not None and tools.enforced:  # calls that must be made: a grammar the target enforces
            if sampling.structured:
                raise InvalidRequestError("tool_choice: a call that must be made cannot also follow a response "
                                          "format or grammar; give one")
            sampling = replace(sampling, grammar=self.tool_format.grammar(tools))
        prompt_ids = self._prompt_ids(request, tools)
        stopping = request.stopping
        if stopping.max_new_tokens < 0:
            raise InvalidRequestError(f"stopping.max_new_tokens must be positive, got {stopping.max_new_tokens}")
        limit = self.cfg.max_new_tokens_limit
        max_new = stopping.max_new_tokens or self.cfg.default_max_new_tokens
        if not stopping.max_new_tokens and stopping.up_to_context:  # (the prompt is shorter than the context)
            max_new = min(self.max_context - len(prompt_ids), limit or self.max_context)
        if limit is not None and max_new > limit:
            raise InvalidRequestError(f"stopping.max_new_tokens: {max_new} is more than this server allows ({limit})")
        served = self.served_context()
        if len(prompt_ids) + max_new > served:
            if stopping.max_new_tokens:  # the client's own number: refused
                raise ContextLengthError(
                    f"stopping.max_new_tokens: {max_new} is too large: {self._context_sentence(served)}, and the "
                    f"prompt is {token_count_text(len(prompt_ids))} ({max_new} > {served} - {len(prompt_ids)})")
            max_new = served - len(prompt_ids)  # a default: as many as fit (the prompt itself fits, checked before)
        check_token_ids("stopping.stop_token_ids", stopping.stop_token_ids, self.vocab_size)
        check_token_ids("logit_bias", (t for t, _ in sampling.logit_bias), self.vocab_size)
        check_token_ids("allowed_token_ids", sampling.allowed_token_ids, self.vocab_size)
        check_token_ids("bad_words", (t for word in sampling.bad_word_ids for t in word), self.vocab_size)
        check_response_format(sampling)  # a schema the workers could not compile is the client's error, named here
        if any(not s for s in stopping.stop_strings):
            raise InvalidRequestError("stopping.stop_strings: empty strings are not allowed")
        stop_ids = frozenset(stopping.stop_token_ids) | (frozenset() if stopping.ignore_eos else self._end_ids(request))
        if not 0 <= stopping.min_new_tokens <= max_new:
            raise InvalidRequestError(f"stopping.min_new_tokens must be in 0..{max_new} (the request's max new "
                                      f"tokens), got {stopping.min_new_tokens}")
        if stopping.min_new_tokens and sampling.structured:  # a grammar's end may come first: no token left
            raise InvalidRequestError("stopping.min_new_tokens cannot hold back the end of a response format, "
                                      "grammar or required tool call: give one")
        # The workers hold these stop tokens back until then (tandem.penalties); set here, whatever the client sent.
        sampling = replace(sampling, min_tokens=stopping.min_new_tokens,
                           min_tokens_stop_ids=tuple(sorted(stop_ids)) if stopping.min_new_tokens else ())
        stop = StopConditions(max_new, stop_ids, tuple(stopping.stop_strings))
        tree = _field("speculation.tree", lambda: check_tree_mode(spec.tree or "auto"))
        options = SpecOptions(method, k, adaptive_k=not spec.fixed_k,
                              pipelined=self.cfg.pipelining and not spec.disable_pipelining,
                              draft_stops=self.cfg.draft_stops,
                              ngram_min=self.cfg.ngram_min, ngram_max=self.cfg.ngram_max, tree=tree,
                              heads_nodes=spec.heads_nodes, heads_fallback=heads_fallback(requested, method, has_draft),
                              lookup_k_max=k if spec.HasField("k") else MAX_K)
        text = TextStream(self.tokenizer, stop.stop_strings, stop_ids, include_stop=stopping.include_stop_string)
        return RequestState(prompt_ids, sampling, stop, text, self._prediction_ids(spec.prediction)), options, tools

    def _prediction_ids(self, prediction: str) -> list[int]:
        """``speculation.prediction``'s tokens (as the answer would spell them: no special tokens added)."""
        if not prediction:
            return []
        ids = list(self.tokenizer.encode(prediction, add_special_tokens=False))
        if len(ids) > self.max_context:
            raise InvalidRequestError(f"speculation.prediction: {len(ids)} tokens is longer than the model's context "
                                      f"of {self.max_context}, so no answer could repeat it")
        return ids

    def _tools(self, request: generation_pb2.GenerateRequest) -> ToolUse | None:
        """The request's tools, validated (``tool_use``); None without any."""
        if not request.HasField("tools"):
            return None
        return self.tool_use(request.tools, in_conversation=request.WhichOneof("input") == "messages")

    def tool_use(self, options: generation_pb2.ToolOptions, in_conversation: bool = True) -> ToolUse | None:
        """Tools as a request gives them, validated; None without any. Tools need a conversation, and shown ones a
        template that shows them in the format the calls are parsed in. (/tokenize checks its tools here too.)"""
        tools = tool_use(options)  # refuses a call that must be made without tools
        if not tools.tools:
            return None
        if not in_conversation:
            raise InvalidRequestError("tools: only with messages (a conversation)")
        if tools.shown:
            if self.tool_format is None:
                raise InvalidRequestError(
                    "tools: this model's chat template does not show the model tools with <tool_call> blocks, the "
                    "format Tandem parses calls in; serve it with --chat-template FILE (one that does) to use tools")
            check_tool_schemas(tools)
        return tools

    def _prompt_ids(self, request: generation_pb2.GenerateRequest, tools: ToolUse | None = None) -> list[int]:
        which = request.WhichOneof("input")
        if which == "token_ids":
            field = "token_ids.ids"
            ids = list(request.token_ids.ids)
            if not ids:
                raise InvalidRequestError("token_ids.ids: empty (nothing to continue): give at least one token")
            check_token_ids("token_ids.ids", ids, self.vocab_size)
        elif which == "messages":
            field = "messages"
            turns = conversation(request.messages.messages)
            shown = tools.template_entries() if tools is not None else None
            kwargs = _field("messages.template_kwargs", lambda: template_kwargs(request.messages.template_kwargs))
            try:
                ids = _field("messages", lambda: chat_template_refusals(lambda: encode_messages(
                    self.tokenizer, turns, shown, continue_final=request.messages.continue_final_message,
                    kwargs=kwargs), kwargs))
            except TemplateVariablesError as exc:
                raise InvalidRequestError(f"messages.template_kwargs: {exc}") from None
        elif which == "infill":
            field = "infill"
            if self.infill_format is None:
                raise InvalidRequestError(no_infill_message("infill"))
            if not request.infill.prefix and not request.infill.suffix:
                raise InvalidRequestError("infill: both prefix and suffix are empty: give the text around the gap")
            if request.chat:
                raise InvalidRequestError("chat: not with infill (a fill-in-the-middle prompt has no chat template)")
            if request.HasField("truncate_prompt_tokens"):  # (a cut front would take the prefix marker with it)
                raise InvalidRequestError("truncate_prompt_tokens: not with infill; shorten the prefix instead")
            ids = self.infill_format.prompt_ids(self.tokenizer, request.infill.prefix, request.infill.suffix)
        else:
            field = "text"
            if not request.text:
                raise InvalidRequestError("text: empty (nothing to continue): give some text")
            ids = _field("chat", lambda: chat_template_refusals(lambda: encode_prompt(
                self.tokenizer, request.text, request.chat)))
            if not ids:  # text a tokenizer drops entirely would reach the target as an empty prompt
                raise InvalidRequestError("text: the prompt has no tokens")
        limit = self.cfg.max_prompt_tokens
        if request.HasField("truncate_prompt_tokens"):
            ids = self._truncated(ids, request.truncate_prompt_tokens)
        served = self.served_context()
        if limit is not None and len(ids) > limit:
            raise PromptTooLongError(f"{field}: the prompt is {len(ids)} tokens; this server takes prompts of at most "
                                     f"{limit} ({self._context_sentence(served)})")
        if len(ids) >= served:  # (an answer needs one token of room at least)
            raise PromptTooLongError(f"prompt: {self._context_sentence(served)}, and the prompt is {len(ids)} tokens, "
                                     f"which leaves no room for an answer; shorten it")
        return ids

    def _context_sentence(self, served: int) -> str:
        """"this model's maximum context length is N tokens", worded as OpenAI and vLLM word it (clients recognise an
        overflow by it: ``ContextLengthError``), with where N comes from when the targets' KV pools set it."""
        if served >= self.max_context:
            return f"this model's maximum context length is {served} tokens"
        return (f"this model's maximum context length is {served} tokens here (what a target worker's KV cache holds "
                f"for one sequence, less a round in flight; the model's own is {self.max_context}; the workers' "
                f"--kv-cache-tokens)")

    def _end_ids(self, request: generation_pb2.GenerateRequest) -> frozenset[int]:
        """The tokens that end the answer as the model's own end: its end tokens, and for an infill its format's (a
        middle ends at Qwen's ``<|endoftext|>`` or a ``<|file_sep|>``, where a chat answer ends at ``<|im_end|>``)."""
        if request.WhichOneof("input") == "infill" and self.infill_format is not None:
            return self.model_stop_ids | self.infill_format.stop_ids
        return self.model_stop_ids

    def _truncated(self, ids: list[int], keep: int) -> list[int]:
        """``truncate_prompt_tokens``: the prompt's last ``keep`` tokens; -1: as many as this server takes."""
        if keep == -1:
            keep = self.served_context() - 1  # (one token of room for the answer)
            if self.cfg.max_prompt_tokens is not None:
                keep = min(keep, self.cfg.max_prompt_tokens)
        if keep < 1:
            raise InvalidRequestError(f"truncate_prompt_tokens must be -1 (as many as this server takes) or >= 1, "
                                      f"got {keep}")
        return ids[-keep:]

    def served_context(self) -> int:
        """The longest prompt and answer this coordinator takes: the model's context, or less where the targets' KV
        pools hold less (what /v1/models says as max_model_len, so that a client sizes its prompts by it)."""
        room = self.sequence_room()
        return self.max_context if room is None else min(self.max_context, room)

    def sequence_room(self) -> int | None:
        """The most tokens (prompt and answer) one sequence may reach on a usable target: the largest KV pool among
        them, less the tokens a round may hold in flight; None while none has answered. A request past it would
        wait for room that never comes (refused as full, retried, and failed as "retry later" minutes on). One
        that only the larger replicas hold is placed on them (``WorkerPool.pick``); the smallest bounded every
        request before, so one small replica made a fleet refuse what its others could serve."""
        rooms = [room for c in self.targets.clients if c.routable and (room := c.sequence_room()) is not None]
        return max(rooms) if rooms else None

    def _routing_key(self, prompt_ids: list[int], cache_key: str = "") -> bytes | None:
        """The client's cache key's routing key, else the prompt's prefix key (None with --placement load); not at
        the targets' KV block size (the module doc of coordinator/prefix_routing.py says why)."""
        if self.cfg.placement != "prefix":
            return None
        return client_key(cache_key) if cache_key else routing_key(prompt_ids)

    def _present(self) -> set[tuple[str, str]]:
        """(role, address) of every replica the pools hold now, leaving ones included."""
        return {(c.role, c.address) for pool in (self.targets, self.drafts) for c in pool.clients}

    def _stats(self, run: _Request) -> generation_pb2.GenerationStats:
        st = run.state.stats
        return generation_pb2.GenerationStats(
            prompt_tokens=len(run.state.prompt_ids), generated_tokens=st.generated, drafted=st.drafted,
            accepted=st.accepted, rounds=st.rounds, mean_accepted_len=st.mean_accepted_len,
            acceptance_rate=st.acceptance_rate, tokens_per_s=st.tokens_per_s,
            time_to_first_token_s=st.first_token_s, elapsed_s=st.elapsed_s, method=run.options.method,
            draft_worker=self.public_name(run.placement.draft), target_worker=self.public_name(run.placement.target),
            target_moves=st.target_moves, draft_moves=st.draft_moves, preemptions=st.preemptions,
            tree_rounds=st.tree_rounds, branch_tokens=st.branch_tokens, prompt_tokens_reused=st.prompt_tokens_reused,
            draft_wait_rounds=st.draft_wait_rounds, forced_tokens=st.forced_tokens,
            prediction_accepted=st.prediction_accepted, prediction_rejected=st.prediction_rejected,
            queue_s=st.queue_s)


def _finish_reason(run: _Request) -> str:
    """``tool_calls`` when the model stopped after calling tools; else the request's own (stop or length)."""
    reason = run.state.finish_reason or "length"
    if reason == "stop" and run.tool_calls is not None and run.tool_calls.calls:
        return "tool_calls"
    return reason


def _calls_to_proto(calls: list[ToolCall]) -> list[generation_pb2.ToolCall]:
    return [generation_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments) for c in calls]


def _field(name: str, make: Any) -> Any:
    """Run a validator; prefix its message with the request field it is about."""
    try:
        return make()
    except ValueError as exc:
        raise InvalidRequestError(f"{name}: {exc}") from None


def _prompt_scores(state: RequestState, ids_asked: bool = False) -> dict[str, Any]:
    """A reply's prompt log-probabilities and the prompt they score, when the request asked for them; the prompt's
    tokens alone when it asked for those (``return_prompt_token_ids``)."""
    if state.prompt_logprobs is None:
        return {"prompt_token_ids": state.prompt_ids} if ids_asked else {}
    return {"prompt_logprobs": logprobs_to_proto(state.prompt_logprobs), "prompt_token_ids": state.prompt_ids}


def _end_refused(trace: RequestTrace, reason: str) -> None:
    """A request's span that ends before the request ran (refused, or a choice of one refused): said so, and why."""
    trace.finish({"tandem.outcome": "refused"}, error=reason)
