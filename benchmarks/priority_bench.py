"""Interactive requests beside a batch that fills the target: first come, first served against priorities.

One target whose KV pool the background streams fill (more of them than it holds at once: they take turns,
preempting each other), and short interactive requests arriving every ``--interval`` seconds. Two
configurations on one cluster (tandem.cluster.LocalCluster, as `tandem up` starts it, the coordinator with
``--scheduling-policy priority``), one after the other, ``--rounds`` times alternating:

- ``fcfs``: every request at priority 0, what a server without priorities does (the oldest sequences first);
- ``priority``: the background at priority 1, the interactive requests at 0: a prompt of theirs starts ahead
  of the background's growth, and where the pool is full it keeps its place at the target until background
  sequences, refused as they grow, are preempted (tandem/rpc/room_waits.py).

Reported per configuration: the interactive requests' latency (send to last token) and time to first token
(median, 90th percentile, worst), the background's tokens per second over the window, and the preemptions
its finished requests met. Greedy, method ``--method``.

Writes priority_bench.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/priority_bench.py` from anywhere
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

NAME = "priority_bench"
# (background's priority, interactive's): fcfs sends everything at 0
CONFIGS = {"fcfs": (0, 0), "priority": (1, 0)}
TOPICS = ["rivers of Europe", "prime numbers", "the water cycle", "how a compiler works", "the history of tea",
          "photosynthesis", "binary search", "the French revolution", "plate tectonics", "how vaccines work",
          "the game of chess", "volcanoes", "the printing press", "black holes", "coral reefs", "the Roman roads"]
QUESTIONS = ["What is {}? Answer in two sentences.", "Give one surprising fact about {}.",
             "Explain {} to a child in one sentence."]
LATENCIES = ("latency_p50_s", "latency_p90_s", "latency_max_s")
TTFTS = ("ttft_p50_s", "ttft_p90_s", "ttft_max_s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2", help="a catalog name or a model directory (default: %(default)s)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--kv-cache-tokens", type=int, default=4096, help="the target's KV pool (default: %(default)s)")
    p.add_argument("--background", type=int, default=16, help="background streams (default: %(default)s)")
    p.add_argument("--background-tokens", type=int, default=384,
                   help="tokens of each background answer (default: %(default)s)")
    p.add_argument("--interactive-tokens", type=int, default=32,
                   help="tokens of each interactive answer (default: %(default)s)")
    p.add_argument("--interval", type=float, default=3.0,
                   help="seconds between interactive requests (default: %(default)s)")
    p.add_argument("--seconds", type=float, default=60.0, help="window per configuration (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="windows per configuration, alternating (default: 1)")
    p.add_argument("--method", default="none", help="speculation method of every request (default: %(default)s)")
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    p.add_argument("--name", default=NAME, help="file name of the results (without extension)")
    return p


def request(prompt: str, tokens: int, priority: int, method: str) -> Any:
    from tandem.client import build_request

    req = build_request(prompt, chat=True, max_new_tokens=tokens, ignore_eos=True, method=method)
    req.priority = priority
    return req


def one_window(client: Any, config: str, window: int, args: argparse.Namespace) -> dict[str, Any]:
    """The background streams and the interactive requests for ``--seconds``; what each saw."""
    background_priority, interactive_priority = CONFIGS[config]
    stop = threading.Event()
    lock = threading.Lock()
    counted = {"tokens": 0, "preemptions": 0, "finished": 0}

    def background(i: int) -> None:
        n = 0
        while not stop.is_set():
            topic = TOPICS[(i + n + window) % len(TOPICS)]
            call = client.stream(request(f"Write a long essay about {topic}, stream {i}.", args.background_tokens,
                                         background_priority, args.method))
            try:
                for message in call:
                    with lock:
                        counted["tokens"] += len(message.token_ids)
                        if message.HasField("stats"):
                            counted["preemptions"] += message.stats.preemptions
                            counted["finished"] += 1
                    if stop.is_set():
                        call.cancel()
                        break
            except Exception as exc:  # noqa: BLE001 - a cancelled stream ends with an error
                if not stop.is_set():
                    raise RuntimeError(f"background stream {i} failed: {exc}") from exc
            n += 1

    def interactive(j: int) -> tuple[float, float]:
        question = QUESTIONS[j % len(QUESTIONS)].format(TOPICS[(7 * j + 3 * window) % len(TOPICS)])
        sent, first = time.perf_counter(), None
        for message in client.stream(request(question, args.interactive_tokens, interactive_priority, args.method)):
            if first is None and message.token_ids:
                first = time.perf_counter() - sent
        return time.perf_counter() - sent, first

    with ThreadPoolExecutor(args.background + 8) as pool:
        streams = [pool.submit(background, i) for i in range(args.background)]
        time.sleep(args.interval)  # the background fills the pool first
        started, at_start = time.perf_counter(), dict(counted)
        asked = []
        while time.perf_counter() - started < args.seconds:
            asked.append(pool.submit(interactive, len(asked)))
            time.sleep(args.interval)
        answered = [f.result() for f in asked]
        elapsed = time.perf_counter() - started
        with lock:
            tokens = counted["tokens"] - at_start["tokens"]
        stop.set()
        for f in streams:
            f.result()
    latencies, ttfts = [a for a, _ in answered], [t for _, t in answered]
    return {"latencies_s": latencies, "ttfts_s": ttfts, "background_tokens_per_s": tokens / elapsed,
            "background_preemptions": counted["preemptions"], "background_finished": counted["finished"]}


def summarise(config: str, windows: list[dict[str, Any]]) -> dict[str, Any]:
    latencies = [x for w in windows for x in w["latencies_s"]]
    ttfts = [x for w in windows for x in w["ttfts_s"]]
    row: dict[str, Any] = {"config": config, "interactive": len(latencies)}
    for keys, values in ((LATENCIES, latencies), (TTFTS, ttfts)):
        row.update(zip(keys, (statistics.median(values), percentile(values, 90), max(values))))
    row["background_tokens_per_s"] = statistics.fmean(w["background_tokens_per_s"] for w in windows)
    row["background_preemptions"] = sum(w["background_preemptions"] for w in windows)
    row["background_finished"] = sum(w["background_finished"] for w in windows)
    row["windows"] = windows
    return row


def chart(rows: list[dict[str, Any]], out: Path, name: str, args: argparse.Namespace) -> Path:
    fig, axes = new_figure(ncols=2, width=11)
    axes[0].set_title(f"interactive answers ({args.interactive_tokens} tokens) beside {args.background} streams")
    grouped_bars(axes[0], ["p50", "p90", "worst"], {r["config"]: [r[k] for k in LATENCIES] for r in rows},
                 "latency, s")
    axes[1].set_title("the background's throughput")
    grouped_bars(axes[1], ["background"], {r["config"]: [r["background_tokens_per_s"]] for r in rows}, "tokens/s")
    return save_figure(fig, out, name)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    from tandem.client import TandemClient
    from tandem.cluster import ClusterSpec, LocalCluster

    args = build_parser().parse_args(argv)
    if min(args.background, args.background_tokens, args.interactive_tokens, args.rounds, args.kv_cache_tokens) < 1 \
            or not args.interval > 0 or not args.seconds > 0:
        raise SystemExit("--background, --background-tokens, --interactive-tokens, --rounds and --kv-cache-tokens "
                         "must be >= 1, --interval and --seconds > 0")
    windows: dict[str, list[dict[str, Any]]] = {config: [] for config in CONFIGS}
    with tempfile.TemporaryDirectory(prefix=f"{NAME}-") as workdir:
        spec = ClusterSpec(target=args.target, draft=None, dtype=args.dtype, kv_cache_tokens=args.kv_cache_tokens,
                           log_dir=Path(workdir), coordinator_args=("--scheduling-policy", "priority"))
        print(f"[{NAME}] starting {args.target}", file=sys.stderr, flush=True)
        with LocalCluster(spec) as cluster, TandemClient(cluster.coordinator.address, timeout_s=3600) as client:
            client.generate(request("Hello.", 4, 0, args.method))  # a first call, uncounted
            for window in range(args.rounds):
                for config in (CONFIGS if window % 2 == 0 else reversed(list(CONFIGS))):
                    print(f"[{NAME}] {config}: window {window + 1}/{args.rounds}", file=sys.stderr, flush=True)
                    windows[config].append(one_window(client, config, window, args))
    rows = [summarise(config, found) for config, found in windows.items()]
    machine = machine_info()
    columns = ["config", "interactive", *LATENCIES, *TTFTS, "background_tokens_per_s", "background_preemptions",
               "background_finished"]
    table = markdown_table(rows, columns)
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "name")}
    write_json(args.out, args.name, {"machine": machine, "settings": settings, "rows": rows})
    write_markdown(args.out, args.name, "Interactive requests beside a batch that fills the target",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{table}\n")
    chart(rows, args.out, args.name, args)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
