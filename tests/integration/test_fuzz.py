"""Bad input (issue 10): thousands of malformed and extreme requests against one running system, good ones beside.

A coordinator of its own (with small request limits) over the session's shared SmolLM2 workers
(tests/integration/conftest.py: real processes, real gRPC on 127.0.0.1). A seeded generator
sends raw bytes through a generic call
(identity serializers, so anything can reach the wire): random bytes, mutated
valid messages, other message types, invalid UTF-8 in string fields, huge
fields, unicode edge cases, absurd sampling values (NaN, inf, negative, huge
top_k), token ids out of range, huge stop strings, absurd speculation and
length settings; some with a 1 ms deadline, some cancelled at a random moment.
Meanwhile a few good greedy requests run over and over.

Asserted: no server process exits; every reply is OK or a status the case
allows (INVALID_ARGUMENT, RESOURCE_EXHAUSTED; DEADLINE_EXCEEDED for 1 ms
deadlines; CANCELLED for our own cancellations), never UNKNOWN or INTERNAL, and
no message names a worker's address; every good request succeeds with exactly
its single-run tokens; the workers' KV pools return to their baseline.
Bounded: at most a budget of cases or of seconds of sending, whichever ends first: 300 cases or 60 s in
`make test`, 1000 or 100 s in the long tier (`make test-long`).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from dataclasses import dataclass
from types import SimpleNamespace

import grpc
import pytest

from tandem.cluster import Service
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

pytestmark = pytest.mark.slow

SEED = 20261122
CONCURRENCY = 8  # most cases are refused in milliseconds; the ones that generate set the pace
MAX_PROMPT_TOKENS = 128  # with 8192 KV tokens per worker, 10 requests at once can never exhaust the pool
MAX_NEW_TOKENS_LIMIT = 16
GOOD_PROMPTS = ("Write a story about a cat.", "def fibonacci(n):", "List the planets of the solar system.")
BASE_CODES = frozenset({"OK", "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED"})
SERVICE = "/tandem.v1.Generation/"


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    """The shared workers behind a coordinator of this test's own, which refuses long prompts and long
    outputs (so that no fuzz case can fill a KV pool); ``coordinator`` and ``services`` as a cluster's."""
    from tests.integration.conftest import extra_coordinator

    with extra_coordinator(shared_cluster, ("--host", "127.0.0.1", "--max-prompt-tokens", str(MAX_PROMPT_TOKENS),
                                            "--max-new-tokens", "4",
                                            "--max-new-tokens-limit", str(MAX_NEW_TOKENS_LIMIT))) as coordinator:
        workers: list[Service] = [s for s in shared_cluster.services if s.role != "coordinator"]
        yield SimpleNamespace(coordinator=coordinator, services=[*workers, coordinator])


# ----- the wire, by hand ------------------------------------------------------------
def varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # negative int32s go on the wire as 10-byte two's complement
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def length_delimited(field: int, data: bytes) -> bytes:
    return varint(field << 3 | 2) + varint(len(data)) + data


INVALID_UTF8 = (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82", b"\xc0\xaf", b"a\x80b")
UNICODE = ("\u0000", "\u200b", "\u202e", "\ufeff", "\uffff", "\U0001f600", "e\u0301", "\u05d0\u05d1", "\u4e2d\u6587",
           "\U0010fffd", "\r\n", "\t", "<|im_start|>", "<|endoftext|>", "\\u0000", "%s%n", "' OR 1=1 --")
ABSURD_FLOATS = (math.nan, math.inf, -math.inf, -1.0, -0.0, 1e30, 1e-30, 3.4e38, 2.0, 0.5)
ABSURD_INTS = (-1, 0, 1, 2, 49151, 49152, 10**6, 2**31 - 1, -(2**31))


@dataclass(slots=True)
class Case:
    kind: str
    method: str  # Generate, GenerateStream or Info
    payload: bytes
    timeout: float = 60.0
    cancel_after: float | None = None

    @property
    def allowed(self) -> frozenset[str]:
        extra = {"DEADLINE_EXCEEDED"} if self.timeout < 0.01 else set()
        return BASE_CODES | extra | ({"CANCELLED"} if self.cancel_after is not None else set())


class Fuzzer:
    def __init__(self, rng: random.Random, vocab_size: int) -> None:
        self.rng = rng
        self.vocab = vocab_size
        self.kinds = [(self.random_bytes, 4), (self.mutated, 4), (self.invalid_utf8, 3), (self.wrong_type, 2),
                      (self.huge, 1), (self.unicode, 3), (self.absurd_sampling, 3), (self.token_ids, 3),
                      (self.absurd_options, 3), (self.valid, 2)]

    def case(self) -> Case:
        rng = self.rng
        make = rng.choices([k for k, _ in self.kinds], weights=[w for _, w in self.kinds])[0]
        case = Case(make.__name__, rng.choice(("Generate", "GenerateStream")), make())
        if rng.random() < 0.02:
            case.method = "Info"
        roll = rng.random()
        if roll < 0.06:
            case.timeout = 0.001
        elif roll < 0.16:
            case.cancel_after = rng.uniform(0.0, 0.4)
        return case

    # ----- structured requests --------------------------------------------------
    def request(self) -> generation_pb2.GenerateRequest:
        """A valid request: short prompt, greedy or sampled, a few tokens (0: the server's default, 4)."""
        rng = self.rng
        request = generation_pb2.GenerateRequest(chat=rng.random() < 0.5)
        if rng.random() < 0.5:
            request.text = rng.choice(GOOD_PROMPTS)
        else:
            request.token_ids.ids.extend(rng.randrange(self.vocab) for _ in range(rng.randint(1, 40)))
        request.stopping.max_new_tokens = rng.randint(0, 4)
        if rng.random() < 0.5:
            request.sampling.temperature = rng.uniform(0.1, 2.0)
            request.sampling.seed = rng.randrange(2**64)
        request.speculation.method = rng.choice(("", "auto", "none", "draft", "ngram", "hybrid"))
        return request

    def valid(self) -> bytes:
        return self.request().SerializeToString()

    def random_bytes(self) -> bytes:
        return self.rng.randbytes(self.rng.randint(0, 300))

    def mutated(self) -> bytes:
        rng = self.rng
        data = bytearray(self.request().SerializeToString())
        for _ in range(rng.randint(1, 6)):
            op = rng.random()
            if op < 0.4 and data:
                data[rng.randrange(len(data))] = rng.randrange(256)
            elif op < 0.6 and data:
                del data[rng.randrange(len(data)):]
            else:
                data[rng.randrange(len(data) + 1):0] = rng.randbytes(rng.randint(1, 8))
        return bytes(data)

    def invalid_utf8(self) -> bytes:
        rng = self.rng
        bad = b"ok " + rng.choice(INVALID_UTF8) + b" end"
        where = rng.choice(("text", "stop_string", "request_id", "method"))
        base = self.request()
        base.ClearField("input")
        base.token_ids.ids.append(1)
        if where == "text":
            return length_delimited(1, bad)  # text is field 1 of the oneof
        if where == "stop_string":
            return base.SerializeToString() + length_delimited(5, length_delimited(2, bad))
        if where == "request_id":
            return base.SerializeToString() + length_delimited(7, bad)
        return base.SerializeToString() + length_delimited(6, length_delimited(1, bad))

    def wrong_type(self) -> bytes:
        rng = self.rng
        others = (generation_pb2.InfoResponse(target_model="x", vocab_size=5),
                  generation_pb2.GenerateResponse(text="hello", token_ids=[1, 2, 3], finish_reason="stop"),
                  common_pb2.WorkerInfo(model="m", total_blocks=9), common_pb2.SamplingOptions(temperature=1.0))
        raw = (b"\x0d\x00\x00\x80\x7f",  # text (field 1) as fixed32
               b"\x10\x05",  # token_ids (a message) as a varint
               b"\x1a\x03abc",  # chat (a bool) as bytes
               b"\x22\x02\x08\x01" * 3,  # sampling repeated: merged
               b"\x2a\x05\x08" + varint(2**63),  # stopping with a truncated huge varint
               b"\x0f", b"\x00", b"\x0b\x0c")  # group wire types and field number 0
        return rng.choice(others).SerializeToString() if rng.random() < 0.4 else rng.choice(raw)

    def huge(self) -> bytes:
        rng = self.rng
        request = self.request()
        pick = rng.randrange(6)
        if pick == 0:
            request.text = "word " * 20_000  # far over the prompt limit: refused after tokenizing
        elif pick == 1:
            request.text = "x" * (5 * 1024 * 1024)  # over the 4 MiB message limit: gRPC refuses it
        elif pick == 2:
            request.token_ids.ids[:] = [rng.randrange(self.vocab) for _ in range(50_000)]
        elif pick == 3:
            request.stopping.stop_strings.append("s" * 1_000_000)
        elif pick == 4:
            request.stopping.stop_strings.extend(f"stop-{i}-" + "z" * 40 for i in range(20_000))
        else:
            request.request_id = "r" * 2_000_000
        return request.SerializeToString()

    def unicode(self) -> bytes:
        rng = self.rng
        request = self.request()
        request.text = "".join(rng.choice(UNICODE) for _ in range(rng.randint(1, 30)))
        if rng.random() < 0.5:
            request.stopping.stop_strings.append(rng.choice(UNICODE))
        request.request_id = rng.choice(UNICODE)
        return request.SerializeToString()

    def absurd_sampling(self) -> bytes:
        rng = self.rng
        request = self.request()
        request.sampling.temperature = rng.choice(ABSURD_FLOATS)
        request.sampling.top_p = rng.choice(ABSURD_FLOATS)
        request.sampling.top_k = rng.choice(ABSURD_INTS)
        request.sampling.seed = rng.choice((0, 1, 2**63, 2**64 - 1))
        return request.SerializeToString()

    def token_ids(self) -> bytes:
        rng = self.rng
        request = self.request()
        ids = [rng.choice((-1, self.vocab, self.vocab + 1, 2**31 - 1, -(2**31), rng.randrange(self.vocab)))
               for _ in range(rng.randint(1, 10))]
        if rng.random() < 0.5:
            request.token_ids.ids[:] = ids
        else:
            request.stopping.stop_token_ids.extend(ids)
        data = request.SerializeToString()
        if rng.random() < 0.2:  # a value no int32 holds, packed by hand
            data += length_delimited(2, length_delimited(1, varint(2**40) + varint(3)))
        return data

    def absurd_options(self) -> bytes:
        rng = self.rng
        request = self.request()
        request.stopping.max_new_tokens = rng.choice(ABSURD_INTS)
        request.stopping.ignore_eos = rng.random() < 0.5
        request.speculation.k = rng.choice(ABSURD_INTS)
        request.speculation.method = rng.choice(("medusa", "DRAFT", "none ", "", "early-exit", "\u0000", "x" * 5000))
        request.speculation.fixed_k = rng.random() < 0.5
        request.speculation.disable_pipelining = rng.random() < 0.5
        return request.SerializeToString()


# ----- sending ---------------------------------------------------------------------
async def send(channel: grpc.aio.Channel, case: Case) -> tuple[str, str]:
    """The status code's name and details of one case (OK: the whole reply arrived)."""
    if case.method == "GenerateStream":
        call = channel.unary_stream(SERVICE + case.method)(case.payload, timeout=case.timeout)

        async def finish():
            async for _ in call:
                pass
    else:
        call = channel.unary_unary(SERVICE + case.method)(case.payload, timeout=case.timeout)

        async def finish():
            await call
    task = asyncio.ensure_future(finish())
    if case.cancel_after is not None:
        done, _ = await asyncio.wait({task}, timeout=case.cancel_after)
        if not done:
            call.cancel()
    try:
        await task
        return "OK", ""
    except asyncio.CancelledError:
        return "CANCELLED", ""
    except grpc.aio.AioRpcError as exc:
        return exc.code().name, exc.details() or ""


async def good_request(stub: generation_pb2_grpc.GenerationStub, prompt: str, stream: bool) -> list[int]:
    request = generation_pb2.GenerateRequest(text=prompt, chat=True)
    request.stopping.max_new_tokens = MAX_NEW_TOKENS_LIMIT
    request.speculation.method = "draft"
    if stream:
        return [t async for chunk in stub.GenerateStream(request, timeout=120) for t in chunk.token_ids]
    return list((await stub.Generate(request, timeout=120)).token_ids)


async def kv_in_use(stub: generation_pb2_grpc.GenerationStub) -> list[tuple[int, int]]:
    info = await stub.Info(generation_pb2.InfoRequest(), timeout=30)
    return [(w.info.total_blocks - w.info.free_blocks, w.info.active_sequences)
            for w in [*info.target_workers, *info.draft_workers]]


@pytest.mark.parametrize("max_requests,max_seconds", [
    pytest.param(300, 60.0, id="make-test"),
    pytest.param(1000, 100.0, id="long", marks=pytest.mark.long),
])
def test_fuzzed_requests_get_proper_statuses_and_leave_good_requests_and_kv_untouched(cluster, max_requests,
                                                                                      max_seconds):
    worker_addresses = [s.address for s in cluster.services if s.role != "coordinator"]

    async def scenario():
        async with grpc.aio.insecure_channel(cluster.coordinator.address) as channel, \
                grpc.aio.insecure_channel(cluster.coordinator.address) as good_channel:
            stub = generation_pb2_grpc.GenerationStub(good_channel)
            info = await stub.Info(generation_pb2.InfoRequest(), timeout=30)
            baseline = await kv_in_use(stub)
            single = {p: await good_request(stub, p, stream=False) for p in GOOD_PROMPTS}
            fuzzer = Fuzzer(random.Random(SEED), info.vocab_size)
            codes: Counter[tuple[str, str]] = Counter()
            wrong: list[tuple[Case, str, str]] = []
            good_runs: list[tuple[str, list[int]]] = []
            sending = True
            issued = 0

            async def fuzz_worker() -> None:
                nonlocal issued
                while sending and issued < max_requests:
                    issued += 1
                    case = fuzzer.case()
                    code, details = await send(channel, case)
                    codes[(case.kind, code)] += 1
                    if code not in case.allowed or any(a in details for a in worker_addresses):
                        wrong.append((case, code, details[:300]))

            async def good_worker(offset: int) -> None:
                i = offset
                while sending:
                    prompt = GOOD_PROMPTS[i % len(GOOD_PROMPTS)]
                    good_runs.append((prompt, await good_request(stub, prompt, stream=i % 2 == 0)))
                    i += 1

            workers = [asyncio.create_task(fuzz_worker()) for _ in range(CONCURRENCY)]
            goods = [asyncio.create_task(good_worker(i)) for i in range(2)]
            started = time.monotonic()
            while not all(w.done() for w in workers) and time.monotonic() - started < max_seconds:
                await asyncio.sleep(0.5)
            sending = False
            await asyncio.gather(*workers, *goods)
            elapsed = time.monotonic() - started

            total = sum(codes.values())
            by_code: Counter[str] = Counter()
            for (_, code), n in codes.items():
                by_code[code] += n
            print(f"\nfuzz: {total} requests in {elapsed:.0f}s, seed {SEED}: {dict(sorted(by_code.items()))}; "
                  f"{len(good_runs)} good requests beside them")
            print("fuzz by kind:", dict(sorted(codes.items())))
            assert not wrong, wrong[:10]
            assert total >= min(max_requests, 200)  # the fuzz really ran
            assert good_runs and all(tokens == single[prompt] for prompt, tokens in good_runs)
            assert all(s.process.poll() is None for s in cluster.services), [
                (s.role, s.process.returncode) for s in cluster.services]
            for _ in range(120):  # cancelled requests release their KV as their handlers unwind
                if await kv_in_use(stub) == baseline:
                    break
                await asyncio.sleep(0.5)
            after = await kv_in_use(stub)
            assert after == baseline, f"KV blocks in use and sequences per worker: {after}, at the start {baseline}"
            # and the system still answers exactly as before
            assert await good_request(stub, GOOD_PROMPTS[0], stream=True) == single[GOOD_PROMPTS[0]]

    asyncio.run(scenario())
