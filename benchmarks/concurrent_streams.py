"""Many clients at once through real processes: aggregate tokens/s and time to first token, against another revision.

A serving system is judged by what it gives many clients at once. This starts a target worker, a draft
worker (``--draft``, default the target's model; ``none`` for none) and a coordinator on 127.0.0.1, sends
``--streams`` greedy streaming requests at once (``--tokens`` each, past end-of-sequence, prompts taking
turns from a fixed set of eight), per speculation method, and reports the aggregate tokens per second, the
median and worst time to first token, and whether each output equals the same prompt's output from the
other revision. The configurations run one after another on one cluster per revision, prefix cache on as a
server has it: the first wave reads the eight prompts, the later ones find them cached. The same runs
with the code of another git revision (``--baseline``: checked out into a temporary worktree, its processes
started there with it on their path), the two revisions taking turns per round so that machine noise hits
both.

Writes concurrent_streams.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/concurrent_streams.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    DEFAULT_RESULTS_DIR,
    grouped_bars,
    machine_info,
    machine_line,
    markdown_table,
    names_from,
    new_figure,
    positive_ints,
    save_figure,
    write_json,
    write_markdown,
)
from benchmarks.runners import resolve_model_dir  # noqa: E402

NAME = "concurrent_streams"
BASELINE = "ba2841d"  # attention a call per piece of each sequence (before short runs shared calls)
METHODS = ("none", "auto", "draft", "ngram", "hybrid")
PROMPTS = [
    "Name three rivers in Europe.", "def add(a, b):", "Write a haiku about the sea.", "What is a prime number?",
    "List four colours of the rainbow.", "Explain recursion in one sentence.", "class Stack:",
    "Translate 'good morning' into French.",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="target: a catalog name or a model directory")
    parser.add_argument("--draft", default=None, help="draft model (default: the target's), or none")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto")
    parser.add_argument("--streams", type=lambda text: positive_ints(text, "--streams"), default=[16, 64],
                        help="comma-separated numbers of clients at once (default: 16,64)")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per request (default: %(default)s)")
    parser.add_argument("--methods", type=lambda text: names_from(text, METHODS), default=["none", "auto"],
                        help=f"comma-separated, of {', '.join(METHODS)} (default: none,auto)")
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="each worker's KV pool (default: room for every stream, 256 tokens each); less than "
                             "the streams need measures a burst the pool must queue")
    parser.add_argument("--baseline", default=BASELINE, help="git revision to compare with (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=1, help="times each revision runs every configuration")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    parser.add_argument("--name", default=NAME, help="file name of the results (without extension)")
    return parser


def checkout(revision: str) -> Path:
    """``revision`` in a temporary worktree with its gRPC stubs built; removed by ``remove_checkout``."""
    path = Path(tempfile.mkdtemp(prefix="tandem-baseline-")) / "tree"
    try:
        subprocess.run(["git", "-C", str(_REPO_ROOT), "worktree", "add", "--detach", "-q", str(path), revision],
                       check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"--baseline {revision}: cannot check it out ({getattr(exc, 'stderr', exc)})") from None
    subprocess.run([sys.executable, "-m", "tandem.proto_build"], cwd=path, check=True, capture_output=True)
    return path


def remove_checkout(path: Path) -> None:
    subprocess.run(["git", "-C", str(_REPO_ROOT), "worktree", "remove", "--force", str(path)], capture_output=True)
    shutil.rmtree(path.parent, ignore_errors=True)


def run_streams(client: Any, streams: int, tokens: int, method: str) -> dict[str, Any]:
    """``streams`` requests at once; tokens/s over the wave, time to first token, and each stream's tokens."""
    from tandem.client import build_request

    def one(index: int) -> tuple[list[int], float, int]:
        started, first, got, preempted = time.monotonic(), None, [], 0
        request = build_request(PROMPTS[index % len(PROMPTS)], chat=True, max_new_tokens=tokens, ignore_eos=True,
                                method=method)
        for chunk in client.stream(request):
            if chunk.token_ids and first is None:
                first = time.monotonic() - started
            got.extend(chunk.token_ids)
            preempted += chunk.stats.preemptions
        return got, first if first is not None else time.monotonic() - started, preempted

    client.generate(build_request(PROMPTS[0], chat=True, max_new_tokens=4, method=method))  # warm the path
    started = time.monotonic()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(one, range(streams)))
    seconds = time.monotonic() - started
    firsts = [first for _, first, _ in results]
    return {"seconds": seconds, "tokens/s": sum(len(got) for got, _, _ in results) / seconds,
            "ttft p50 s": statistics.median(firsts), "ttft max s": max(firsts),
            "preemptions": sum(p for _, _, p in results), "outputs": [got for got, _, _ in results]}


def measure(revision_path: Path | None, args: argparse.Namespace, model_dir: Path, draft_dir: Path | None,
            log_dir: Path) -> dict[tuple[int, str], dict[str, Any]]:
    """Every (streams, method) on one cluster running the code at ``revision_path`` (None: this checkout)."""
    from tandem.client import TandemClient
    from tandem.cluster import ClusterSpec, LocalCluster

    saved, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    if revision_path is not None:
        # The cluster's processes import tandem from the other revision's tree: `python -m tandem` puts its working
        # directory first on its path (before PYTHONPATH), so they start there too.
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(revision_path), saved) if p)
        os.chdir(revision_path)
    try:
        spec = ClusterSpec(target=str(model_dir), draft=str(draft_dir) if draft_dir else None,
                           draft_replicas=1 if draft_dir else 0, dtype=args.dtype,
                           kv_cache_tokens=args.kv_cache_tokens or max(16384, max(args.streams) * 256),
                           log_dir=log_dir,
                           coordinator_args=("--call-timeout", "300"))
        with LocalCluster(spec) as cluster, TandemClient(cluster.coordinator.address, timeout_s=900) as client:
            return {(streams, method): run_streams(client, streams, args.tokens, method)
                    for streams in args.streams for method in args.methods}
    finally:
        os.chdir(cwd)
        if saved is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved


def chart(rows: list[dict[str, Any]], out: Path, name: str) -> Path:
    fig, (ax,) = new_figure()
    groups = [f"{r['streams']} streams, {r['method']}" for r in rows]
    grouped_bars(ax, groups, {"baseline": [r["baseline tokens/s"] for r in rows],
                              "now": [r["now tokens/s"] for r in rows]}, "tokens/s, all streams together")
    ax.set_title("many clients at once through real processes")
    return save_figure(fig, out, name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model_dir = resolve_model_dir(args.model, args.cache_dir)
    draft_dir = None if args.draft == "none" else resolve_model_dir(args.draft or args.model, args.cache_dir)
    baseline_path = checkout(args.baseline)
    runs: dict[str, list[dict[tuple[int, str], dict[str, Any]]]] = {"baseline": [], "now": []}
    try:
        for round_index in range(args.rounds):
            order = ("baseline", "now") if round_index % 2 == 0 else ("now", "baseline")
            for label in order:
                print(f"[{NAME}] round {round_index + 1}: {label}", file=sys.stderr, flush=True)
                log_dir = Path(tempfile.mkdtemp(prefix=f"{NAME}-{label}-"))
                runs[label].append(measure(baseline_path if label == "baseline" else None, args, model_dir,
                                           draft_dir, log_dir))
    finally:
        remove_checkout(baseline_path)
    rows = []
    for streams in args.streams:
        for method in args.methods:
            base = [run[(streams, method)] for run in runs["baseline"]]
            now = [run[(streams, method)] for run in runs["now"]]
            same = sum(a == b for a, b in zip(base[0]["outputs"], now[0]["outputs"]))
            row = {"streams": streams, "method": method}
            for label, measured in (("baseline", base), ("now", now)):
                row[f"{label} tokens/s"] = statistics.median(m["tokens/s"] for m in measured)
                row[f"{label} ttft p50 s"] = statistics.median(m["ttft p50 s"] for m in measured)
                row[f"{label} ttft max s"] = statistics.median(m["ttft max s"] for m in measured)
                row[f"{label} preemptions"] = statistics.median(m.get("preemptions", 0) for m in measured)
            row["speedup"] = row["now tokens/s"] / row["baseline tokens/s"]
            row["same outputs"] = f"{same}/{streams}"
            rows.append(row)
    machine = machine_info()
    columns = ["streams", "method", "baseline tokens/s", "now tokens/s", "speedup", "baseline ttft p50 s",
               "now ttft p50 s", "baseline ttft max s", "now ttft max s", "baseline preemptions", "now preemptions",
               "same outputs"]
    table = markdown_table(rows, columns)
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "name", "cache_dir")}
    write_json(args.out, args.name, {"machine": machine, "settings": settings, "rows": rows})
    write_markdown(args.out, args.name, "Many clients at once through real processes, against the baseline revision",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{table}\n")
    chart(rows, args.out, args.name)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
