"""The OpenAI-compatible HTTP API: aiohttp on the coordinator's own event loop, beside grpc.aio.

Routes: ``POST /v1/chat/completions``, ``POST /v1/completions`` (whole or streamed
as server-sent events), ``POST /v1/responses`` (OpenAI's Responses API, run as the chat
completion it asks for), ``GET /v1/models`` (and ``/v1/models/{id}``), ``GET /health``,
``GET /metrics`` (the coordinator's Prometheus metrics, as on its metrics port: vLLM serves them here, so a
scrape configured for it finds them), ``GET /version``, and vLLM's tokenizer routes ``POST /tokenize``,
``POST /detokenize``, ``GET /tokenizer_info`` (``coordinator.http.tokenize``), and SageMaker's ``GET``/``POST /ping``
(``/health``'s answer) and ``POST /invocations`` (a chat completion or a completion, by the body's fields).

Only the edges are HTTP's. A request goes the gRPC API's way, in process: the
same bearer tokens and per-client budget (``AccessControl``: ``identify``,
``hold``; a client's budget is one across both APIs, ``n`` choices take n of
it), then ``GenerationService.start`` (the one validation, the operator's
limits, placement, the client's deadline) and ``GenerationService.stream`` (the
speculation loop). ``n`` choices are n requests of the same prompt, run
concurrently; a completions call with a list of prompts runs ``n`` of each.
A client that goes away cancels its requests (aiohttp cancels the handler,
``handler_cancellation``), which frees their KV on the workers as a cancelled
gRPC call does.

Errors are OpenAI's JSON (``coordinator.http.errors``), also for routes and
methods that do not exist; 503 while the coordinator is starting or draining.
With ``--tls-cert`` the port speaks TLS too (mutual with ``--tls-client-ca``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from coordinator.access import AccessControl
from coordinator.http import tokenize
from coordinator.http.errors import ApiError, bad_field, from_domain
from coordinator.http.protocol_log import protocol_logger
from coordinator.http.responses import Choice, Shapes, TokenTexts, share_prompt_scores
from coordinator.http.responses_input import parse_responses
from coordinator.http.responses_output import ResponseShapes, ResponseStream
from coordinator.http.schema import ParsedRequest, parse_chat, parse_completion, parse_json
from coordinator.service import GenerationService
from tandem import __version__
from tandem.config import CoordinatorConfig
from tandem.errors import ListenError
from tandem.rpc.connection_age import ConnectionAge
from tandem.rpc.tls import ServerTLS
from tandem.tracing import carrier
from tandem.v1 import generation_pb2

log = logging.getLogger(__name__)

RETRY_AFTER_S = "1"  # told to clients refused for load or while starting: when to try again
Parse = Callable[[dict[str, Any], str], ParsedRequest]


class HttpApi:
    """The HTTP server of one coordinator; ``start`` binds it (``port`` then holds the port), ``stop`` drains it."""

    def __init__(self, service: GenerationService, access: AccessControl, cfg: CoordinatorConfig,
                 tokenizer: Any, registry: CollectorRegistry | None = None) -> None:
        self.service = service
        self.registry = registry  # the coordinator's metrics (None: /metrics is 404)
        self.access = access
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.port = 0
        self.started = int(time.time())  # /v1/models' "created"
        self.runner: web.AppRunner | None = None

    # ----- lifecycle -------------------------------------------------------------------
    async def start(self) -> int:
        app = web.Application(client_max_size=self.cfg.max_request_bytes, middlewares=[self._errors])
        if self.cfg.server.max_connection_age_s is not None:  # (clients reconnect, and may reach another replica)
            app.on_response_prepare.append(ConnectionAge(self.cfg.server.max_connection_age_s).on_response_prepare)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/responses", self.responses)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/v1/models/{model:.+}", self.model)
        app.router.add_get("/health", self.health)
        # SageMaker's two routes, as vLLM serves them: a container there is probed on /ping and sent /invocations
        app.router.add_get("/ping", self.health)
        app.router.add_post("/ping", self.health)
        app.router.add_post("/invocations", self.invocations)
        app.router.add_get("/version", self.version)
        if self.registry is not None:
            app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        app.router.add_post("/detokenize", self.detokenize)
        app.router.add_get("/tokenizer_info", self.tokenizer_info)
        # handler_cancellation: a client that disconnects cancels its handler, hence its requests and their KV.
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None, logger=protocol_logger(),
                                    shutdown_timeout=self.cfg.server.drain_grace_s)
        await self.runner.setup()
        tls = self.cfg.server.tls
        host = self.cfg.server.host
        site = web.TCPSite(self.runner, host, self.cfg.http_port, ssl_context=ssl_context(tls) if tls else None)
        try:
            await site.start()
        except OSError as exc:
            await self.runner.cleanup()
            raise ListenError(f"HTTP API: cannot listen on {host}:{self.cfg.http_port} (--http-port): "
                              f"{exc.strerror or exc}") from None
        self.port = self.runner.addresses[0][1]
        log.info("HTTP API (OpenAI-compatible) listening on port %d%s", self.port, " (TLS)" if tls else "")
        return self.port

    async def stop(self) -> None:
        """Stop taking connections; requests in flight get the drain grace to finish."""
        if self.runner is not None:
            await self.runner.cleanup()

    # ----- routes -------------------------------------------------------------------------
    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, parse_chat)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, parse_completion)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's Responses API: the chat completion it asks for (``coordinator.http.responses_input``), shaped
        as a response object or its typed events (``coordinator.http.responses_output``)."""
        self._check_serving()
        client = self._client(request)
        asked = parse_responses(parse_json(await self._body(request)), request.headers.get("X-Request-Id", ""))
        parsed = asked.parsed
        model = self._served(parsed.model)
        with self.access.hold(client):
            parsed.request.request_id = parsed.request.request_id or uuid.uuid4().hex[:16]
            try:
                run = self.service.start(parsed.for_choice(0), parsed.timeout_s, carrier(request.headers))
            except Exception as exc:  # noqa: BLE001 - the service's refusals, named as this request's fields
                raise from_domain(exc, parsed.params) from None
            texts = TokenTexts(self.tokenizer) if parsed.logprobs is not None else None
            events = ResponseStream(ResponseShapes(parsed.request.request_id, model, asked.echo, texts))
            choice = Choice(0)
            if parsed.stream:
                return await self._stream_response(request, run, choice, events, parsed)
            try:  # built as its stream would be: the last event holds the whole response
                async for msg in self.service.stream(run):
                    choice.add(msg)
                    events.feed(choice, msg)
            except Exception as exc:  # noqa: BLE001
                raise from_domain(exc, parsed.params) from None
            return web.json_response(events.final(choice), headers={"X-Request-Id": parsed.request.request_id})

    async def _stream_response(self, request: web.Request, run: Any, choice: Choice, events: ResponseStream,
                               parsed: ParsedRequest) -> web.StreamResponse:
        """A response's typed events as server-sent events (``event: <type>`` lines); a failure after the first
        byte is an ``error`` event and ``response.failed``."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Request-Id": parsed.request.request_id})
        await response.prepare(request)
        for event in events.opening():
            await _send_typed(response, event)
        try:
            async for msg in self.service.stream(run):
                choice.add(msg)
                for event in events.feed(choice, msg):
                    await _send_typed(response, event)
        except Exception as exc:  # noqa: BLE001 - reported in the stream: the status line has gone already
            for event in events.failure(from_domain(exc, parsed.params)):
                await _send_typed(response, event)
        await response.write_eof()
        return response

    async def models(self, request: web.Request) -> web.Response:
        self._check_serving()
        with self.access.hold(self._client(request)):  # counted as gRPC's Info is: no call goes unbounded
            return web.json_response({"object": "list", "data": self._model_cards()})

    async def model(self, request: web.Request) -> web.Response:
        self._check_serving()
        with self.access.hold(self._client(request)):
            asked = request.match_info["model"]
            self._served(asked)
            return web.json_response(next(card for card in self._model_cards() if card["id"] == asked))

    async def tokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_call(request, lambda body: tokenize.tokenize(
            body, self.tokenizer, self.service.served_context(), self.service.infill_format, self.service.tool_use))

    async def detokenize(self, request: web.Request) -> web.Response:
        return await self._tokenizer_call(request, lambda body: tokenize.detokenize(
            body, self.tokenizer, self.service.vocab_size))

    async def tokenizer_info(self, request: web.Request) -> web.Response:
        self._check_serving()
        with self.access.hold(self._client(request)):
            return web.json_response(tokenize.tokenizer_info(self.tokenizer, self.service.max_context))

    async def _tokenizer_call(self, request: web.Request, answer: Callable[[dict[str, Any]], dict[str, Any]]
                              ) -> web.Response:
        """A tokenizer route: counted and checked as a completion is (token, budget, model), the tokenizer's own
        refusals (a conversation no template takes) named as the request's fields."""
        self._check_serving()
        with self.access.hold(self._client(request)):
            body = parse_json(await self._body(request))
            self._served(body.get("model") if isinstance(body.get("model"), str) else None)
            try:
                return web.json_response(answer(body))
            except Exception as exc:  # noqa: BLE001 - the service's refusals, named as this request's fields
                raise from_domain(exc, {"prompt": "messages"}) from None

    async def invocations(self, request: web.Request) -> web.StreamResponse:
        """SageMaker's inference route, as vLLM routes it: a body with ``messages`` is a chat completion, one with
        ``prompt`` a completion (streamed too, with ``stream``); the same token, limits and errors as those routes."""
        self._client(request)  # (a missing token is a 401 before anything of the body is said)
        body = parse_json(await self._body(request))  # (aiohttp keeps the body: the route reads it again)
        if "messages" in body:
            return await self.chat_completions(request)
        if "prompt" in body:
            return await self.completions(request)
        raise ApiError(400, "POST /invocations takes a chat completion (a body with messages) or a completion (a body "
                            "with prompt), and this body has neither")

    async def health(self, request: web.Request) -> web.Response:
        """200 while serving; 503 while starting (no target worker yet) or draining. No token needed."""
        self._check_serving()
        return web.json_response({"status": "serving"})

    async def version(self, request: web.Request) -> web.Response:
        """vLLM's ``/version``: the server's version. No token needed."""
        return web.json_response({"version": __version__})

    async def metrics(self, request: web.Request) -> web.Response:
        """The Prometheus text of the coordinator's metrics, what its metrics port serves; answered while starting
        and draining too, and with no token, as the metrics port (a scraper holds none)."""
        body = generate_latest(self.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # ----- a completion -------------------------------------------------------------------------
    async def _complete(self, request: web.Request, parse: Parse) -> web.StreamResponse:
        self._check_serving()
        client = self._client(request)
        parsed = parse(parse_json(await self._body(request)), request.headers.get("X-Request-Id", ""))
        model = self._served(parsed.model)
        budget = self.access.max_concurrent
        if 0 < budget < parsed.choices:  # never fits: a 429's "retry" would not help
            raise bad_field("prompt" if len(parsed.prompts) > 1 else "n",
                            f"this request starts {parsed.choices} completions at once; this server runs at most "
                            f"{budget} per client (--max-concurrent-per-client): send fewer per request")
        with self.access.hold(client, parsed.choices):
            parsed.request.request_id = parsed.request.request_id or uuid.uuid4().hex[:16]
            runs = []
            try:  # every choice validated and placed before anything runs or is sent
                for i in range(parsed.choices):
                    runs.append(self.service.start(parsed.for_choice(i), parsed.timeout_s, carrier(request.headers)))
            except Exception as exc:  # noqa: BLE001 - the service's refusals, named as this request's fields
                for run in runs:  # placed, never to run: refused with the request
                    self.service.abandon(run, f"another choice of its request was refused: {exc}")
                raise from_domain(exc, parsed.params) from None
            shapes = Shapes(parsed.chat, parsed.request.request_id, model, self.tokenizer, parsed.logprobs,
                            echo=parsed.prompts if parsed.echo else None, prompt_logprobs=parsed.prompt_logprobs,
                            token_ids=parsed.return_token_ids, tokens_as_ids=parsed.tokens_as_ids,
                            continuous_usage=parsed.continuous_usage)
            choices = [Choice(i, parsed.prompt_of(i)) for i in range(parsed.choices)]
            if parsed.stream:
                return await self._stream(request, runs, choices, shapes, parsed)
            try:
                await _together([self._collect(run, choice, prompt_only=parsed.prompt_only)
                                 for run, choice in zip(runs, choices)])
            except Exception as exc:  # noqa: BLE001
                raise from_domain(exc, parsed.params) from None
            if parsed.scores_each_prompt_once:
                share_prompt_scores(choices, parsed.n)
            return web.json_response(shapes.completion(choices, parsed.n),
                                     headers={"X-Request-Id": parsed.request.request_id})

    async def _collect(self, run: Any, choice: Choice, queue: asyncio.Queue | None = None,
                       prompt_only: bool = False) -> None:
        """Run one choice's request into ``choice``; streaming, each message also goes to ``queue``.
        ``prompt_only`` (max_tokens 0 with echo): what the request wrote is dropped, its prompt's part kept."""
        async for msg in self.service.stream(run):
            if prompt_only:
                msg = _prompt_part(msg)
            choice.add(msg)
            if queue is not None:
                queue.put_nowait((choice, msg))

    async def _stream(self, request: web.Request, runs: list[Any], choices: list[Choice], shapes: Shapes,
                      parsed: ParsedRequest) -> web.StreamResponse:
        """Server-sent events: each choice's chunks as its rounds finish, the usage if asked, then ``[DONE]``.
        A failure after the first byte is an ``error`` event (OpenAI's shape), then ``[DONE]``."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                               "X-Request-Id": parsed.request.request_id})
        await response.prepare(request)
        queue: asyncio.Queue = asyncio.Queue()

        async def run_one(run: Any, choice: Choice) -> None:
            try:
                await self._collect(run, choice, queue, prompt_only=parsed.prompt_only)
                queue.put_nowait((choice, None))
            except Exception as exc:  # noqa: BLE001 - passed to the writer, which reports it in the stream
                queue.put_nowait((choice, exc))

        tasks = [asyncio.ensure_future(run_one(run, choice)) for run, choice in zip(runs, choices)]
        try:
            for choice in choices:
                await _send(response, shapes.opening(choice.index))
            finished = 0
            while finished < len(tasks):
                choice, item = await queue.get()
                if item is None:
                    finished += 1
                elif isinstance(item, BaseException):
                    await _send(response, from_domain(item, parsed.params).body())
                    break
                else:
                    for chunk in shapes.chunks(choice, item):
                        await _send(response, chunk)
            else:
                if parsed.include_usage:
                    await _send(response, shapes.usage_chunk(choices, parsed.n))
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        finally:  # a client gone (cancelled handler, failed write) or a failed choice: stop the rest
            await _cancel(tasks)
        return response

    # ----- checks ---------------------------------------------------------------------------
    def _check_serving(self) -> None:
        server = self.service.server
        if server.draining:
            raise ApiError(503, "the coordinator is shutting down and takes no new work",
                           kind="service_unavailable_error", code="draining")
        if not server.serving:
            raise ApiError(503, "the coordinator is starting (waiting for a target worker); retry shortly",
                           kind="service_unavailable_error", code="starting")

    def _client(self, request: web.Request) -> str:
        """Who is calling, for the per-client budget: the bearer token's identity with auth on (else 401), or
        the peer's address, as gRPC counts it."""
        if self.access.auth is None:
            return request.remote or ""
        header = request.headers.get("Authorization")
        identity = self.access.identify(header)
        if identity is None:
            message = ("this API needs a bearer token: send the header 'Authorization: Bearer <token>' (the openai "
                       "client's api_key)" if not header else "the bearer token in 'Authorization' is not valid here")
            raise ApiError(401, message, kind="authentication_error", code="invalid_api_key")
        return identity

    async def _body(self, request: web.Request) -> bytes:
        try:
            return await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise ApiError(413, f"the request body is larger than this server takes ({self.cfg.max_request_bytes} "
                                "bytes, --max-request-bytes)", code="request_too_large") from None

    def _served(self, model: str | None) -> str:
        """The served model's id in replies; a request naming none of its names is 404."""
        names = self.service.model_names()
        if model is not None and model not in names:
            raise ApiError(404, f"the model {model!r} does not exist here: this server serves "
                                f"{' or '.join(repr(n) for n in names)}", param="model", code="model_not_found")
        return self.service.target_model()

    def _model_cards(self) -> list[dict[str, Any]]:
        """A card per name the model answers to (``--served-model-name``), as vLLM lists its served names."""
        context = self.service.served_context()
        return [{"id": name, "object": "model", "created": self.started, "owned_by": "tandem",
                 "max_model_len": context, "context_length": context} for name in self.service.model_names()]

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                      ) -> web.StreamResponse:
        """Every refusal in OpenAI's shape: ours, aiohttp's own (no such route, method), anything unexpected."""
        try:
            return await handler(request)
        except ApiError as exc:
            error = exc
        except web.HTTPException as exc:  # routing: 404 no such path, 405 method
            if exc.status < 400:
                raise
            message = f"{request.method} {request.path}: {exc.reason}"
            if exc.status in (404, 405):  # (an embeddings or audio client pointed here learns what is served)
                message += f"; this server answers {_routes(request.app)}"
            error = ApiError(exc.status, message, code=exc.reason.lower().replace(" ", "_"))
        except Exception as exc:  # noqa: BLE001 - from_domain maps it; an unexpected one is a 500, logged with its id
            error = from_domain(exc, where=request.path)
        headers = {"Retry-After": RETRY_AFTER_S} if error.status in (429, 503) else None
        return web.json_response(error.body(), status=error.status, headers=headers)


def _routes(app: web.Application) -> str:
    """Every route as "METHOD path", for a 404's message."""
    routes = {(route.resource.canonical, route.method) for route in app.router.routes()
              if route.method != "HEAD" and route.resource is not None}
    return ", ".join(f"{method} {path}" for path, method in sorted(routes))


def ssl_context(tls: ServerTLS) -> ssl.SSLContext:
    """The coordinator's certificate (its gRPC port's); with a client CA, clients must present one it signed."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(tls.cert, tls.key)
    if tls.client_ca is not None:
        context.load_verify_locations(tls.client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


async def _send(response: web.StreamResponse, event: dict[str, Any] | None) -> None:
    if event is not None:
        await response.write(b"data: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode()
                             + b"\n\n")


def _prompt_part(msg: generation_pb2.GenerateStreamResponse) -> generation_pb2.GenerateStreamResponse:
    """A stream message without what was written (max_tokens 0 with echo: the prompt is all that is asked)."""
    kept = generation_pb2.GenerateStreamResponse(
        request_id=msg.request_id, finish_reason=msg.finish_reason and "length", prompt_logprobs=msg.prompt_logprobs,
        prompt_token_ids=msg.prompt_token_ids)
    if msg.HasField("stats"):
        kept.stats.CopyFrom(msg.stats)
    return kept


async def _send_typed(response: web.StreamResponse, event: dict[str, Any]) -> None:
    """A typed event, as OpenAI streams the Responses API: its type on an ``event:`` line, then its JSON."""
    await response.write(b"event: " + event["type"].encode() + b"\ndata: "
                         + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n")


async def _together(coros: list[Coroutine[Any, Any, None]]) -> None:
    """Run all; the first failure cancels the others and is raised (as is a cancellation of the caller)."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        await _cancel(tasks)


async def _cancel(tasks: list[asyncio.Future]) -> None:
    """Cancel what still runs and wait for it (each request's loop releases its KV on the way out)."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
