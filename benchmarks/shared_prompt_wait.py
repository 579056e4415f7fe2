"""Requests that share a long prompt and arrive together: computed once (the default), or each as it comes.

A target's prefix cache serves blocks already computed, so prompts that share a prefix and reach
the target together each computed it, until a new prompt that shares full blocks with one being
computed waited for it (target_worker/shared_prompts.py). Two configurations, each on processes
of its own (tandem.cluster.LocalCluster, as `tandem up` starts them): the target worker as it is,
and with ``--no-shared-prompt-wait``. One target replica, no draft model, method none, so that
what is measured is the prompts' reading. Workloads, each ``--reps`` times with a new prompt each
time (nothing cached from the time before):

  samples       one prompt of ``--prompt-tokens`` sampled ``--choices`` times at once (an HTTP
                request's ``n``, RL rollouts), ``--new-tokens`` each, on an idle target
  samples-busy  the same while another request is decoding on the target (a server at work: the
                prompts arrive while a step runs, land in one batch, and are computed in chunks)
  answers       ``--choices`` answers of ``--answer-tokens`` scored after one context of
                ``--prompt-tokens`` (``prompt_logprobs``, one new token), sent at once:
                lm-evaluation-harness's multiple choice with ``num_concurrent``

Reported per configuration and workload: the median wall time until every request of a time
has finished, the median time to the first request's first token and to the last one's, and the
prompt tokens the target took from its cache (the requests' own ``prompt_tokens_reused``).

Writes shared_prompt_wait.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/shared_prompt_wait.py` from anywhere
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
from benchmarks.runners import probe_tokens  # noqa: E402

NAME = "shared_prompt_wait"
CONFIGS = {"wait (default)": (), "--no-shared-prompt-wait": ("--no-shared-prompt-wait",)}
WORKLOADS = ("samples", "samples-busy", "answers")
BUSY_TOKENS = 2048  # the busy workload's other request: decoding until it is cancelled
VOCAB_BOUND = 21_000  # probe ids stay below it (inside every vocabulary we run)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="qwen-coder-1.5b", help="a catalog name or a model directory")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="the shared prompt (or context), tokens")
    p.add_argument("--choices", type=int, default=4, help="requests sharing it, sent at once")
    p.add_argument("--new-tokens", type=int, default=16, help="tokens each sample writes")
    p.add_argument("--answer-tokens", type=int, default=8, help="tokens of each scored answer")
    p.add_argument("--reps", type=int, default=3, help="times per workload (median kept), a new prompt each")
    p.add_argument("--kv-cache-tokens", type=int, default=16384)
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    p.add_argument("--name", default=NAME, help="file name of the results (without extension)")
    return p


def prompt_of(rep: int, length: int) -> list[int]:
    """A prompt no other time or workload starts with (ordinary token ids)."""
    return [(t + 53 * rep) % VOCAB_BOUND for t in probe_tokens(length)]


def requests_of(workload: str, rep: int, args: argparse.Namespace) -> list[Any]:
    from tandem.client import build_request
    from tandem.sampling import SamplingParams

    if workload.startswith("samples"):
        prompt = prompt_of(3 * rep + (workload == "samples-busy"), args.prompt_tokens)
        return [build_request(prompt, max_new_tokens=args.new_tokens, method="none", ignore_eos=True,
                              sampling=SamplingParams(1.0, seed=i)) for i in range(args.choices)]
    context = prompt_of(3 * rep + 2, args.prompt_tokens)
    return [build_request([*context, *[(t + 307 * (j + 1)) % VOCAB_BOUND for t in probe_tokens(args.answer_tokens)]],
                          max_new_tokens=1, method="none", sampling=SamplingParams(prompt_logprobs=1))
            for j in range(args.choices)]


def send_together(client: Any, requests: list[Any]) -> dict[str, Any]:
    """Send ``requests`` at once and stream each: the wall time until all finished, each one's first token time and
    cached prompt tokens."""
    started = time.perf_counter()

    def one(request: Any) -> tuple[float, int]:
        first, reused = None, 0
        for message in client.stream(request):
            if first is None and message.token_ids:
                first = time.perf_counter() - started
            if message.HasField("stats"):
                reused = message.stats.prompt_tokens_reused
        return first or 0.0, reused

    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(one, requests))
    firsts = sorted(f for f, _ in results)
    return {"wall_s": time.perf_counter() - started, "first_ttft_s": firsts[0], "last_ttft_s": firsts[-1],
            "reused_tokens": sum(r for _, r in results)}


@contextmanager
def decoding(client: Any) -> Iterator[None]:
    """Another request decoding on the target (its first token streamed) for as long as the block runs."""
    from tandem.client import build_request

    call = client.stream(build_request([17, 18, 19, 20], max_new_tokens=BUSY_TOKENS, method="none", ignore_eos=True))
    next(call)  # its prompt is in: it decodes a token a step from now on
    try:
        yield
    finally:
        call.cancel()


def run_config(name: str, target_args: tuple[str, ...], args: argparse.Namespace, workdir: Path
               ) -> list[dict[str, Any]]:
    from tandem.client import TandemClient, build_request
    from tandem.cluster import ClusterSpec, LocalCluster

    spec = ClusterSpec(target=args.target, draft=None, dtype=args.dtype, kv_cache_tokens=args.kv_cache_tokens,
                       target_args=target_args, log_dir=workdir / name.strip("-").split()[0])
    print(f"[{NAME}] {name}: starting {args.target}", file=sys.stderr, flush=True)
    rows = []
    with LocalCluster(spec) as cluster, TandemClient(cluster.coordinator.address, timeout_s=3600) as client:
        client.generate(build_request([11, 12, 13], max_new_tokens=2, method="none"))  # a first call, uncounted
        for workload in WORKLOADS:
            times = []
            for rep in range(args.reps):
                print(f"[{NAME}] {name}: {workload} {rep + 1}/{args.reps}", file=sys.stderr, flush=True)
                if workload == "samples-busy":
                    with decoding(client):
                        times.append(send_together(client, requests_of(workload, rep, args)))
                else:
                    times.append(send_together(client, requests_of(workload, rep, args)))
            rows.append({"config": name, "workload": workload,
                         **{key: statistics.median(t[key] for t in times) for key in times[0]}})
    return rows


def chart(rows: list[dict[str, Any]], out: Path, name: str) -> Path:
    fig, (ax,) = new_figure()
    grouped_bars(ax, list(WORKLOADS), {config: [next(r["wall_s"] for r in rows if r["config"] == config
                                                     and r["workload"] == w) for w in WORKLOADS]
                                       for config in CONFIGS}, "seconds until all have finished (median)")
    ax.set_title("requests sharing a long prompt, sent at once")
    return save_figure(fig, out, name)


def with_speedups(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row with its wall time's speedup over the same workload's ``--no-shared-prompt-wait`` row."""
    off = {r["workload"]: r["wall_s"] for r in rows if r["config"] == "--no-shared-prompt-wait"}
    return [{**r, "speedup": off[r["workload"]] / r["wall_s"]} for r in rows]


def main(argv: list[str] | None = None) -> int:
    import tempfile

    args = build_parser().parse_args(argv)
    if min(args.prompt_tokens, args.choices, args.new_tokens, args.answer_tokens, args.reps) < 1:
        raise SystemExit("--prompt-tokens, --choices, --new-tokens, --answer-tokens and --reps must be >= 1")
    with tempfile.TemporaryDirectory(prefix=f"{NAME}-") as workdir:
        rows = [row for name, flags in CONFIGS.items() for row in run_config(name, flags, args, Path(workdir))]
    rows = with_speedups(rows)
    machine = machine_info()
    table = markdown_table(rows, ["workload", "config", "wall_s", "first_ttft_s", "last_ttft_s", "reused_tokens",
                                  "speedup"])
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "name")}
    write_json(args.out, args.name, {"machine": machine, "settings": settings, "rows": rows})
    write_markdown(args.out, args.name, "Requests sharing a long prompt, sent at once",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{table}\n")
    chart(rows, args.out, args.name)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
