"""Speculation under load: aggregate and per-stream tokens/s of each method at 1, 2, 4, 8... clients at once.

Speculation spends the compute a lone stream leaves idle; batching spends the same idle compute on other
streams. So the gain a method gives one stream shrinks as clients are added, and a serving system must stop
drafting where it no longer pays (vLLM's ``disable_by_batch_size``; Tandem's adaptive k plans each round with
the workers' fitted forward costs at the load it sees, ``tandem.spec.adaptive.LoadAwareCost``). This measures
where that happens on this machine, side by side in one run.

One cluster of real processes (a target worker, a draft worker and a coordinator on 127.0.0.1, as `tandem up`
starts them) serves every configuration. At each ``--concurrency`` level C, C clients each send
``--requests-per-client`` greedy chat requests one after another (a closed loop, as a benchmark client of a
server runs), from a fixed list of Spec-Bench and HumanEval prompts, the categories in turn (a level of C
clients takes the list's first C x ``--requests-per-client``, so one client reads only the first categories'
prompts); every method gets the same prompts at that level, and the methods take turns, their order reversed
each round. Before measuring, each prompt is read once (a one-token request), so every measured request finds
its prompt in the target's prefix cache whatever its method. The coordinator runs with
``--no-continuation-cache``: the same prompts come back for every method and round, and a cache of earlier
answers would propose them whole.

Reported per (concurrency, method): aggregate tokens/s over the wave, the same while every client was still
busy (``all_busy_rate``: the wave's tail, its slowest client alone, left out), each request's own tokens/s (tokens
after its first over the time after it: what one user sees), time to first token, mean tokens per target
round, the calls each worker's batch steps held (how often the streams were in step there), and whether each
greedy output equals the first method's (target-only where it runs). Medians over ``--rounds``. Writes
load_curve.json / .md / .png into ``--out`` (default benchmarks/results).
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
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/load_curve.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    ALL_CATEGORIES,
    DEFAULT_RESULTS_DIR,
    DEFAULT_SPEC_BENCH,
    histogram_totals,
    load_prompts,
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

NAME = "load_curve"
METHODS = ("none", "auto", "draft", "ngram", "hybrid")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="qwen-coder-1.5b", help="target: a catalog name or a model directory")
    parser.add_argument("--draft", default="qwen-coder-0.5b", help="draft model, or none (n-gram methods only)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "bfloat16", "float32"))
    parser.add_argument("--concurrency", type=lambda s: positive_ints(s, "--concurrency"), default=[1, 2, 4, 8],
                        help="comma-separated numbers of clients at once (default: 1,2,4,8)")
    parser.add_argument("--methods", type=lambda s: names_from(s, METHODS), default=["none", "auto"],
                        help=f"comma-separated, of {', '.join(METHODS)} (default: none,auto)")
    parser.add_argument("--requests-per-client", type=int, default=2,
                        help="requests each client sends one after another (default: 2)")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="per request (default: 96)")
    parser.add_argument("--rounds", type=int, default=2, help="times every configuration runs (default: 2)")
    parser.add_argument("--categories", default="humaneval,mt_bench,translation,summarization,qa,math_reasoning,rag",
                        help="prompt categories, taken in turn (default: HumanEval and the Spec-Bench mix)")
    parser.add_argument("--seed", type=int, default=0, help="which prompts of each category (default: 0)")
    parser.add_argument("--spec-bench", type=Path, default=DEFAULT_SPEC_BENCH)
    parser.add_argument("--kv-cache-tokens", type=int, default=None,
                        help="each worker's KV pool (default: room for every client's longest request)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    parser.add_argument("--name", default=NAME, help="file name of the results (without extension)")
    return parser


def check_args(args: argparse.Namespace) -> None:
    """Refuse what would measure nothing, naming the flag."""
    if args.requests_per_client < 1:
        raise SystemExit("--requests-per-client must be at least 1")
    if args.max_new_tokens < 2:
        raise SystemExit("--max-new-tokens must be at least 2 (a stream's own speed needs tokens after its first)")
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    categories = [c for c in args.categories.split(",") if c]
    unknown = sorted(set(categories) - set(ALL_CATEGORIES))
    if not categories or unknown:
        raise SystemExit(f"--categories: unknown {unknown or 'none given'}; known: {', '.join(ALL_CATEGORIES)}")
    if args.draft == "none" and any(m in ("auto", "draft", "hybrid") for m in args.methods):
        raise SystemExit("--draft none: methods auto, draft and hybrid need a draft model; use --methods none,ngram")
    args.categories = categories


def prompts_for(args: argparse.Namespace) -> list[str]:
    """As many prompts as the largest level sends, the categories taken in turn."""
    needed = max(args.concurrency) * args.requests_per_client
    per_category = -(-needed // len(args.categories))
    by_category = {c: [] for c in args.categories}
    for prompt in load_prompts(args.categories, per_category, args.seed, args.spec_bench):
        by_category[prompt.category].append(prompt.text)
    interleaved = [texts[i] for i in range(per_category) for texts in by_category.values() if i < len(texts)]
    if len(interleaved) < needed:
        raise SystemExit(f"only {len(interleaved)} prompts in {args.categories}; {needed} needed")
    return interleaved[:needed]


def one_request(client: Any, prompt: str, method: str, max_new_tokens: int) -> dict[str, Any]:
    from tandem.client import build_request

    request = build_request(prompt, chat=True, max_new_tokens=max_new_tokens, method=method)
    started, first, tokens, stats = time.monotonic(), None, [], None
    arrivals: list[tuple[float, int]] = []  # (when, how many tokens) per streamed chunk
    for chunk in client.stream(request):
        now = time.monotonic()
        if chunk.token_ids and first is None:
            first = now
        if chunk.token_ids:
            arrivals.append((now, len(chunk.token_ids)))
        tokens.extend(chunk.token_ids)
        if chunk.HasField("stats"):
            stats = chunk.stats
    ended = time.monotonic()
    first = ended if first is None else first
    return {"tokens": tokens, "ttft s": first - started, "ended": ended, "arrivals": arrivals,
            "own tokens/s": (len(tokens) - 1) / (ended - first) if len(tokens) > 1 and ended > first else None,
            "rounds": stats.rounds if stats is not None else 0}


def all_busy_rate(started: float, per_client: list[list[dict[str, Any]]]) -> float | None:
    """Tokens/s over the time every client still had a request running: from the wave's start until the first client
    had the answer to its last request. A closed loop's aggregate (tokens over the whole wave) ends with its slowest
    client alone, so it moves with how a method's fast and slow requests fell between the clients: measured at 2
    clients x 4 requests, `auto`'s and `ngram`'s request times summed within 3% while their aggregates differed by
    10%."""
    ends = [results[-1]["ended"] for results in per_client if results]
    if not ends or min(ends) <= started:
        return None
    until = min(ends)
    tokens = sum(count for results in per_client for r in results for when, count in r["arrivals"] if when <= until)
    return tokens / (until - started)


def run_level(client: Any, prompts: list[str], clients: int, method: str, max_new_tokens: int) -> dict[str, Any]:
    """``clients`` closed loops over ``prompts`` (client i sends prompts i, i + clients, ...)."""
    def loop(index: int) -> list[dict[str, Any]]:
        return [one_request(client, prompts[j], method, max_new_tokens) for j in range(index, len(prompts), clients)]

    started = time.monotonic()
    with ThreadPoolExecutor(clients) as pool:
        per_client = list(pool.map(loop, range(clients)))
    seconds = time.monotonic() - started
    by_prompt: dict[int, dict[str, Any]] = {}
    for index, results in enumerate(per_client):
        for offset, result in enumerate(results):
            by_prompt[index + offset * clients] = result
    results = [by_prompt[j] for j in range(len(prompts))]
    tokens = sum(len(r["tokens"]) for r in results)
    own = [r["own tokens/s"] for r in results if r["own tokens/s"] is not None]
    rounds = sum(r["rounds"] for r in results)
    return {"seconds": seconds, "tokens/s": tokens / seconds, "all-busy tokens/s": all_busy_rate(started, per_client),
            "own tokens/s p50": statistics.median(own) if own else None,
            "ttft p50 s": statistics.median(r["ttft s"] for r in results),
            "tokens per round": tokens / rounds if rounds else None,
            "outputs": [r["tokens"] for r in results]}


# The workers' histograms of calls per batch step: how often the streams share a step at each worker.
BATCH_SIZES = ("tandem_target_batch_size", "tandem_draft_batch_size")


def calls_per_step(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """Mean calls per batch step of the target and the draft worker between two scrapes (None: no step ran). Where
    streams fall out of step their calls share fewer steps: with 2 clients, the draft worker's steps held 1.08
    calls (a draft beside its target on one CPU then takes the device once per stream, ``LoadAwareCost``)."""
    def mean(role: str) -> float | None:
        name = f"tandem_{role}_batch_size"
        steps = after.get(f"{name}_count", 0.0) - before.get(f"{name}_count", 0.0)
        return (after.get(f"{name}_sum", 0.0) - before.get(f"{name}_sum", 0.0)) / steps if steps > 0 else None

    return {"target calls per step": mean("target"), "draft calls per step": mean("draft")}


def measure(args: argparse.Namespace, prompts: list[str]) -> list[dict[tuple[int, str], dict[str, Any]]]:
    from tandem.client import TandemClient, build_request
    from tandem.cluster import ClusterSpec, LocalCluster

    target_dir = resolve_model_dir(args.target, args.cache_dir)
    draft_dir = None if args.draft == "none" else resolve_model_dir(args.draft, args.cache_dir)
    kv_tokens = args.kv_cache_tokens or max(16384, max(args.concurrency) * 2048)
    spec = ClusterSpec(target=str(target_dir), draft=str(draft_dir) if draft_dir else None,
                       draft_replicas=1 if draft_dir else 0, dtype=args.dtype, kv_cache_tokens=kv_tokens,
                       coordinator_args=("--call-timeout", "600", "--no-continuation-cache"))
    rounds: list[dict[tuple[int, str], dict[str, Any]]] = []
    with LocalCluster(spec) as cluster, TandemClient(cluster.coordinator.address, timeout_s=1800) as client:
        print(f"reading {len(prompts)} prompts once (each measured request then finds its prompt cached)", flush=True)
        for prompt in prompts:
            client.generate(build_request(prompt, chat=True, max_new_tokens=1, method="none"))
        for round_index in range(args.rounds):
            measured: dict[tuple[int, str], dict[str, Any]] = {}
            methods = args.methods if round_index % 2 == 0 else list(reversed(args.methods))
            for clients in args.concurrency:
                level_prompts = prompts[: clients * args.requests_per_client]
                for method in methods:
                    before = histogram_totals(cluster.services, BATCH_SIZES)
                    result = run_level(client, level_prompts, clients, method, args.max_new_tokens)
                    result.update(calls_per_step(before, histogram_totals(cluster.services, BATCH_SIZES)))
                    measured[(clients, method)] = result
                    print(f"round {round_index + 1}/{args.rounds}: {clients} clients, {method}: "
                          f"{result['tokens/s']:.1f} tokens/s over {result['seconds']:.1f} s", flush=True)
            rounds.append(measured)
    return rounds


def summarise(args: argparse.Namespace, rounds: list[dict[tuple[int, str], dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per (concurrency, method): medians over rounds, the speedup over the first method's aggregate,
    and how many outputs equal the first method's (every round's)."""
    reference = args.methods[0]
    rows = []
    for clients in args.concurrency:
        for method in args.methods:
            runs = [r[(clients, method)] for r in rounds]
            base = [r[(clients, reference)] for r in rounds]

            def median(key: str, of: list[dict[str, Any]] = runs) -> float | None:
                values = [run[key] for run in of if run[key] is not None]
                return statistics.median(values) if values else None

            busy = "all-busy tokens/s"
            same = sum(a == b for run, ref in zip(runs, base, strict=True)
                       for a, b in zip(run["outputs"], ref["outputs"], strict=True))
            rows.append({"clients": clients, "method": method, "tokens/s": median("tokens/s"),
                         "runs tokens/s": [round(run["tokens/s"], 2) for run in runs],
                         f"x {reference}": median("tokens/s") / median("tokens/s", base),
                         "all-busy tokens/s": median(busy),
                         f"all-busy x {reference}": _ratio(median(busy), median(busy, base)),
                         "own tokens/s p50": median("own tokens/s p50"), "ttft p50 s": median("ttft p50 s"),
                         "tokens per round": median("tokens per round"),
                         "target calls per step": median("target calls per step"),
                         "draft calls per step": median("draft calls per step"),
                         f"same as {reference}": f"{same}/{sum(len(run['outputs']) for run in runs)}"})
    return rows


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def chart(args: argparse.Namespace, rows: list[dict[str, Any]]) -> None:
    fig, (ax_total, ax_ratio) = new_figure(ncols=2, width=5.5)
    reference = args.methods[0]
    for index, method in enumerate(args.methods):
        mine = [r for r in rows if r["method"] == method]
        colour = f"C{index}"  # a method's colour in both panels
        ax_total.plot([r["clients"] for r in mine], [r["tokens/s"] for r in mine], marker="o", color=colour,
                      label=method)
        if method != reference:
            ax_ratio.plot([r["clients"] for r in mine], [r[f"x {reference}"] for r in mine], marker="o",
                          color=colour, label=method)
            busy = [(r["clients"], r[f"all-busy x {reference}"]) for r in mine if r[f"all-busy x {reference}"]]
            ax_ratio.plot([c for c, _ in busy], [x for _, x in busy], marker="s", linestyle="--", color=colour,
                          label=f"{method}, all clients busy")
    ax_total.set(xscale="log", xlabel="clients at once", ylabel="aggregate tokens/s", title="Throughput")
    ax_ratio.axhline(1.0, color="grey", linewidth=1)
    ax_ratio.set(xscale="log", xlabel="clients at once", ylabel=f"x {reference}", title=f"Speedup over {reference}")
    for ax in (ax_total, ax_ratio):
        ax.minorticks_off()
        ax.set_xticks(args.concurrency, [str(c) for c in args.concurrency])
        ax.legend()
    save_figure(fig, args.out, args.name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    prompts = prompts_for(args)
    info = machine_info()
    rounds = measure(args, prompts)
    rows = summarise(args, rounds)
    settings = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()
                if key not in ("out", "cache_dir", "spec_bench")}
    write_json(args.out, args.name, {"machine": info, "settings": settings, "rows": rows})
    reference = args.methods[0]
    columns = ["clients", "method", "tokens/s", "runs tokens/s", f"x {reference}", "all-busy tokens/s",
               f"all-busy x {reference}", "own tokens/s p50", "ttft p50 s", "tokens per round", "target calls per step",
               "draft calls per step", f"same as {reference}"]
    table = markdown_table(rows, columns)
    write_markdown(args.out, args.name, "Speculation under load: each method at each number of clients at once",
                   f"{machine_line(info)}\n\nSettings: `{settings}`\n\n{table}\n")
    chart(args, rows)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
