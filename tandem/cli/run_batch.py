"""`tandem run-batch`: a file of OpenAI batch requests through a running coordinator, answers to a file.

Each line of --input is one request in OpenAI's batch format (what the Batch API
and `vllm run-batch` read):

  {"custom_id": "q-1", "method": "POST", "url": "/v1/chat/completions",
   "body": {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 32}}

url is /v1/chat/completions, /v1/completions or /v1/responses; body is what that
route takes (not streamed). The requests go to the coordinator's HTTP API at
--url (a running `tandem up`, or a cluster's), or to a system this command starts
on this machine for the batch and stops after (--target, --draft), up to
--concurrency at a time, and --output gets one record per line, in the input's
order, written as they complete:

  {"id": "batch_req_...", "custom_id": "q-1", "error": null,
   "response": {"status_code": 200, "request_id": "...", "body": {...}}}

An answer with an error status keeps its status and the API's error body in
response; a line that is not a request, or one the coordinator could not be
reached for, has response null and error {code, message}. A refusal that asks
to come back later (429 over the client's concurrency limit, 503 while the
coordinator drains or its pool is full) and a lost connection are tried again,
up to --retries times, waiting longer each time. One bad line costs only its
own record. A run that was stopped goes on with --resume: records are written
in the input's order, so the output is always the records of its first lines.
The exit code is 0 when every request was answered 200, 1 otherwise (the
summary on stderr says how many of each), 2 when nothing could start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from tandem.batch_file import BadLine, BatchRequest, answered, read_lines, unanswered
from tandem.errors import InvalidRequestError
from tandem.rpc.auth import TOKEN_ENV, token_from

RETRIED_STATUSES = frozenset({429, 503})  # refusals that ask to come back: over a limit, draining, pool full
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
DEFAULT_URL = "http://127.0.0.1:8000"  # `tandem up`'s HTTP API
REACH_TIMEOUT_S = 30.0  # the first call, which says whether --url is a coordinator at all


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run-batch", help="send a JSONL file of OpenAI batch requests to a coordinator, in order",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-i", "--input", required=True, metavar="PATH",
                   help="the requests, a JSON object a line (- : stdin)")
    p.add_argument("-o", "--output", required=True, metavar="PATH",
                   help="where the records go, a line per request in the input's order (- : stdout)")
    p.add_argument("--url", default=None,
                   help="the coordinator's HTTP API, with or without /v1 (default: http://127.0.0.1:8000, "
                        "`tandem up`'s)")
    p.add_argument("--target", default=None, metavar="MODEL",
                   help="instead of --url: start a system of its own on this machine for the batch (a target "
                        "worker, --draft and a coordinator, as `tandem up` starts them), and stop it after")
    p.add_argument("--draft", default="none", metavar="MODEL",
                   help="with --target: the draft model (default: none, n-gram lookups only)")
    p.add_argument("--served-model-name", nargs="+", default=(), metavar="NAME",
                   help="with --target: the names the lines' bodies may give as model (e.g. the one they were "
                        "written for); default: --target as given")
    p.add_argument("--cache-dir", default=None,
                   help="with --target: the models' cache root (default: $TANDEM_HOME or ~/.cache/tandem)")
    p.add_argument("--concurrency", type=int, default=16, metavar="N",
                   help="requests in flight at once (default: %(default)s); more than the coordinator's "
                        "--max-concurrent-per-client gets 429s, which are tried again")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="seconds one request may take before it is recorded as timed out (default: %(default)s)")
    p.add_argument("--retries", type=int, default=3, metavar="N",
                   help="times a 429, a 503 or a lost connection is tried again (default: %(default)s)")
    p.add_argument("--resume", action="store_true",
                   help="go on from where an earlier run with this --input and --output stopped (killed, "
                        "interrupted): the lines --output holds records for are not sent again; its records "
                        "must be this input's, in order")
    p.add_argument("--token-file", metavar="PATH", default=None,
                   help=f"send the bearer token in this file (its first token). Default: ${TOKEN_ENV}")
    p.set_defaults(func=run)


@dataclass
class Summary:
    ok: int = 0  # answered 200
    failed: dict[int, int] = field(default_factory=dict)  # answered with another status: how many of each
    unanswered: dict[str, int] = field(default_factory=dict)  # no answer: how many of each error code

    def count(self, record: dict[str, Any]) -> None:
        if record["error"] is not None:
            code = record["error"]["code"]
            self.unanswered[code] = self.unanswered.get(code, 0) + 1
        elif record["response"]["status_code"] == 200:
            self.ok += 1
        else:
            status = record["response"]["status_code"]
            self.failed[status] = self.failed.get(status, 0) + 1

    @property
    def total(self) -> int:
        return self.ok + sum(self.failed.values()) + sum(self.unanswered.values())

    def line(self) -> str:
        parts = [f"{self.ok} answered 200"]
        parts += [f"{n} answered {status}" for status, n in sorted(self.failed.items())]
        parts += [f"{n} {code}" for code, n in sorted(self.unanswered.items())]
        return f"{self.total} requests: " + ", ".join(parts)


class OrderedWriter:
    """Records written in the input's order as they complete: one that finishes early waits in memory only until
    those before it are written (at most about --concurrency of them)."""

    def __init__(self, out: IO[str], summary: Summary, first: int = 0) -> None:
        self.out = out
        self.summary = summary
        self._next = first  # the index of the next record to write
        self._waiting: dict[int, dict[str, Any]] = {}

    def put(self, index: int, record: dict[str, Any]) -> None:
        self.summary.count(record)
        self._waiting[index] = record
        while self._next in self._waiting:
            self.out.write(json.dumps(self._waiting.pop(self._next), ensure_ascii=False) + "\n")
            self._next += 1
        self.out.flush()


def api_base(url: str) -> str:
    """``--url`` as the server's root: the lines' urls start with /v1 themselves."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise InvalidRequestError(f"--url must be the coordinator's http:// or https:// address, got {url!r}")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def resume_point(records_path: Path, requests_path: Path) -> int:
    """``--resume``: how many records ``records_path`` holds for the first lines of ``requests_path`` (records are
    written in the input's order, so they are a prefix of it). A last line cut off mid-write (the run was killed)
    is removed from the file. Raises ``InvalidRequestError`` when a record is not for the line in its place."""
    if not records_path.exists():
        return 0
    data = records_path.read_bytes()
    whole = data[: data.rfind(b"\n") + 1]  # (b"" when no line was finished)
    records = [json.loads(line) for line in whole.decode("utf-8").splitlines() if line.strip()]
    with requests_path.open(encoding="utf-8") as lines:
        items = list(read_lines(lines))
    if len(records) > len(items):
        raise InvalidRequestError(f"--resume: {records_path} holds {len(records)} records, more than the "
                                  f"{len(items)} requests of {requests_path}: they are not this input's")
    for record, item in zip(records, items):
        if record.get("custom_id") != item.custom_id:
            raise InvalidRequestError(
                f"--resume: record {item.index + 1} of {records_path} is for custom_id {record.get('custom_id')!r}, "
                f"but line {item.line_no} of {requests_path} is {item.custom_id!r}: those records are not this "
                f"input's")
    if len(whole) < len(data):  # (checked first: a refused resume leaves the file as it was)
        with records_path.open("r+b") as f:
            f.truncate(len(whole))
    return len(records)


def session(token: str | None, timeout_s: float) -> Any:
    """The HTTP client every request of a batch goes through: the bearer token on each, ``timeout_s`` for each."""
    import aiohttp

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s))


async def send_all(client: Any, lines: Iterable[str], out: IO[str], base: str, concurrency: int, retries: int,
                   progress: Any = None, skip: int = 0) -> Summary:
    """Send every request of ``lines`` through ``client`` (``session``) and write its record to ``out``; the first
    ``skip`` (recorded by an earlier run: ``resume_point``) are passed over."""
    summary = Summary()
    writer = OrderedWriter(out, summary, first=skip)
    slots = asyncio.Semaphore(concurrency)

    def done(index: int, record: dict[str, Any]) -> None:
        writer.put(index, record)
        if progress is not None:
            progress.update()

    async def one(request: BatchRequest) -> None:
        try:
            record = await _send(client, base, request, retries)
        except Exception as exc:  # noqa: BLE001 - anything unforeseen costs this line's answer, not the batch
            record = unanswered(request.custom_id, "internal_error",
                                f"line {request.line_no}: {type(exc).__name__}: {exc}")
        finally:
            slots.release()
        done(request.index, record)

    tasks: set[asyncio.Task] = set()
    for item in read_lines(lines):
        if item.index < skip:
            continue
        if isinstance(item, BadLine):
            done(item.index, unanswered(item.custom_id, "invalid_request", item.message))
            continue
        await slots.acquire()
        task = asyncio.create_task(one(item))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    if tasks:
        await asyncio.gather(*tasks)
    return summary


async def check_reachable(client: Any, base: str) -> None:
    """Raises ``InvalidRequestError`` saying why when ``base`` is not a coordinator's HTTP API that takes the token."""
    import aiohttp

    try:
        async with client.get(f"{base}/v1/models", timeout=aiohttp.ClientTimeout(total=REACH_TIMEOUT_S)) as reply:
            if reply.status == 401:
                raise InvalidRequestError(f"{base} refused the bearer token (401): pass --token-file or set "
                                          f"${TOKEN_ENV}")
            if reply.status != 200:
                raise InvalidRequestError(f"{base}/v1/models answered {reply.status}: is --url a Tandem "
                                          "coordinator's HTTP API?")
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        raise InvalidRequestError(f"cannot reach the coordinator's HTTP API at {base} "
                                  f"({type(exc).__name__}: {exc}); start it (`tandem up`) or pass --url") from None


async def _send(client: Any, base: str, request: BatchRequest, retries: int) -> dict[str, Any]:
    """One request, tried again after a refusal that asks for it or a lost connection; its record."""
    import aiohttp

    request_id = f"batch-{uuid.uuid4().hex[:16]}"
    backoff = FIRST_BACKOFF_S
    for attempt in range(retries + 1):
        last = attempt == retries
        try:
            async with client.post(base + request.url, json=request.body,
                                    headers={"X-Request-Id": request_id}) as reply:
                text = await reply.text()
                if reply.status in RETRIED_STATUSES and not last:
                    await asyncio.sleep(_wait_s(reply.headers.get("Retry-After"), backoff))
                    backoff = min(2 * backoff, MAX_BACKOFF_S)
                    continue
                return answered(request.custom_id, reply.status, _json_or_text(text),
                                reply.headers.get("X-Request-Id", request_id))
        except asyncio.TimeoutError:
            return unanswered(request.custom_id, "timeout", f"line {request.line_no}: no answer within --timeout")
        except aiohttp.ClientError as exc:
            if last:
                return unanswered(request.custom_id, "connection_error",
                                  f"line {request.line_no}: {type(exc).__name__}: {exc} ({retries + 1} tries)")
            await asyncio.sleep(backoff * random.uniform(0.5, 1.5))
            backoff = min(2 * backoff, MAX_BACKOFF_S)
    raise AssertionError("unreachable: the last try returns")


def _wait_s(retry_after: str | None, backoff: float) -> float:
    """Retry-After's seconds when the server gave them (bounded), else the backoff, jittered."""
    try:
        return min(max(float(retry_after), 0.0), MAX_BACKOFF_S) if retry_after else backoff * random.uniform(0.5, 1.5)
    except ValueError:
        return backoff * random.uniform(0.5, 1.5)


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"error": {"message": text}}  # (not the API's own body: a proxy's page, say)


def _check(args: argparse.Namespace) -> None:
    if args.resume and "-" in (args.input, args.output):
        raise InvalidRequestError("--resume needs --input and --output to be files (it reads both again)")
    if args.target is not None and args.url is not None:
        raise InvalidRequestError("--url and --target: give one (a running coordinator, or a system to start)")
    if args.target is None and (args.served_model_name or args.draft != "none"):
        raise InvalidRequestError("--draft and --served-model-name go with --target (the system it starts)")
    if args.concurrency < 1:
        raise InvalidRequestError(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.timeout <= 0:
        raise InvalidRequestError(f"--timeout must be positive, got {args.timeout}")
    if args.retries < 0:
        raise InvalidRequestError(f"--retries must be 0 or more, got {args.retries}")
    if args.input != "-" and not Path(args.input).is_file():
        raise InvalidRequestError(f"--input {args.input!r} is not a file")
    if args.output != "-" and args.input != "-" and Path(args.output).resolve() == Path(args.input).resolve():
        raise InvalidRequestError("--output is --input: the requests would be overwritten")


def run(args: argparse.Namespace) -> int:
    _check(args)
    token = token_from(args.token_file, "--token-file")
    total = None
    if args.input != "-":
        with open(args.input, encoding="utf-8") as counted:
            total = sum(1 for line in counted if line.strip())
    skip = resume_point(Path(args.output), Path(args.input)) if args.resume else 0
    if skip:
        print(f"run-batch: {args.output} holds the records of the first {skip} lines; going on from there",
              file=sys.stderr)
    with contextlib.ExitStack() as running:
        base = api_base(args.url or DEFAULT_URL) if args.target is None else running.enter_context(_own_system(args))
        summary = asyncio.run(_run_file(args, base, token, total, skip))
    print(summary.line() + ("" if args.output == "-" else f"; records in {args.output}"), file=sys.stderr)
    return 0 if summary.ok == summary.total else 1


@contextlib.contextmanager
def _own_system(args: argparse.Namespace) -> Iterator[str]:
    """``--target``: a system of real processes on this machine, as `tandem up` starts them; its HTTP API's root."""
    from tandem import model_store
    from tandem.cli.generate import resolve_or_prepare
    from tandem.cluster import ClusterSpec, LocalCluster
    from tandem.config import check_served_model_names

    draft = None if args.draft == "none" else args.draft
    names = tuple(args.served_model_name)
    check_served_model_names(names)
    root = model_store.cache_root_from(args.cache_dir, os.environ)
    for model in filter(None, (args.target, draft)):
        resolve_or_prepare(model, root)  # (prepared here, with progress bars, not in the workers)
    coordinator_args = ("--host", "127.0.0.1", "--http-port", "0")
    coordinator_args += ("--served-model-name", *names) if names else ()
    spec = ClusterSpec(target=args.target, draft=draft, cache_dir=args.cache_dir, coordinator_args=coordinator_args)
    print(f"run-batch: starting {args.target}" + (f" and {draft}" if draft else "") + " on this machine...",
          file=sys.stderr, flush=True)
    with LocalCluster(spec) as cluster:
        yield api_base(cluster.coordinator.http_url)


async def _run_file(args: argparse.Namespace, base: str, token: str | None, total: int | None,
                    skip: int) -> Summary:
    async with session(token, args.timeout) as client:
        await check_reachable(client, base)  # (before --output is opened: a failed start truncates nothing)
        with contextlib.ExitStack() as files:
            source = sys.stdin if args.input == "-" else files.enter_context(open(args.input, encoding="utf-8"))
            mode = "a" if args.resume else "w"
            out = sys.stdout if args.output == "-" else files.enter_context(open(args.output, mode, encoding="utf-8"))
            progress = files.enter_context(_progress(None if total is None else total - skip))
            return await send_all(client, source, out, base, args.concurrency, args.retries, progress, skip)


def _progress(total: int | None) -> Any:
    """A bar on stderr while requests complete (drawn on a terminal only; the summary line is always printed)."""
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="run-batch", file=sys.stderr, disable=not sys.stderr.isatty(),
                dynamic_ncols=True)
