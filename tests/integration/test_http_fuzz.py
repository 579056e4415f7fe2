"""Bad input over HTTP: malformed and extreme requests against a real coordinator's OpenAI API, good ones beside.

The idea of test_fuzz.py (the gRPC API's), at the HTTP edge: a coordinator of its own (small limits,
bearer tokens, a per-client budget, ``--http-port 0``) over the session's shared SmolLM2 workers. A seeded
generator sends raw bodies: valid requests of every shape (chat and completions, streamed or not, n
choices, logprobs, stops, seeds, the tandem extension), the same mutated byte by byte, fields of the wrong
type, absurd values (huge and negative numbers, NaN and Infinity literals, 1e308), unknown and unsupported
fields, invalid UTF-8, unicode edge cases, bodies over the size limit, deep nesting, prompts over the token
limit, unknown models, missing or wrong tokens, wrong routes and methods; some streams are dropped
mid-way by the client. Meanwhile a few good greedy requests run over and over, as another client.

Asserted: every reply is a status its case allows (never a 5xx), and every refusal is OpenAI's error
object (message, type, param, code) naming no worker's address; a 200 is a whole completion or a stream
ending in ``[DONE]``; every good request gives exactly its single run's text; no process exits; the
workers' KV pools return to their baseline. Bounded: 400 cases or 15 s (`make test`), 1500 or 90 s (long).
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import pytest

from tandem.v1 import generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.slow

SEED = 20261127
CONCURRENCY = 6  # senders; with n up to 3 they rarely pass the client budget below
CLIENT_BUDGET = 14
MAX_PROMPT_TOKENS = 128
MAX_REQUEST_BYTES = 65536
TOKEN = "fuzz-client-0123456789abcdef"  # the fuzzing client
GOOD_TOKEN = "good-client-0123456789abcdef"  # the good requests: a client of its own, so never over a budget
GOOD_PROMPTS = ("Write a story about a cat.", "def fibonacci(n):")
ERROR_KEYS = {"message", "type", "param", "code"}
INVALID_UTF8 = (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\xc0\xaf")
UNICODE = ("\u0000", "\u200b", "\u202e", "\ufeff", "\U0001f600", "e\u0301", "\u4e2d\u6587", "\r\n",
           "<|im_start|>", "<|endoftext|>", "\\u0000", "' OR 1=1 --", "\ud800")
ABSURD = (-1, 0, 1, 2**31, 2**64, -(2**70), 1e308, -1e308, 1e-320, 0.5, 3.0, "", "1", True, None, [], {})
NUMERIC_FIELDS = ("temperature", "top_p", "max_tokens", "n", "seed", "presence_penalty", "top_logprobs",
                  "max_completion_tokens", "frequency_penalty", "repetition_penalty", "top_k", "min_p",
                  "truncate_prompt_tokens")
# What Tandem refuses (best_of only unless it equals n, at most 3 in these requests; tools with SmolLM2's own chat
# template, which shows the model none; tool_choice required with nothing to call; completions take neither).
UNSUPPORTED = {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
               "reasoning_effort": "low", "store": True, "suffix": "x", "best_of": 5,
               "functions": [{"name": "f"}], "audio": {"voice": "x"}, "frobnicate": 1}


@dataclass(slots=True)
class Case:
    kind: str
    path: str
    body: bytes
    allowed: frozenset[int]
    method: str = "POST"
    token: str | None = TOKEN
    drop_after: int | None = None  # a stream the client drops after this many bytes


@pytest.fixture(scope="module")
def coordinator(shared_cluster, tmp_path_factory):
    from tests.integration.conftest import extra_coordinator

    tokens = tmp_path_factory.mktemp("http-fuzz") / "tokens"
    tokens.write_text(f"{TOKEN}\n{GOOD_TOKEN}\n")
    with extra_coordinator(shared_cluster, (
            "--host", "127.0.0.1", "--http-port", "0", "--auth-token-file", str(tokens),
            "--max-prompt-tokens", str(MAX_PROMPT_TOKENS), "--max-new-tokens", "4", "--max-new-tokens-limit", "16",
            "--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-concurrent-per-client", str(CLIENT_BUDGET))
            ) as coordinator:
        yield coordinator


class Fuzzer:
    def __init__(self, rng: random.Random, model: str) -> None:
        self.rng = rng
        self.model = model
        self.kinds = [(self.valid, 3), (self.mutated, 4), (self.wrong_type, 3), (self.absurd, 3),
                      (self.unsupported, 2), (self.invalid_utf8, 2), (self.unicode, 2), (self.huge, 1),
                      (self.deep, 1), (self.long_prompt, 1), (self.unknown_model, 1), (self.no_token, 1),
                      (self.wrong_route, 1), (self.random_bytes, 2), (self.dropped_stream, 2)]

    def case(self) -> Case:
        make = self.rng.choices([k for k, _ in self.kinds], weights=[w for _, w in self.kinds])[0]
        return make()

    # ----- bodies ------------------------------------------------------------------------------
    def request(self) -> tuple[str, dict[str, Any]]:
        """A valid request of a random shape: (path, body)."""
        rng = self.rng
        body: dict[str, Any] = {"max_tokens": rng.randint(1, 6)}
        if rng.random() < 0.5:
            path = "/v1/chat/completions"
            turns = [{"role": "user", "content": rng.choice(GOOD_PROMPTS)}]
            if rng.random() < 0.3:
                turns.insert(0, {"role": rng.choice(("system", "developer")), "content": "Be brief."})
            body["messages"] = turns
            if rng.random() < 0.3:
                body.update(logprobs=True, top_logprobs=rng.randint(0, 5))
        else:
            path = "/v1/completions"
            body["prompt"] = rng.choice([rng.choice(GOOD_PROMPTS), [rng.randrange(49152) for _ in range(5)]])
            if rng.random() < 0.3:
                body["logprobs"] = rng.randint(0, 5)
        if rng.random() < 0.5:
            body["model"] = self.model
        if rng.random() < 0.5:
            body.update(temperature=rng.uniform(0, 1.5), seed=rng.randrange(2**32))
        if rng.random() < 0.3:
            body["n"] = rng.randint(1, 3)
        if rng.random() < 0.3:
            body["stop"] = rng.choice(["\n", ["a", "the"], " "])
        if rng.random() < 0.4:
            body["stream"] = True
            if rng.random() < 0.5:
                body["stream_options"] = {"include_usage": True}
        if rng.random() < 0.3:
            body["tandem"] = {"method": rng.choice(("auto", "none", "draft", "ngram", "hybrid")),
                              "k": rng.randint(0, 8), "tree": rng.choice(("auto", "off", "on"))}
        return path, body

    def _case(self, kind: str, path: str, body: Any, allowed: set[int], **kw: Any) -> Case:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return Case(kind, path, raw, frozenset(allowed), **kw)

    def valid(self) -> Case:
        path, body = self.request()
        return self._case("valid", path, body, {200, 429})

    def dropped_stream(self) -> Case:
        path, body = self.request()
        body.update(stream=True, max_tokens=16)
        return self._case("dropped_stream", path, body, {200, 429}, drop_after=self.rng.randint(1, 400))

    def mutated(self) -> Case:
        path, body = self.request()
        raw = bytearray(json.dumps(body).encode())
        for _ in range(self.rng.randint(1, 4)):
            at = self.rng.randrange(len(raw))
            roll = self.rng.random()
            if roll < 0.4:
                del raw[at]
            elif roll < 0.7:
                raw.insert(at, self.rng.choice(b'{}[]":,0-e.\\ntf'))
            else:
                raw[at] = self.rng.randrange(256)
        return self._case("mutated", path, bytes(raw), {200, 400, 404, 429})

    def wrong_type(self) -> Case:
        path, body = self.request()
        key = self.rng.choice([*body, "tandem", "stream_options"])
        body[key] = self.rng.choice(ABSURD)
        return self._case("wrong_type", path, body, {200, 400, 404, 413, 429})

    def absurd(self) -> Case:
        path, body = self.request()
        for key in self.rng.sample(NUMERIC_FIELDS, self.rng.randint(1, 3)):
            body[key] = self.rng.choice(ABSURD)
        raw = json.dumps(body).encode()
        if self.rng.random() < 0.3:  # not JSON at all, though Python would write them
            raw = raw.replace(b'"max_tokens": ', b'"max_tokens": ' + self.rng.choice([b"NaN, ", b"Infinity, "]), 1)
        return self._case("absurd", path, raw, {200, 400, 404, 413, 429})

    def unsupported(self) -> Case:
        path, body = self.request()
        key = self.rng.choice(list(UNSUPPORTED))
        body[key] = UNSUPPORTED[key]
        return self._case("unsupported", path, body, {400})

    def invalid_utf8(self) -> Case:
        path, body = self.request()
        raw = json.dumps(body).encode()
        at = raw.find(b'": "')  # inside the first string value, else anywhere
        at = at + 4 if at >= 0 else len(raw) // 2
        return self._case("invalid_utf8", path, raw[:at] + self.rng.choice(INVALID_UTF8) + raw[at:], {400})

    def unicode(self) -> Case:
        path, body = self.request()
        text = "".join(self.rng.choice(UNICODE) for _ in range(self.rng.randint(1, 6)))
        if "messages" in body:
            body["messages"][-1]["content"] += text
        else:
            body["prompt"] = text
        raw = json.dumps(body, ensure_ascii=self.rng.random() < 0.5).encode("utf-8", "surrogatepass")
        return self._case("unicode", path, raw, {200, 400, 413, 429})

    def huge(self) -> Case:
        path, body = self.request()
        key = "messages" if "messages" in body else "prompt"
        body[key] = "x" * (MAX_REQUEST_BYTES + self.rng.randint(1, 50_000)) if key == "prompt" else [
            {"role": "user", "content": "x" * (MAX_REQUEST_BYTES + 1)}]
        return self._case("huge", path, body, {413})

    def deep(self) -> Case:
        return self._case("deep", "/v1/completions", b"[" * self.rng.randint(1000, 60_000), {400})

    def long_prompt(self) -> Case:
        path, body = self.request()
        words = " ".join(self.rng.choice(("cat", "dog", "tree")) for _ in range(400))
        if "messages" in body:
            body["messages"][-1]["content"] = words
        else:
            body["prompt"] = words
        return self._case("long_prompt", path, body, {400, 429})

    def unknown_model(self) -> Case:
        path, body = self.request()
        body["model"] = self.rng.choice(("gpt-4o", "", "../" + self.model, self.model + " "))
        return self._case("unknown_model", path, body, {404})

    def no_token(self) -> Case:
        path, body = self.request()
        return self._case("no_token", path, body, {401}, token=self.rng.choice((None, "not-a-known-token-000000")))

    def wrong_route(self) -> Case:
        path, body = self.request()
        if self.rng.random() < 0.5:
            return self._case("wrong_route", self.rng.choice(("/v1/embeddings", "/v2/completions", "/")), body,
                              {404})
        return self._case("wrong_route", path, body, {405}, method=self.rng.choice(("GET", "PUT", "DELETE")))

    def random_bytes(self) -> Case:
        return self._case("random_bytes", self.rng.choice(("/v1/completions", "/v1/chat/completions")),
                          self.rng.randbytes(self.rng.randint(0, 300)), {400})


async def send(session: aiohttp.ClientSession, root: str, case: Case) -> tuple[int, str, str]:
    """(status, what was wrong with the reply or '', the error's message); a dropped stream is fine once dropped."""
    headers = {"Authorization": f"Bearer {case.token}"} if case.token else {}
    async with session.request(case.method, root + case.path, data=case.body, headers=headers) as reply:
        if reply.status != 200:
            try:
                error = (await reply.json(content_type=None))["error"]
            except (ValueError, KeyError, TypeError) as exc:
                return reply.status, f"not an OpenAI error body: {exc}", ""
            ok = set(error) == ERROR_KEYS and isinstance(error["message"], str) and error["message"]
            return reply.status, "" if ok else f"error fields: {error}", str(error.get("message"))
        if case.drop_after is not None:
            await reply.content.read(case.drop_after)
            return 200, "", ""  # leaving the block closes the connection mid-stream
        raw = await reply.read()
        streamed = reply.headers.get("Content-Type", "").startswith("text/event-stream")  # (mutated bodies too)
    if streamed:
        ended = raw.endswith(b"data: [DONE]\n\n") and b'"error"' not in raw
        return 200, "" if ended else f"a stream that does not end well: {raw[-200:]}", ""
    body = json.loads(raw)
    return 200, "" if body.get("choices") else f"no choices: {body}", ""


async def good_request(session: aiohttp.ClientSession, root: str, prompt: str) -> str:
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "temperature": 0,
            "tandem": {"method": "draft"}}
    async with session.post(root + "/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {GOOD_TOKEN}"}) as reply:
        assert reply.status == 200, await reply.text()
        return (await reply.json())["choices"][0]["message"]["content"]


async def kv_in_use(address: str) -> list[tuple[int, int]]:
    async with grpc.aio.insecure_channel(address) as channel:
        info = await generation_pb2_grpc.GenerationStub(channel).Info(generation_pb2.InfoRequest(), timeout=30)
    return [(w.info.total_blocks - w.info.free_blocks, w.info.active_sequences)
            for w in [*info.target_workers, *info.draft_workers]]


@pytest.mark.parametrize("max_requests,max_seconds", [
    pytest.param(400, 15.0, id="make-test"),
    pytest.param(1500, 90.0, id="long", marks=pytest.mark.long),
])
def test_fuzzed_http_requests_get_proper_statuses_and_leave_good_requests_and_kv_untouched(
        shared_cluster, coordinator, max_requests, max_seconds):
    root = coordinator.http_url[: -len("/v1")]
    grpc_address = shared_cluster.coordinator.address  # the shared one: no token, the same workers
    worker_addresses = [s.address for s in shared_cluster.services if s.role != "coordinator"]

    async def scenario():
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session, \
                aiohttp.ClientSession(timeout=timeout) as good_session:
            async with session.get(root + "/v1/models", headers={"Authorization": f"Bearer {TOKEN}"}) as reply:
                model = (await reply.json())["data"][0]["id"]
            baseline = await kv_in_use(grpc_address)
            single = {p: await good_request(good_session, root, p) for p in GOOD_PROMPTS}
            fuzzer = Fuzzer(random.Random(SEED), model)
            statuses: Counter[tuple[str, int]] = Counter()
            wrong: list[tuple[str, int, str, bytes]] = []
            good_runs: list[tuple[str, str]] = []
            sending = True
            issued = 0

            async def fuzz_worker() -> None:
                nonlocal issued
                while sending and issued < max_requests:
                    issued += 1
                    case = fuzzer.case()
                    status, problem, message = await send(session, root, case)
                    statuses[(case.kind, status)] += 1
                    if status not in case.allowed or problem or any(a in message for a in worker_addresses):
                        wrong.append((case.kind, status, problem[:300], case.body[:200]))

            async def good_worker(offset: int) -> None:
                i = offset
                while sending:
                    prompt = GOOD_PROMPTS[i % len(GOOD_PROMPTS)]
                    good_runs.append((prompt, await good_request(good_session, root, prompt)))
                    i += 1

            workers = [asyncio.create_task(fuzz_worker()) for _ in range(CONCURRENCY)]
            goods = [asyncio.create_task(good_worker(i)) for i in range(2)]
            started = time.monotonic()
            while not all(w.done() for w in workers) and time.monotonic() - started < max_seconds:
                await asyncio.sleep(0.2)
            sending = False
            await asyncio.gather(*workers, *goods)
            elapsed = time.monotonic() - started

            by_status: Counter[int] = Counter()
            for (_, status), n in statuses.items():
                by_status[status] += n
            total = sum(by_status.values())
            print(f"\nhttp fuzz: {total} requests in {elapsed:.0f}s, seed {SEED}: {dict(sorted(by_status.items()))}; "
                  f"{len(good_runs)} good requests beside them")
            print("http fuzz by kind:", dict(sorted(statuses.items())))
            assert not wrong, f"{len(wrong)} wrong: {Counter((k, st) for k, st, _, _ in wrong)}; {wrong[:5]}"
            assert total >= min(max_requests, 150)  # the fuzz really ran
            assert by_status[200] and by_status[400] and by_status[413]  # every outcome was reached
            assert good_runs and all(text == single[prompt] for prompt, text in good_runs)
            services = [*shared_cluster.services, coordinator]
            assert all(s.process.poll() is None for s in services), [(s.role, s.process.returncode)
                                                                     for s in services]
            for _ in range(120):  # dropped streams release their KV as their handlers unwind
                if await kv_in_use(grpc_address) == baseline:
                    break
                await asyncio.sleep(0.5)
            after = await kv_in_use(grpc_address)
            assert after == baseline, f"KV blocks in use and sequences per worker: {after}, at the start {baseline}"
            assert await good_request(good_session, root, GOOD_PROMPTS[0]) == single[GOOD_PROMPTS[0]]

    asyncio.run(scenario())
