"""Prefix caching and prefix-aware placement, through real processes, against prefilling every prompt.

One run, every configuration after the other, each on processes of its own
(tandem.cluster.LocalCluster, as `tandem up` starts them, so that each starts
with empty prefix caches): bf16, the Qwen pair by default.

  cache-off          two target replicas, workers --no-prefix-caching, --placement load
  cache-on+load      two target replicas, prefix caching on, --placement load
  cache-on+prefix    two target replicas, prefix caching on, --placement prefix
  one-replica        one target replica, prefix caching on: the hit rate one replica reaches
                     (the reference of the placement goal), then the chunked-prefill scenario
  no-chunking        one target replica, --prefill-chunk-tokens 0: the same scenario unchunked
  prompts-only       one target replica, workers --no-cache-generated: prefix caches keep prompt blocks only
                     (as before generated tokens' blocks were cached), beside one-replica's cache of both

Workloads, the same token ids in every configuration (Spec-Bench text, benchmarks/data; the
target's chat template applied here, sent as token ids), one request at a time, streamed:

  chat      a --chat-turns conversation, each turn's prompt the whole conversation so far
            (user turns of real text, the assistant's answers as it gave them, greedy,
            --answer-tokens each), growing to about --chat-tokens by the last turn
  samples   one prompt (--sample-prompt-tokens) sampled --samples times at --temperature,
            seeds --seed + i, as RL rollouts and pass@k do
  system    a --system-tokens system prompt before --questions different questions
  probe     one raw --probe-tokens prompt sent twice: the second finds it cached (where the
            placement sends it to the same replica)

Speculation: method --method, default none. TTFT is then the target's prefill alone and a
stream's tokens come one per step, so the token gaps of the chunked-prefill scenario measure
the stall, not how many draft tokens a round accepted (a burst of accepted tokens arrives as one
message). With --method hybrid/draft every configuration gets one draft replica, placed by the
same key, and its prefix cache's hit rate is reported too. With --method eagle/medusa every target
worker serves --heads (an EAGLE prompt starts on as many blocks as the target's cache and its head's
hold). The scenario always runs method none.

Reported per configuration and workload: end-to-end time (the requests' wall time, summed, seen
by the client), time to first token per request (client side: the first streamed message with
tokens), the prefix-cache hit rate (reused / prompt tokens from the workers' Info
prefix_cache counters, before and after the workload, summed over the replicas; the requests'
own prompt_tokens_reused beside it) and how the requests spread over the replicas.

Chunked prefill: --streams streams decode (method none, short prompts) on one target; once each
has --stream-lead-tokens tokens, a raw --long-prompt-tokens prompt arrives. A gap is the time
between two streamed messages of a stream that carry tokens (one token each under method none;
the mean tokens per message is recorded). Per stream and pooled: the median gap before the long
prompt arrived (the decode rhythm), the gaps while it was prefilled (those that overlap the time
from its send to its first token), p50 and p99 of all gaps; the ratio is the p99 of the gaps
while prefilled over the median gap before.

Goals (issue 26): TTFT of the probe's cached send <= 0.15x its uncached send (cache-on+prefix,
about 2,000 tokens); the two-replica hit rate with prefix placement >= 90% of one replica's
(chat, samples and system together); chat end-to-end, cache-on+prefix <= 0.5x cache-off; with
chunking the pooled ratio <= 2 (no-chunking's stated beside it).

Writes prefix_bench.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/prefix_bench.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    DEFAULT_RESULTS_DIR,
    DEFAULT_SPEC_BENCH,
    grouped_bars,
    load_spec_bench,
    machine_info,
    machine_line,
    markdown_table,
    new_figure,
    percentile,
    quick_default,
    save_figure,
    threshold_line,
    write_json,
    write_markdown,
)
from tandem.tokenizer import encode_messages  # noqa: E402

NAME = "prefix_bench"
QUICK_MODEL = "smollm2"
WORKLOADS = ("chat", "samples", "system", "probe")
HIT_WORKLOADS = ("chat", "samples", "system")  # the placement goal's hit rates (the probe is two requests)
METHODS = ("none", "ngram", "draft", "hybrid", "eagle", "medusa")
HEADS_METHODS = ("eagle", "medusa")  # served by the targets' --heads
WARMUP_PROMPT = "Name three colours."  # raw text shorter than a KV block: it leaves nothing in a prefix cache
# Spec-Bench categories per use, so that no workload finds another's text in a cache.
CHAT_CATEGORIES = ("mt_bench", "math_reasoning", "translation")
DOC_CATEGORIES = ("rag",)  # the system prompt and the sampled prompt: long documents
PROBE_CATEGORIES = ("summarization",)  # the probe and the long prompt of the scenario
QUESTION_CATEGORIES = ("qa",)  # the system workload's questions and the streams' prompts
STREAM_BUDGET = 2048  # most tokens a scenario stream may generate (it is stopped long before, normally)
TAIL_MESSAGES = 4  # messages each stream gets after the long prompt's first token, before the scenario stops


@dataclass(frozen=True, slots=True)
class Config:
    """One configuration: its processes' flags, and what it runs."""

    name: str
    replicas: int
    worker_args: tuple[str, ...] = ()  # every worker's (draft replicas too)
    target_args: tuple[str, ...] = ()  # the target workers' only (chunked prefill is a target's)
    placement: str = "prefix"
    workloads: bool = True
    scenario: bool = False  # the chunked-prefill scenario, after the workloads


def configs(chunk_tokens: int | None) -> dict[str, Config]:
    """Every configuration; ``chunk_tokens`` (None: the workers' default) goes to every target but no-chunking's."""
    chunk = ("--prefill-chunk-tokens", str(chunk_tokens)) if chunk_tokens is not None else ()
    return {c.name: c for c in (
        Config("cache-off", 2, ("--no-prefix-caching",), chunk, placement="load"),
        Config("cache-on+load", 2, (), chunk, placement="load"),
        Config("cache-on+prefix", 2, (), chunk, placement="prefix"),
        Config("one-replica", 1, (), chunk, scenario=True),
        Config("no-chunking", 1, (), ("--prefill-chunk-tokens", "0"), workloads=False, scenario=True),
        Config("prompts-only", 1, ("--no-cache-generated",), chunk),
    )}


# ----- flags -------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefix_bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None,
                   help="target model, catalog name or directory (default: qwen-coder-1.5b; --quick: smollm2)")
    p.add_argument("--draft", default=None,
                   help="draft model, used when --method drafts (default: qwen-coder-0.5b; --quick: smollm2)")
    p.add_argument("--method", default="none", choices=METHODS,
                   help="speculation method of the workloads' requests (default: %(default)s; see above)")
    p.add_argument("--heads", default=None, metavar="PATH|NAME",
                   help="speculation heads for every target worker (`tandem serve target --heads`); needed by "
                        "--method eagle and medusa")
    p.add_argument("--configs", default=",".join(configs(None)),
                   help="configurations to run, comma-separated subset (default: all)")
    p.add_argument("--workloads", default=",".join((*WORKLOADS, "scenario")),
                   help="workloads to run, comma-separated subset; scenario: the chunked-prefill scenario of the "
                        "configurations that have it (default: all)")
    p.add_argument("--chat-turns", type=int, default=None, help="turns of the chat (default: 10; --quick: 3)")
    p.add_argument("--chat-tokens", type=int, default=None,
                   help="about this many prompt tokens at the chat's last turn (default: 2000; --quick: 240)")
    p.add_argument("--answer-tokens", type=int, default=None,
                   help="tokens of each chat answer and each question's answer (default: 48; --quick: 8)")
    p.add_argument("--chat-ends-at-eos", action="store_true",
                   help="each chat answer ends at the model's end of turn (at most --answer-tokens), as a real chat's "
                        "does: the next turn then resends exactly what was generated. By default it runs to "
                        "--answer-tokens past its end of turn, whose special tokens the resent text lacks")
    p.add_argument("--samples", type=int, default=None, help="samples of the one prompt (default: 8; --quick: 3)")
    p.add_argument("--sample-prompt-tokens", type=int, default=None,
                   help="tokens of the sampled prompt's document (default: 600; --quick: 80)")
    p.add_argument("--sample-tokens", type=int, default=None,
                   help="tokens per sample (default: 64; --quick: 8)")
    p.add_argument("--temperature", type=float, default=0.8, help="the samples' temperature (default: %(default)s)")
    p.add_argument("--system-tokens", type=int, default=None,
                   help="tokens of the shared system prompt (default: 1500; --quick: 120)")
    p.add_argument("--questions", type=int, default=None,
                   help="questions after the system prompt (default: 8; --quick: 3)")
    p.add_argument("--probe-tokens", type=int, default=None,
                   help="tokens of the probe sent twice (default: 2000; --quick: 200)")
    p.add_argument("--streams", type=int, default=4, help="decoding streams of the scenario (default: %(default)s)")
    p.add_argument("--stream-lead-tokens", type=int, default=None,
                   help="tokens each stream has before the long prompt is sent (default: 24; --quick: 6)")
    p.add_argument("--long-prompt-tokens", type=int, default=None,
                   help="tokens of the scenario's long prompt (default: 4000; --quick: 400)")
    p.add_argument("--chunk-tokens", type=int, default=None,
                   help="--prefill-chunk-tokens of every cache-on worker (default: the workers' own default)")
    p.add_argument("--call-timeout", type=float, default=600.0,
                   help="the coordinators' --call-timeout, seconds: a 4,000-token prompt prefilled whole on a CPU "
                        "target holds every call queued behind it for longer than the default 60 s, and the "
                        "scenario measures that stall rather than failing on it (default: %(default)s)")
    p.add_argument("--k", type=int, default=4, help="most draft tokens per round, adaptive (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the text choice and the samples (default: %(default)s)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype of every worker (default: %(default)s)")
    p.add_argument("--worker-threads", type=int, default=None,
                   help="torch threads per worker (default: all cores)")
    p.add_argument("--kv-cache-tokens", type=int, default=16384,
                   help="KV pool per worker, in tokens (default: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run on SmolLM2 with small sizes (see each flag's --quick default): proves the "
                        "script works end to end, measures nothing")
    p.add_argument("--spec-bench", type=Path, default=DEFAULT_SPEC_BENCH,
                   help="Spec-Bench question.jsonl (default: benchmarks/data/spec_bench/question.jsonl)")
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR,
                   help="results directory (default: benchmarks/results)")
    return p


def resolve_args(argv: list[str] | None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    q = args.quick
    args.target = args.target or (QUICK_MODEL if q else "qwen-coder-1.5b")
    args.draft = args.draft or (QUICK_MODEL if q else "qwen-coder-0.5b")
    args.chat_turns = quick_default(args.chat_turns, q, 3, 10)
    args.chat_tokens = quick_default(args.chat_tokens, q, 240, 2000)
    args.answer_tokens = quick_default(args.answer_tokens, q, 8, 48)
    args.samples = quick_default(args.samples, q, 3, 8)
    args.sample_prompt_tokens = quick_default(args.sample_prompt_tokens, q, 80, 600)
    args.sample_tokens = quick_default(args.sample_tokens, q, 8, 64)
    args.system_tokens = quick_default(args.system_tokens, q, 120, 1500)
    args.questions = quick_default(args.questions, q, 3, 8)
    args.probe_tokens = quick_default(args.probe_tokens, q, 200, 2000)
    args.stream_lead_tokens = quick_default(args.stream_lead_tokens, q, 6, 24)
    args.long_prompt_tokens = quick_default(args.long_prompt_tokens, q, 400, 4000)
    known = configs(args.chunk_tokens)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = sorted(set(names) - set(known))
    if unknown or not names:
        raise SystemExit(f"unknown or no configurations {unknown}; choose from {', '.join(known)}")
    args.configs = [n for n in known if n in names]  # table order
    asked = [n.strip() for n in args.workloads.split(",") if n.strip()]
    unknown = sorted(set(asked) - {*WORKLOADS, "scenario"})
    if unknown or not asked:
        raise SystemExit(f"unknown or no workloads {unknown}; choose from {', '.join((*WORKLOADS, 'scenario'))}")
    args.workloads = asked
    sizes = (args.chat_turns, args.chat_tokens, args.answer_tokens, args.samples, args.sample_prompt_tokens,
             args.sample_tokens, args.system_tokens, args.questions, args.probe_tokens, args.streams,
             args.stream_lead_tokens, args.long_prompt_tokens, args.k)
    if min(sizes) <= 0 or args.temperature <= 0:
        raise SystemExit("every size, --k and --temperature must be positive")
    if (args.method in HEADS_METHODS) != (args.heads is not None):
        raise SystemExit(f"--method {args.method} " + ("needs --heads (the heads the target workers serve)"
                                                       if args.heads is None else "uses no --heads"))
    if args.chunk_tokens is not None and args.chunk_tokens <= 0:
        raise SystemExit("--chunk-tokens must be positive (the no-chunking configuration is the unchunked run)")
    return args


# ----- prompts ---------------------------------------------------------------
class TextPool:
    """Spec-Bench texts, each handed out once, in a seeded order: no two workloads share text."""

    def __init__(self, path: Path, seed: int, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.by_category: dict[str, list[str]] = {}
        for prompt in load_spec_bench(path):
            self.by_category.setdefault(prompt.category, []).append(prompt.text)
        for category, texts in self.by_category.items():
            random.Random(f"{seed}:{category}").shuffle(texts)

    def ids(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def take(self, categories: tuple[str, ...], tokens: int) -> str:
        """Texts of ``categories`` (the next unused, round-robin), joined until ``tokens`` tokens, cut there."""
        pieces: list[int] = []
        turn = 0
        while len(pieces) < tokens:
            category = categories[turn % len(categories)]
            turn += 1
            if not self.by_category.get(category):
                if not any(self.by_category.get(c) for c in categories):
                    raise SystemExit(f"Spec-Bench has too little {'/'.join(categories)} text for {tokens} tokens")
                continue
            pieces += self.ids(("\n\n" if pieces else "") + self.by_category[category].pop())
        return self.tokenizer.decode(pieces[:tokens])

    def take_ids(self, categories: tuple[str, ...], tokens: int) -> list[int]:
        """Exactly ``tokens`` token ids of fresh text (a raw prompt)."""
        ids = self.ids(self.take(categories, tokens + 8))
        return ids[:tokens]


@dataclass(slots=True)
class Workloads:
    """What every configuration sends: fixed text (the chat's later prompts add the answers it gets)."""

    chat_turns: list[str]  # the user's messages
    sample_prompt: list[int]
    system: str
    questions: list[str]
    probe: list[int]
    stream_prompts: list[list[int]]
    long_prompt: list[int]


def build_workloads(pool: TextPool, tokenizer: Any, args: argparse.Namespace) -> Workloads:
    # Each chat turn adds its user message and an answer of --answer-tokens; the template adds a few per message.
    overhead = len(encode_messages(tokenizer, [{"role": "user", "content": "x"}]))
    per_turn = max(8, (args.chat_tokens - overhead - (args.chat_turns - 1) * (args.answer_tokens + 6))
                   // args.chat_turns)
    chat_turns = [pool.take(CHAT_CATEGORIES, per_turn) for _ in range(args.chat_turns)]
    document = pool.take(DOC_CATEGORIES, args.sample_prompt_tokens)
    sample_prompt = encode_messages(tokenizer, [{"role": "user",
                                                 "content": document + "\n\nWhat is this text about?"}])
    system = pool.take(DOC_CATEGORIES, args.system_tokens)
    questions = [pool.take(QUESTION_CATEGORIES, 64) for _ in range(args.questions)]
    probe = pool.take_ids(PROBE_CATEGORIES, args.probe_tokens)
    streams = [encode_messages(tokenizer, [{"role": "user", "content": pool.take(QUESTION_CATEGORIES, 48)}])
               for _ in range(args.streams)]
    long_prompt = pool.take_ids(PROBE_CATEGORIES, args.long_prompt_tokens)
    return Workloads(chat_turns, sample_prompt, system, questions, probe, streams, long_prompt)


# ----- requests ---------------------------------------------------------------------
def request(prompt: list[int], method: str, k: int, max_new_tokens: int, temperature: float = 0.0,
            seed: int | None = None, ignore_eos: bool = True) -> Any:
    """Token ids in, exactly ``max_new_tokens`` out (EOS ignored, so that every configuration does the same work;
    ``ignore_eos`` False: at most that many, ending at the model's end of turn, the same in every configuration as
    greedy output does not depend on the cache)."""
    from tandem.client import build_request
    from tandem.sampling_params import SamplingParams

    sampling = SamplingParams(temperature, seed=seed) if temperature > 0 else SamplingParams(0.0)
    return build_request(prompt, max_new_tokens=max_new_tokens, sampling=sampling, method=method, k=k,
                         pipelining=False, ignore_eos=ignore_eos)


def stream_one(client: Any, req: Any) -> dict[str, Any]:
    """One streamed request: client-side time to first token and end to end, what it said, its stats."""
    started = time.perf_counter()
    ttft = None
    text: list[str] = []
    tokens = 0
    stats = None
    for msg in client.stream(req):
        if msg.token_ids and ttft is None:
            ttft = time.perf_counter() - started
        text.append(msg.text)
        tokens += len(msg.token_ids)
        if msg.HasField("stats"):
            stats = msg.stats
    seconds = time.perf_counter() - started
    assert stats is not None, "the stream ended without its stats"
    return {"prompt_tokens": stats.prompt_tokens, "reused_tokens": stats.prompt_tokens_reused, "tokens": tokens,
            "ttft_s": ttft, "seconds": seconds, "target": stats.target_worker, "draft": stats.draft_worker,
            "text": "".join(text)}


def run_chat(client: Any, tokenizer: Any, w: Workloads, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows, messages = [], []
    for turn, user in enumerate(w.chat_turns):
        messages.append({"role": "user", "content": user})
        row = stream_one(client, request(encode_messages(tokenizer, messages), args.method, args.k, args.answer_tokens,
                                         ignore_eos=not args.chat_ends_at_eos))
        messages.append({"role": "assistant", "content": row["text"]})
        rows.append({"turn": turn + 1, **row})
    return rows


def run_samples(client: Any, w: Workloads, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [{"sample": i, **stream_one(client, request(w.sample_prompt, args.method, args.k, args.sample_tokens,
                                                          args.temperature, args.seed + i))}
            for i in range(args.samples)]


def run_system(client: Any, tokenizer: Any, w: Workloads, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for i, question in enumerate(w.questions):
        ids = encode_messages(tokenizer, [{"role": "system", "content": w.system},
                                          {"role": "user", "content": question}])
        rows.append({"question": i, **stream_one(client, request(ids, args.method, args.k, args.answer_tokens))})
    return rows


def run_probe(client: Any, w: Workloads, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [{"send": i, **stream_one(client, request(w.probe, args.method, args.k, 4))} for i in range(2)]


# ----- the workers' own counters ------------------------------------------------------------
def worker_infos(cluster: Any) -> dict[str, Any]:
    """Every worker's Info, asked directly (not the coordinator's last poll): ``role@address`` -> WorkerInfo."""
    import grpc

    from tandem.v1 import common_pb2, draft_pb2_grpc, target_pb2_grpc

    infos = {}
    for role, stub_class in (("target", target_pb2_grpc.TargetWorkerStub), ("draft", draft_pb2_grpc.DraftWorkerStub)):
        for service in cluster.workers(role):
            with grpc.insecure_channel(service.address) as channel:
                infos[f"{role}@{service.address}"] = stub_class(channel).Info(common_pb2.WorkerInfoRequest(),
                                                                               timeout=30)
    return infos


def cache_delta(before: dict[str, Any], after: dict[str, Any], role: str) -> dict[str, int]:
    """Prompt and reused tokens the workers of ``role`` counted between two snapshots, summed over them."""
    out = {"prompt_tokens": 0, "reused_tokens": 0, "evictions": 0}
    for name, info in after.items():
        if not name.startswith(role + "@") or name not in before:
            continue
        a, b = info.prefix_cache, before[name].prefix_cache
        out["prompt_tokens"] += a.prompt_tokens - b.prompt_tokens
        out["reused_tokens"] += a.reused_tokens - b.reused_tokens
        out["evictions"] += a.evictions - b.evictions
    return out


def hit_rate(delta: dict[str, int]) -> float | None:
    return delta["reused_tokens"] / delta["prompt_tokens"] if delta["prompt_tokens"] else None


# ----- the chunked-prefill scenario ------------------------------------------------------------
@dataclass(slots=True)
class Stream:
    """One decoding stream of the scenario: when each of its messages with tokens arrived, and how many."""

    arrivals: list[tuple[float, int]] = field(default_factory=list)
    error: str | None = None
    ended: bool = False  # it reached its token budget before the scenario stopped it

    def has(self, messages: int) -> bool:
        return len(self.arrivals) >= messages or self.ended


def run_scenario(address: str, w: Workloads, args: argparse.Namespace) -> dict[str, Any]:
    """--streams streams decode; once each has --stream-lead-tokens tokens, the long prompt arrives; the streams
    are cancelled once it has its first token and each has had a few more."""
    import grpc

    from tandem.client import TandemClient

    streams = [Stream() for _ in w.stream_prompts]
    calls: list[Any] = []
    stop = threading.Event()
    client = TandemClient(address, timeout_s=3600)
    # Long enough not to end on their own before the scenario stops them (the model's context permitting).
    budget = min(STREAM_BUDGET, client.info().max_context - max(len(p) for p in w.stream_prompts) - 8)

    def read(stream: Stream, call: Any) -> None:
        try:
            for msg in call:
                if msg.token_ids:
                    stream.arrivals.append((time.perf_counter(), len(msg.token_ids)))
            stream.ended = True
        except grpc.RpcError as exc:
            if not stop.is_set():
                stream.error = f"{exc.code().name}: {exc.details()}"

    threads = []
    for stream, prompt in zip(streams, w.stream_prompts):
        call = client.stream(request(prompt, "none", 0, budget))
        calls.append(call)
        threads.append(threading.Thread(target=read, args=(stream, call), daemon=True))
        threads[-1].start()
    try:
        _wait(lambda: all(s.has(args.stream_lead_tokens) for s in streams), streams)
        if any(s.ended for s in streams):
            raise RuntimeError("a stream ended before the long prompt was sent: raise its budget")
        sent = time.perf_counter()
        long_row = stream_one(client, request(w.long_prompt, "none", 0, 4))
        first = sent + long_row["ttft_s"]
        counts = [len(s.arrivals) for s in streams]
        _wait(lambda: all(s.has(c + TAIL_MESSAGES) for s, c in zip(streams, counts)), streams)
    finally:
        stop.set()
        for call in calls:
            call.cancel()
        for thread in threads:
            thread.join(timeout=30)
        client.close()
    return {"sent": 0.0, "first_token": first - sent,
            "long_prompt": {k: v for k, v in long_row.items() if k != "text"},
            "streams": [{"arrivals": [(t - sent, n) for t, n in s.arrivals], "ended_early": s.ended}
                        for s in streams]}


def _wait(done: Any, streams: list[Stream], timeout_s: float = 3600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        failed = [s.error for s in streams if s.error]
        if failed:
            raise RuntimeError(f"a stream failed: {failed[0]}")
        if time.monotonic() > deadline:
            raise TimeoutError("the scenario's streams stalled")
        time.sleep(0.01)


@dataclass(slots=True)
class Gaps:
    """Gaps (seconds between messages with tokens) of one stream or several: before the long prompt was sent,
    while it was prefilled (overlapping the time from its send to its first token), and all of them."""

    before: list[float] = field(default_factory=list)
    during: list[float] = field(default_factory=list)
    every: list[float] = field(default_factory=list)
    tokens: int = 0
    messages: int = 0

    @classmethod
    def of(cls, arrivals: list[tuple[float, int]], first: float) -> Gaps:
        """``arrivals``: (seconds since the long prompt was sent, tokens) per message; ``first``: when its
        first token came, on the same clock."""
        times = [t for t, _ in arrivals]
        pairs = list(zip(times, times[1:]))
        return cls([b - a for a, b in pairs if b <= 0], [b - a for a, b in pairs if b > 0 and a < first],
                   [b - a for a, b in pairs], sum(n for _, n in arrivals), len(arrivals))

    def __add__(self, other: Gaps) -> Gaps:
        return Gaps(self.before + other.before, self.during + other.during, self.every + other.every,
                    self.tokens + other.tokens, self.messages + other.messages)

    def row(self) -> dict[str, Any]:
        p50_before = statistics.median(self.before) if self.before else None
        p99_during = percentile(self.during, 99)
        return {"gaps": len(self.every), "tokens_per_message": self.tokens / self.messages if self.messages else None,
                "p50_before_ms": _ms(p50_before), "p99_during_ms": _ms(p99_during),
                "max_during_ms": _ms(max(self.during, default=None)), "p50_ms": _ms(percentile(self.every, 50)),
                "p99_ms": _ms(percentile(self.every, 99)),
                "ratio": p99_during / p50_before if p50_before and p99_during is not None else None}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1000 * seconds


def scenario_rows(name: str, scenario: dict[str, Any]) -> list[dict[str, Any]]:
    """Per stream and pooled over the streams: the gap statistics of one scenario run."""
    per = [Gaps.of(s["arrivals"], scenario["first_token"]) for s in scenario["streams"]]
    rows = [{"config": name, "stream": str(i), **g.row()} for i, g in enumerate(per)]
    pooled = sum(per, Gaps())
    rows.append({"config": name, "stream": "pooled", **pooled.row(),
                 "long_prompt_ttft_s": scenario["long_prompt"]["ttft_s"]})
    return rows


# ----- one configuration ------------------------------------------------------------------------
def warm_up(client: Any, prompt: list[int], replicas: int, method: str) -> None:
    """Short untimed requests until every target replica has served one (first-call allocations); the prompt
    is shorter than a KV block, so it leaves nothing in a prefix cache and goes by load under either placement."""
    seen: set[str] = set()
    for _ in range(8 * replicas):
        seen.add(client.generate(request(prompt, method, 4, 4)).stats.target_worker)
        if len(seen) >= replicas:
            return
    raise RuntimeError(f"the warm-up reached {len(seen)} of {replicas} target replicas")


def heads_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The target workers' --heads flag, when the workloads' method drafts with heads."""
    return ("--heads", args.heads) if args.heads is not None else ()


def run_config(config: Config, w: Workloads, tokenizer: Any, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from tandem.client import TandemClient
    from tandem.cluster import ClusterSpec, LocalCluster

    uses_draft = args.method in ("draft", "hybrid") and config.workloads
    spec = ClusterSpec(target=args.target, draft=args.draft if uses_draft else None, target_replicas=config.replicas,
                       dtype=args.dtype, worker_threads=args.worker_threads, kv_cache_tokens=args.kv_cache_tokens,
                       worker_args=config.worker_args, target_args=(*config.target_args, *heads_args(args)),
                       coordinator_args=("--placement", config.placement, "--call-timeout", str(args.call_timeout)),
                       log_dir=workdir / config.name)
    out: dict[str, Any] = {"config": config.name, "replicas": config.replicas,
                           "worker_args": [*config.worker_args, *config.target_args, *heads_args(args)],
                           "placement": config.placement, "workloads": {}, "scenario": None}
    print(f"{config.name}: starting {config.replicas} x {args.target}"
          + (f" + {args.draft} draft" if uses_draft else ""), file=sys.stderr)
    started = time.perf_counter()
    with LocalCluster(spec) as cluster:
        out["setup_s"] = round(time.perf_counter() - started, 1)
        client = TandemClient(cluster.coordinator.address, timeout_s=3600)
        warm_up(client, tokenizer.encode(WARMUP_PROMPT, add_special_tokens=False), config.replicas,
                args.method if uses_draft else "none")
        if config.workloads:
            for name in (n for n in WORKLOADS if n in args.workloads):
                print(f"{config.name}: {name}", file=sys.stderr)
                before = worker_infos(cluster)
                t0 = time.perf_counter()
                rows = {"chat": lambda: run_chat(client, tokenizer, w, args),
                        "samples": lambda: run_samples(client, w, args),
                        "system": lambda: run_system(client, tokenizer, w, args),
                        "probe": lambda: run_probe(client, w, args)}[name]()
                wall = time.perf_counter() - t0
                after = worker_infos(cluster)
                out["workloads"][name] = {"wall_s": wall, "target_cache": cache_delta(before, after, "target"),
                                          "draft_cache": cache_delta(before, after, "draft"),
                                          "requests": [{k: v for k, v in r.items() if k != "text"} for r in rows]}
        client.close()
        if config.scenario and "scenario" in args.workloads:
            print(f"{config.name}: chunked-prefill scenario", file=sys.stderr)
            out["scenario"] = run_scenario(cluster.coordinator.address, w, args)
    return out


# ----- aggregation ---------------------------------------------------------------------
def summarize(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration and workload."""
    rows = []
    for res in results:
        for name, wl in res["workloads"].items():
            reqs = wl["requests"]
            ttfts = [r["ttft_s"] for r in reqs if r["ttft_s"] is not None]
            spread: dict[str, int] = {}
            for r in reqs:
                spread[r["target"]] = spread.get(r["target"], 0) + 1
            prompt = sum(r["prompt_tokens"] for r in reqs)
            # The workers' counters; the requests' own counts where the workers counted nothing (no counters).
            counted = wl["target_cache"] if wl["target_cache"]["prompt_tokens"] else {
                "prompt_tokens": prompt, "reused_tokens": sum(r["reused_tokens"] for r in reqs)}
            rows.append({
                "config": res["config"], "workload": name, "requests": len(reqs), "prompt_tokens": prompt,
                "last_prompt_tokens": reqs[-1]["prompt_tokens"] if reqs else None,
                "e2e_s": sum(r["seconds"] for r in reqs), "ttft_mean_s": statistics.mean(ttfts) if ttfts else None,
                "ttft_first_s": ttfts[0] if ttfts else None, "ttft_last_s": ttfts[-1] if ttfts else None,
                "hit_rate": hit_rate(counted), "cache_prompt_tokens": counted["prompt_tokens"],
                "cache_reused_tokens": counted["reused_tokens"],
                "hit_rate_stats": sum(r["reused_tokens"] for r in reqs) / prompt if prompt else None,
                "draft_hit_rate": hit_rate(wl["draft_cache"]),
                "evictions": wl["target_cache"]["evictions"],
                "per_replica": "/".join(str(n) for n in sorted(spread.values(), reverse=True)),
            })
    return rows


def combined_hit_rate(rows: list[dict[str, Any]], config: str) -> float | None:
    """The configuration's hit rate over the chat, samples and system workloads together."""
    mine = [_row(rows, config, w) for w in HIT_WORKLOADS]
    if not all(mine):
        return None
    prompt = sum(r["cache_prompt_tokens"] for r in mine)
    return sum(r["cache_reused_tokens"] for r in mine) / prompt if prompt else None


def _row(rows: list[dict[str, Any]], config: str, workload: str) -> dict[str, Any] | None:
    return next((r for r in rows if r["config"] == config and r["workload"] == workload), None)


def _div(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def verdicts(results: list[dict[str, Any]], rows: list[dict[str, Any]],
             scenario: list[dict[str, Any]]) -> tuple[dict[str, Any], list[str]]:
    """The issue's goals, each PASS / FAIL / n/a, plus what they are read from."""
    probe = next((r for r in results if r["config"] == "cache-on+prefix" and "probe" in r["workloads"]), None)
    probe_ttfts = [q["ttft_s"] for q in probe["workloads"]["probe"]["requests"]] if probe else [None, None]
    off_chat, prefix_chat = _row(rows, "cache-off", "chat"), _row(rows, "cache-on+prefix", "chat")
    pooled = {r["config"]: r for r in scenario if r["stream"] == "pooled"}
    two, one = combined_hit_rate(rows, "cache-on+prefix"), combined_hit_rate(rows, "one-replica")
    summary = {
        "probe_prompt_tokens": probe["workloads"]["probe"]["requests"][0]["prompt_tokens"] if probe else None,
        "probe_ttft_uncached_s": probe_ttfts[0], "probe_ttft_cached_s": probe_ttfts[1],
        "probe_cached_over_uncached": _div(probe_ttfts[1], probe_ttfts[0]),
        "chat_last_turn_ttft_prefix_over_off": _div(prefix_chat and prefix_chat["ttft_last_s"],
                                                    off_chat and off_chat["ttft_last_s"]),
        "hit_rate_two_replicas_prefix": two, "hit_rate_two_replicas_load": combined_hit_rate(rows, "cache-on+load"),
        "hit_rate_one_replica": one, "hit_rate_prefix_over_one_replica": _div(two, one),
        "chat_e2e_prefix_over_off": _div(prefix_chat and prefix_chat["e2e_s"], off_chat and off_chat["e2e_s"]),
        "chunked_ratio": pooled.get("one-replica", {}).get("ratio"),
        "unchunked_ratio": pooled.get("no-chunking", {}).get("ratio"),
    }
    lines = [
        threshold_line(f"TTFT, cached / uncached probe ({summary['probe_prompt_tokens']} tokens, cache-on+prefix)",
                       summary["probe_cached_over_uncached"], "<=", 0.15),
        threshold_line("hit rate, two replicas with prefix placement / one replica (chat+samples+system)",
                       summary["hit_rate_prefix_over_one_replica"], ">=", 0.9),
        threshold_line("chat end to end, cache-on+prefix / cache-off", summary["chat_e2e_prefix_over_off"], "<=", 0.5),
        threshold_line("chunked prefill: p99 gap while the long prompt is prefilled / median gap before (pooled)",
                       summary["chunked_ratio"], "<=", 2.0),
    ]
    if summary["unchunked_ratio"] is not None:
        lines.append(f"  info  without chunking that ratio is {summary['unchunked_ratio']:.2f}")
    if summary["chat_last_turn_ttft_prefix_over_off"] is not None:
        lines.append(f"  info  chat's last turn TTFT, cache-on+prefix / cache-off: "
                     f"{summary['chat_last_turn_ttft_prefix_over_off']:.3f}")
    one_chat, prompts_chat = _row(rows, "one-replica", "chat"), _row(rows, "prompts-only", "chat")
    if one_chat and prompts_chat:
        summary["chat_e2e_generated_over_prompts_only"] = _div(one_chat["e2e_s"], prompts_chat["e2e_s"])
        summary["chat_ttft_generated_over_prompts_only"] = _div(one_chat["ttft_mean_s"], prompts_chat["ttft_mean_s"])
        lines.append(f"  info  chat with generated blocks cached (one-replica) / prompt blocks only (prompts-only): "
                     f"TTFT mean {_fmt_ratio(summary['chat_ttft_generated_over_prompts_only'])}, end to end "
                     f"{_fmt_ratio(summary['chat_e2e_generated_over_prompts_only'])}")
    for config in ("cache-on+load", "cache-on+prefix", "one-replica", "prompts-only"):
        rates = [f"{w} {_fmt_rate(_row(rows, config, w))}" for w in HIT_WORKLOADS if _row(rows, config, w)]
        if rates:
            lines.append(f"  info  hit rate {config}: {', '.join(rates)}")
    return summary, lines


def _fmt_ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def _fmt_rate(row: dict[str, Any] | None) -> str:
    return "—" if row is None or row["hit_rate"] is None else f"{row['hit_rate']:.1%}"


# ----- output ----------------------------------------------------------------------
COLUMNS = ("config", "workload", "requests", "prompt_tokens", "last_prompt_tokens", "e2e_s", "ttft_mean_s",
           "ttft_first_s", "ttft_last_s", "hit_rate", "hit_rate_stats", "draft_hit_rate", "evictions", "per_replica")
SCENARIO_COLUMNS = ("config", "stream", "gaps", "tokens_per_message", "p50_before_ms", "p99_during_ms",
                    "max_during_ms", "p50_ms", "p99_ms", "ratio", "long_prompt_ttft_s")


def chart(results: list[dict[str, Any]], rows: list[dict[str, Any]], out: Path) -> Path:
    """Chat TTFT per turn, hit rate and end-to-end time per workload, and the scenario's gaps over time."""
    fig, axes = new_figure(ncols=4, width=5.0)
    for res in results:
        chat = res["workloads"].get("chat")
        if chat:
            reqs = chat["requests"]
            axes[0].plot([r["prompt_tokens"] for r in reqs], [r["ttft_s"] for r in reqs], marker="o",
                         label=res["config"])
    axes[0].set_xlabel("prompt tokens (chat turn)")
    axes[0].set_ylabel("TTFT, s")
    axes[0].set_title("chat: time to first token per turn")
    axes[0].legend(fontsize="small")
    axes[0].grid(alpha=0.3)
    names = [r["config"] for r in results if r["workloads"]]
    workloads = [w for w in WORKLOADS if any(_row(rows, c, w) for c in names)]
    grouped_bars(axes[1], workloads, {c: [(_row(rows, c, w) or {}).get("hit_rate") for w in workloads]
                                      for c in names}, "prefix-cache hit rate (reused / prompt tokens)")
    axes[1].set_title("hit rate, summed over the target replicas")
    grouped_bars(axes[2], workloads, {c: [(_row(rows, c, w) or {}).get("e2e_s") for w in workloads]
                                      for c in names}, "seconds")
    axes[2].set_title("end to end per workload")
    for res in results:
        scenario = res["scenario"]
        if scenario:
            points = [(b[0], 1000 * (b[0] - a[0])) for s in scenario["streams"]
                      for a, b in zip(s["arrivals"], s["arrivals"][1:])]
            axes[3].scatter([p[0] for p in points], [p[1] for p in points], s=6, label=res["config"])
            axes[3].axvline(scenario["first_token"] - scenario["sent"], ls="--", lw=0.8)
    axes[3].set_yscale("log")
    axes[3].set_xlabel("s since the long prompt was sent (dashed: its first token)")
    axes[3].set_ylabel("gap between a stream's tokens, ms")
    axes[3].set_title("decoding streams while a long prompt arrives")
    if any(res["scenario"] for res in results):
        axes[3].legend(fontsize="small")
    else:
        axes[3].text(0.5, 0.5, "not run", ha="center", va="center", transform=axes[3].transAxes)
    return save_figure(fig, out, NAME)


def write_results(args: argparse.Namespace, payload: dict[str, Any], rows: list[dict[str, Any]],
                  scenario: list[dict[str, Any]], lines: list[str], results: list[dict[str, Any]]) -> list[Path]:
    settings = payload["settings"]
    body = [machine_line(payload["machine"]), "", f"Settings: `{settings}`", "",
            "## Workloads", "", markdown_table(rows, COLUMNS), "",
            "e2e_s: the workload's requests' wall time, summed (client side, streamed); ttft_*: client-side time to "
            "the first streamed token; hit_rate: reused / prompt tokens from the target workers' Info counters "
            "(before and after the workload, summed over the replicas; the requests' own counts where the workers "
            "counted nothing); hit_rate_stats: the same from the requests' own prompt_tokens_reused; per_replica: "
            "requests per target replica, most first.", ""]
    if scenario:
        body += ["## Chunked prefill: streams decoding while a long prompt arrives", "",
                 markdown_table(scenario, SCENARIO_COLUMNS), "",
                 "A gap is the time between two streamed messages of a stream that carry tokens (tokens_per_message "
                 "says how many each carried). p50_before: the median gap before the long prompt was sent; "
                 "p99_during: the p99 of the gaps that overlap its prefill (from its send to its first token); "
                 "ratio: p99_during / p50_before.", ""]
    body += ["## Goals", "", "```", *lines, "```"]
    return [write_json(args.out, NAME, payload),
            write_markdown(args.out, NAME, "Prefix caching and prefix-aware placement", "\n".join(body)),
            chart(results, rows, args.out)]


# ----- main -----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = resolve_args(argv)
    from tandem import model_store
    from tandem.cli.generate import resolve_or_prepare
    from tandem.tokenizer import load_tokenizer

    root = model_store.cache_root_from(None, os.environ)
    tokenizer = load_tokenizer(Path(resolve_or_prepare(args.target, root)))
    if args.method in ("draft", "hybrid"):
        resolve_or_prepare(args.draft, root)  # once here, not in every replica at once
    workloads = build_workloads(TextPool(args.spec_bench, args.seed, tokenizer), tokenizer, args)
    table = configs(args.chunk_tokens)
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))  # through the finally below
    workdir = Path(tempfile.mkdtemp(prefix="tandem-prefix-bench-"))
    ok = False
    results = []
    try:
        for name in args.configs:
            results.append(run_config(table[name], workloads, tokenizer, args, workdir))
            write_json(workdir, f"{NAME}.partial", {"configs": results})  # kept with the logs if a later one fails
        ok = True
    finally:
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"logs kept in {workdir}", file=sys.stderr)
    rows = summarize(results)
    scenario = [row for res in results if res["scenario"] for row in scenario_rows(res["config"], res["scenario"])]
    summary, lines = verdicts(results, rows, scenario)
    settings = {k: getattr(args, k) for k in (
        "target", "method", "heads", "configs", "chat_turns", "chat_tokens", "answer_tokens", "chat_ends_at_eos",
        "samples", "sample_prompt_tokens",
        "sample_tokens", "temperature", "system_tokens", "questions", "probe_tokens", "streams", "stream_lead_tokens",
        "long_prompt_tokens", "chunk_tokens", "call_timeout", "k", "seed", "dtype", "worker_threads", "kv_cache_tokens",
        "quick")}
    settings["draft"] = args.draft if args.method in ("draft", "hybrid") else None
    settings["spec_bench_file"] = args.spec_bench.name
    machine = {**machine_info(), "load_average_1m_before": round(load_before, 2),
               "load_average_1m_after": round(os.getloadavg()[0], 2),
               "wall_s": round(time.perf_counter() - started, 1), "python": sys.version.split()[0]}
    payload = {"benchmark": NAME, "settings": settings, "machine": machine, "summary": summary, "thresholds": lines,
               "rows": rows, "scenario": scenario, "configs": results}
    print(markdown_table(rows, COLUMNS))
    if scenario:
        print()
        print(markdown_table(scenario, SCENARIO_COLUMNS))
    print("\n".join(lines))
    paths = write_results(args, payload, rows, scenario, lines, results)
    print(f"wrote {', '.join(str(p) for p in paths)} in {machine['wall_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
