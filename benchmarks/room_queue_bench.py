"""More requests than a target's KV pool holds, arriving one after another: are they served in the order they came?

``tandem up`` (SmolLM2, one target and one draft, ``--kv-cache-tokens`` small enough that a few requests fill it)
gets ``--requests`` streamed completions of ``--tokens`` tokens each, one every ``--gap`` seconds, over its
OpenAI API. Requests refused for room wait; the coordinator's room queue (tandem/spec/room_queue.py) gives them
room in the order they started. With ``--baseline DIR`` (a checkout of the code before it, its stubs built with
``python -m tandem.proto_build``) the same load runs against that code too, alternating ``--rounds`` times, so
that both sides are measured in one run on one machine. ``--room-hold S`` sets this side's coordinators'
``--room-hold``; ``--baseline-room-hold S`` the baseline's, which without ``--baseline`` is this code again: the
hold on and off, measured side by side on one code.

``--coordinators N`` (N > 1) starts N - 1 more coordinators beside ``tandem up``'s, on the same workers (its
workers file), and sends request i to coordinator i mod N: each coordinator orders its own waiting requests, and
the target orders those of all of them by when they arrived (tandem/rpc/room_waits.py).

Reported per side: the pairs of requests whose first tokens came in the other order than they were sent (of all
pairs; ``late_inversions``: those more than ``LATE_S`` apart, a request passed over rather than two admitted
together), time to first token and latency (median, 90th percentile, worst, from each request's send), tokens per
second over the whole load, and the preemptions the coordinator counted (``vllm:num_preemptions_total``).

Writes room_queue_bench.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/room_queue_bench.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    DEFAULT_RESULTS_DIR,
    grouped_bars,
    machine_info,
    machine_line,
    markdown_table,
    new_figure,
    percentile,
    save_figure,
    write_json,
    write_markdown,
)

NAME = "room_queue_bench"
START_TIMEOUT_S = 300.0
# A pair out of order by more than this (first tokens this far apart in the other order) is a request passed over,
# not requests admitted together whose first tokens came a fraction of a second apart.
LATE_S = 1.0
COLUMNS = ("side", "round", "inversions", "late_inversions", "pairs", "ttft_p50_s", "ttft_p90_s", "ttft_max_s",
           "latency_p50_s", "latency_p90_s", "latency_max_s", "tokens_per_s", "preemptions")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2", help="a catalog name or a model directory (default: %(default)s)")
    p.add_argument("--kv-cache-tokens", type=int, default=1024, help="the target's KV pool (default: %(default)s)")
    p.add_argument("--requests", type=int, default=40, help="requests sent (default: %(default)s)")
    p.add_argument("--gap", type=float, default=0.25, help="seconds between requests (default: %(default)s)")
    p.add_argument("--tokens", type=int, default=200, help="tokens of each answer (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="runs per side, alternating (default: 1)")
    p.add_argument("--coordinators", type=int, default=1,
                   help="coordinators sharing the workers, requests sent to each in turn (default: %(default)s)")
    p.add_argument("--baseline", type=Path, default=None,
                   help="a checkout of the code to compare with (its `tandem` package is run); none: this code only")
    p.add_argument("--room-hold", type=float, default=None, metavar="S",
                   help="this side's coordinators' --room-hold (default: theirs)")
    p.add_argument("--baseline-room-hold", type=float, default=None, metavar="S",
                   help="the baseline's --room-hold; without --baseline, the baseline is this code with it")
    p.add_argument("--label", default="room queue", help="this code's name in the results (default: %(default)s)")
    p.add_argument("--baseline-label", default="before (each request backs off alone)",
                   help="the baseline's name in the results (default: %(default)s)")
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    p.add_argument("--name", default=NAME, help="file name of the results (without extension)")
    return p


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Up:
    """``tandem up`` from the checkout ``root``, serving the OpenAI API on a free port until stopped."""

    def __init__(self, root: Path, args: argparse.Namespace, log_dir: Path, room_hold: float | None = None) -> None:
        self.http_port = free_port()
        env = {**os.environ, "PYTHONPATH": str(root)}
        hold = ["--room-hold", repr(room_hold)] if room_hold is not None else []  # (None: code without the flag)
        cmd = [sys.executable, "-m", "tandem", "up", "--target", args.target, "--draft", args.target,
               "--kv-cache-tokens", str(args.kv_cache_tokens), "--port", "0", "--http-port", str(self.http_port),
               "--log-dir", str(log_dir), *hold]
        self.proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.extra: list[tuple[subprocess.Popen, int]] = []  # more coordinators: (process, HTTP port)
        self._logs: list[Any] = []  # their log files, closed at stop
        if not self._ready(self.proc):
            self.stop()
            raise RuntimeError(f"tandem up from {root} did not start (logs in {log_dir})")
        for n in range(1, args.coordinators):  # on the workers tandem up runs, through its workers file
            port = free_port()
            log = open(log_dir / f"coordinator-{n}.log", "w")  # noqa: SIM115 - open while it runs
            self._logs.append(log)
            proc = subprocess.Popen([sys.executable, "-m", "tandem", "serve", "coordinator", "--discovery", "file",
                                     "--workers-file", str(log_dir / "workers.json"), "--tokenizer", args.target,
                                     "--port", "0", "--http-port", str(port), *hold],
                                    cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self.extra.append((proc, port))
            if not self._serving(port):
                self.stop()
                raise RuntimeError(f"coordinator {n} from {root} did not start (logs in {log_dir})")

    @staticmethod
    def _ready(proc: subprocess.Popen) -> bool:
        started = time.monotonic()
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("ready"):
                return True
            if time.monotonic() - started > START_TIMEOUT_S:
                break
        return False

    @staticmethod
    def _serving(port: int) -> bool:
        started = time.monotonic()
        while time.monotonic() - started < START_TIMEOUT_S:
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                    return True
            except OSError:
                pass
            time.sleep(0.5)
        return False

    @property
    def urls(self) -> list[str]:
        """Each coordinator's HTTP API, tandem up's first."""
        return [f"http://127.0.0.1:{port}" for port in (self.http_port, *(port for _, port in self.extra))]

    def preemptions(self) -> float:
        total = 0.0
        for url in self.urls:
            text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
            found = re.search(r"^tandem_coordinator_preemptions_total (\S+)$", text, re.M)
            total += float(found.group(1)) if found else 0.0
        return total

    def stop(self) -> None:
        for proc in [*(proc for proc, _ in self.extra), self.proc]:  # (tandem up's workers last)
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        for log in self._logs:
            log.close()


async def load(urls: list[str], args: argparse.Namespace) -> list[tuple[float, float, float]]:
    """Each request's (sent, first token, done), in seconds from the first send, in the order sent; request i goes to
    coordinator i mod len(urls)."""
    from openai import AsyncOpenAI

    t0 = time.perf_counter()

    async def one(client: AsyncOpenAI, i: int) -> tuple[float, float, float]:
        await asyncio.sleep(i * args.gap)
        sent, first = time.perf_counter() - t0, None
        stream = await client.completions.create(
            model=args.target, prompt=f"Story {i}: Once upon a time", max_tokens=args.tokens, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].text:
                first = time.perf_counter() - t0
        done = time.perf_counter() - t0
        return sent, first if first is not None else done, done

    clients = [AsyncOpenAI(base_url=url + "/v1", api_key="unused", timeout=1200) for url in urls]
    try:
        return await asyncio.gather(*(one(clients[i % len(clients)], i) for i in range(args.requests)))
    finally:
        for client in clients:
            await client.close()


def summary(side: str, round_: int, runs: list[tuple[float, float, float]], preemptions: float,
            tokens: int) -> dict[str, Any]:
    inversions = sum(1 for a in runs for b in runs if a[0] < b[0] and a[1] > b[1])
    late = sum(1 for a in runs for b in runs if a[0] < b[0] and a[1] > b[1] + LATE_S)
    ttft = [first - sent for sent, first, _ in runs]
    latency = [done - sent for sent, _, done in runs]
    span = max(done for _, _, done in runs) - min(sent for sent, _, _ in runs)
    return {"side": side, "round": round_, "inversions": inversions, "late_inversions": late,
            "pairs": len(runs) * (len(runs) - 1) // 2,
            "ttft_p50_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90), "ttft_max_s": max(ttft),
            "latency_p50_s": percentile(latency, 50), "latency_p90_s": percentile(latency, 90),
            "latency_max_s": max(latency), "tokens_per_s": len(runs) * tokens / span, "preemptions": preemptions}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.requests < 2 or args.gap < 0 or args.tokens < 1 or args.rounds < 1 or args.coordinators < 1:
        raise SystemExit("--requests must be >= 2, --gap >= 0, --tokens, --rounds and --coordinators >= 1")
    sides = {args.label: (_REPO_ROOT, args.room_hold)}  # side -> (checkout, --room-hold or None)
    if args.baseline is not None:
        if not (args.baseline / "tandem" / "v1").is_dir():
            raise SystemExit(f"--baseline {args.baseline}: no tandem/v1 stubs there; run `python -m "
                             "tandem.proto_build` in it first")
        sides = {args.baseline_label: (args.baseline.resolve(), args.baseline_room_hold), **sides}
    elif args.baseline_room_hold is not None:
        if args.baseline_label == args.label:
            raise SystemExit("--baseline-label and --label must differ")
        sides = {args.baseline_label: (_REPO_ROOT, args.baseline_room_hold), **sides}
    records, timelines = [], []
    for round_ in range(args.rounds):
        for side, (root, room_hold) in sides.items():
            log_dir = Path(tempfile.mkdtemp(prefix=f"{args.name}-{round_}-"))  # each run's process logs
            up = Up(root, args, log_dir, room_hold)
            try:
                runs = asyncio.run(load(up.urls, args))
                records.append(summary(side, round_, runs, up.preemptions(), args.tokens))
                timelines.append({"side": side, "round": round_,  # (sent, first token, done) of each, in send order
                                  "requests": [[round(t, 3) for t in run] for run in runs]})
            finally:
                up.stop()
            print(markdown_table([records[-1]], COLUMNS), flush=True)
    info = machine_info()
    write_json(args.out, args.name, {"settings": vars(args), "machine": info, "records": records,
                                     "timelines": timelines})
    body = (f"{machine_line(info)}\n\n{args.requests} requests of {args.tokens} tokens, one every {args.gap} s, "
            f"{args.target} with a {args.kv_cache_tokens}-token pool, {args.coordinators} coordinator(s) taking "
            "them in turn.\n\n" + markdown_table(records, COLUMNS))
    write_markdown(args.out, args.name, "Requests refused for room: served in the order they came?", body)
    fig, (left, right) = new_figure(ncols=2, width=11)
    labels = [f"{r['side']} #{r['round']}" for r in records]
    grouped_bars(left, labels, {"inverted pairs": [r["inversions"] for r in records]}, "pairs")
    grouped_bars(right, labels, {k: [r[k] for r in records] for k in ("ttft_p50_s", "ttft_p90_s", "ttft_max_s")},
                 "seconds to first token")
    save_figure(fig, args.out, args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
