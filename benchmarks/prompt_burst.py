"""A burst of long prompts reaching one idle target at once: when is each answered, and is any taken for a hang?

Prompts that arrive together at a target with nothing else running share one lone chunk per step
(``PrefillChunks.take_lone``, tandem/rpc/prefill_chunks.py): those that fit finish, shortest first,
and while none does the oldest takes the chunk, so the burst is served first come, first served.
With ``--prefill-chunk-tokens 0`` every prompt is computed whole, all of them in one step. Each
answer may come long after its own prompt's price (the queue ahead of it), past the coordinator's
hang timeout for the call: the coordinator then asks the worker what it computes, and waits on
while its batch is within its own price (coordinator/workers.py, ``RequestChannel._call``).

Two configurations, each on processes of its own (tandem.cluster.LocalCluster, as `tandem up`
starts them): the target worker as it is, and with ``--prefill-chunk-tokens 0``. One target
replica, no draft model, method none. ``--prompts`` prompts of ``--prompt-tokens`` tokens (no
two share a block), sent at once, each writing ``--new-tokens``; ``--reps`` times, new prompts
each time. Reported per configuration: the first, median, mean and last time to first token
(each request from its own send, medians over the reps), the requests moved to another replica
(the coordinator took the target for hung: none should be), and the prompt tokens the target
read over the prompt tokens sent (above 1: prompts read again after a move).

Writes prompt_burst.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/prompt_burst.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    DEFAULT_RESULTS_DIR,
    grouped_bars,
    machine_info,
    machine_line,
    markdown_table,
    new_figure,
    save_figure,
    write_json,
    write_markdown,
)
from benchmarks.shared_prompt_wait import prompt_of  # noqa: E402

NAME = "prompt_burst"
CONFIGS = {"lone chunks (default)": (), "--prefill-chunk-tokens 0": ("--prefill-chunk-tokens", "0")}
TIMES = ("first_ttft_s", "median_ttft_s", "mean_ttft_s", "last_ttft_s")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen-coder-1.5b", help="a catalog name or a model directory")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--prompts", type=int, default=8, help="prompts sent at once")
    p.add_argument("--prompt-tokens", type=int, default=1500, help="tokens of each prompt")
    p.add_argument("--new-tokens", type=int, default=4, help="tokens each request writes")
    p.add_argument("--reps", type=int, default=1, help="bursts per configuration (medians kept), new prompts each")
    p.add_argument("--kv-cache-tokens", type=int, default=0,
                   help="the target's KV pool (default: room for every prompt of a burst at once)")
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    p.add_argument("--name", default=NAME, help="file name of the results (without extension)")
    return p


def one_burst(client: Any, rep: int, args: argparse.Namespace) -> tuple[list[float], int]:
    """Each request's time to first token (from the burst's send), and the requests moved."""
    from tandem.client import build_request

    requests = [build_request(prompt_of(1000 * rep + i, args.prompt_tokens), max_new_tokens=args.new_tokens,
                              method="none", ignore_eos=True) for i in range(args.prompts)]
    sent = time.perf_counter()

    def first_token(request: Any) -> tuple[float, int]:
        first, moves = None, 0
        for message in client.stream(request):
            if first is None and message.token_ids:
                first = time.perf_counter() - sent
            if message.HasField("stats"):
                moves = message.stats.target_moves
        return first, moves

    with ThreadPoolExecutor(args.prompts) as pool:
        answered = list(pool.map(first_token, requests))
    return sorted(t for t, _ in answered), sum(m for _, m in answered)


def prompt_tokens_read(address: str) -> int:
    """The prompt tokens a target has looked up in its prefix cache (every prompt it read), from its Info."""
    import grpc

    from tandem.v1 import common_pb2, target_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        info = target_pb2_grpc.TargetWorkerStub(channel).Info(common_pb2.WorkerInfoRequest(), timeout=30)
    return info.prefix_cache.prompt_tokens


def run_config(name: str, target_args: tuple[str, ...], args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    from tandem.client import TandemClient, build_request
    from tandem.cluster import ClusterSpec, LocalCluster

    kv_tokens = args.kv_cache_tokens or args.prompts * (args.prompt_tokens + args.new_tokens + 64)
    spec = ClusterSpec(target=args.target, draft=None, dtype=args.dtype, kv_cache_tokens=kv_tokens,
                       target_args=target_args, log_dir=workdir / ("chunks" if not target_args else "whole"))
    print(f"[{NAME}] {name}: starting {args.target}", file=sys.stderr, flush=True)
    bursts, moves = [], 0
    with LocalCluster(spec) as cluster, TandemClient(cluster.coordinator.address, timeout_s=7200) as client:
        client.generate(build_request([11, 12, 13], max_new_tokens=2, method="none"))  # a first call, uncounted
        (target,) = cluster.workers("target")
        read_before = prompt_tokens_read(target.address)
        for rep in range(args.reps):
            print(f"[{NAME}] {name}: burst {rep + 1}/{args.reps}", file=sys.stderr, flush=True)
            waits, moved = one_burst(client, rep, args)
            bursts.append(waits)
            moves += moved
        read = prompt_tokens_read(target.address) - read_before
    row: dict[str, Any] = {"config": name}
    for key, pick in zip(TIMES, (min, statistics.median, statistics.fmean, max)):
        row[key] = statistics.median(pick(waits) for waits in bursts)
    row["moves"] = moves
    row["prompt_tokens_read_per_sent"] = read / (args.reps * args.prompts * args.prompt_tokens)
    row["ttfts_s"] = bursts
    return row


def chart(rows: list[dict[str, Any]], out: Path, name: str, args: argparse.Namespace) -> Path:
    fig, axes = new_figure(ncols=1, width=6.5)
    axes[0].set_title(f"{args.prompts} prompts of {args.prompt_tokens} tokens at once")
    grouped_bars(axes[0], ["first", "median", "mean", "last"], {r["config"]: [r[k] for k in TIMES] for r in rows},
                 "time to first token, s")
    return save_figure(fig, out, name)


def main(argv: list[str] | None = None) -> int:
    import tempfile

    args = build_parser().parse_args(argv)
    if min(args.prompts, args.prompt_tokens, args.new_tokens, args.reps) < 1 or args.kv_cache_tokens < 0:
        raise SystemExit("--prompts, --prompt-tokens, --new-tokens and --reps must be >= 1, --kv-cache-tokens >= 0")
    with tempfile.TemporaryDirectory(prefix=f"{NAME}-") as workdir:
        rows = [run_config(name, flags, args, Path(workdir)) for name, flags in CONFIGS.items()]
    machine = machine_info()
    table = markdown_table(rows, ["config", *TIMES, "moves", "prompt_tokens_read_per_sent"])
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "name")}
    write_json(args.out, args.name, {"machine": machine, "settings": settings, "rows": rows})
    write_markdown(args.out, args.name, "A burst of long prompts reaching one idle target at once",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{table}\n")
    chart(rows, args.out, args.name, args)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
