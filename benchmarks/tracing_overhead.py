"""What tracing costs a request: the same requests with --otlp-traces-endpoint and without, paired.

Two systems of real processes run side by side (tandem.cluster.LocalCluster, as `tandem up`
starts them: a coordinator, a target worker and a draft worker each), the same model and
settings, one of them with every process exporting its spans over OTLP/gRPC to a real
receiver in this process (tests/otlp_collector.py: what an OpenTelemetry Collector's otlp
receiver speaks). Each Spec-Bench prompt goes to one system and then the other, the order
alternating from prompt to prompt, one request at a time, so that drift on the machine falls
on both alike; the systems are otherwise idle. Greedy, method auto (draft model and lookups):
every round makes a Propose and a Verify call, each of them a span when traced. The default
model is the smallest (SmolLM2-135M, its own draft): the cheaper a forward pass, the more a
fixed cost per call weighs, so this is tracing's worst case among the models here.

Reported: per system the median wall seconds of a request and its tokens per second; over the
pairs, the median and quartiles of traced / untraced wall time (the overhead is that minus one),
and the spans the collector received per request (the request's own and its worker calls').

Writes tracing_overhead.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/tracing_overhead.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    DEFAULT_RESULTS_DIR,
    DEFAULT_SPEC_BENCH,
    SPEC_BENCH_CATEGORIES,
    load_prompts,
    machine_info,
    machine_line,
    markdown_table,
    new_figure,
    percentile,
    save_figure,
    write_json,
    write_markdown,
)

NAME = "tracing_overhead"
SYSTEMS = ("untraced", "traced")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # (the smallest model: its forward passes are the cheapest, so a fixed cost per call weighs most on it)
    p.add_argument("--target", default="smollm2", help="a catalog name or a model directory")
    p.add_argument("--draft", default="smollm2", help="the draft model (the target's own: rounds accept most "
                                                       "drafts, as a good draft would)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32")
    p.add_argument("--per-category", type=int, default=3, help="Spec-Bench prompts per category (6 categories)")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    p.add_argument("--name", default=NAME, help="file name of the results (without extension)")
    return p


def one_request(client: Any, text: str, max_new_tokens: int) -> tuple[float, int]:
    from tandem.client import build_request

    request = build_request([{"role": "user", "content": text}], max_new_tokens=max_new_tokens, method="auto",
                            chat=True)
    started = time.perf_counter()
    reply = client.generate(request)
    return time.perf_counter() - started, len(reply.token_ids)


def measure(args: argparse.Namespace, workdir: Path) -> tuple[list[dict[str, Any]], int]:
    """Each prompt on both systems, alternating which goes first; (one row per request, spans received)."""
    from tandem.client import TandemClient, build_request
    from tandem.cluster import ClusterSpec, LocalCluster
    from tests.otlp_collector import OtlpCollector

    prompts = load_prompts(SPEC_BENCH_CATEGORIES, args.per_category, seed=None,
                           spec_bench_path=DEFAULT_SPEC_BENCH)
    rows: list[dict[str, Any]] = []
    with OtlpCollector() as collector:
        tracing = ("--otlp-traces-endpoint", collector.endpoint)
        specs = {system: ClusterSpec(target=args.target, draft=args.draft, dtype=args.dtype,
                                     log_dir=workdir / system,
                                     worker_args=tracing if system == "traced" else (),
                                     coordinator_args=tracing if system == "traced" else ())
                 for system in SYSTEMS}
        print(f"[{NAME}] starting two systems of {args.target} + {args.draft}", file=sys.stderr, flush=True)
        with LocalCluster(specs["untraced"]) as untraced, LocalCluster(specs["traced"]) as traced, \
                TandemClient(untraced.coordinator.address, timeout_s=600) as plain, \
                TandemClient(traced.coordinator.address, timeout_s=600) as observed:
            clients = {"untraced": plain, "traced": observed}
            for client in clients.values():  # a first call each, uncounted
                client.generate(build_request([11, 12, 13], max_new_tokens=4))
            for i, prompt in enumerate(prompts):
                order = SYSTEMS if i % 2 == 0 else SYSTEMS[::-1]
                print(f"[{NAME}] {i + 1}/{len(prompts)} {prompt.category}", file=sys.stderr, flush=True)
                for system in order:
                    wall_s, tokens = one_request(clients[system], prompt.text, args.max_new_tokens)
                    rows.append({"system": system, "prompt": prompt.prompt_id, "category": prompt.category,
                                 "wall_s": wall_s, "tokens": tokens, "first": system == order[0]})
        # (stopped: each process sent what it still held as it stopped)
        with collector.lock:
            return rows, len(collector.spans)


def summarize(rows: list[dict[str, Any]], spans: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    table = []
    for system in SYSTEMS:
        mine = [r for r in rows if r["system"] == system]
        table.append({"system": system, "requests": len(mine),
                      "median_wall_s": statistics.median(r["wall_s"] for r in mine),
                      "tokens_per_s": sum(r["tokens"] for r in mine) / sum(r["wall_s"] for r in mine)})
    by_prompt: dict[str, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_prompt.setdefault(r["prompt"], {})[r["system"]] = r
    # (a pair is compared only where both wrote the same tokens: greedy, they do; a difference would say so)
    same = [p for p in by_prompt.values() if p["traced"]["tokens"] == p["untraced"]["tokens"]]
    ratios = [p["traced"]["wall_s"] / p["untraced"]["wall_s"] for p in same]
    traced_requests = sum(1 for r in rows if r["system"] == "traced") + 1  # (the first call, uncounted, too)
    pairs = {"pairs": len(by_prompt), "pairs_same_tokens": len(same),
             "ratio_median": statistics.median(ratios), "ratio_p25": percentile(ratios, 25),
             "ratio_p75": percentile(ratios, 75), "spans": spans, "spans_per_request": spans / traced_requests}
    return table, pairs


def chart(rows: list[dict[str, Any]], pairs: dict[str, Any], out: Path, name: str) -> Path:
    fig, axes = new_figure(ncols=2, width=5.5)
    walls = {system: [r["wall_s"] for r in rows if r["system"] == system] for system in SYSTEMS}
    axes[0].boxplot([walls[s] for s in SYSTEMS], tick_labels=list(SYSTEMS))
    axes[0].set_ylabel("wall seconds per request")
    axes[0].set_title("each request, both systems")
    by_prompt: dict[str, dict[str, float]] = {}
    for r in rows:
        by_prompt.setdefault(r["prompt"], {})[r["system"]] = r["wall_s"]
    ratios = [p["traced"] / p["untraced"] for p in by_prompt.values()]
    axes[1].hist(ratios, bins=12)
    axes[1].axvline(1.0, color="black", linewidth=1)
    axes[1].set_xlabel("traced / untraced wall time, same prompt")
    axes[1].set_title(f"median {pairs['ratio_median']:.3f} over {pairs['pairs']} pairs")
    return save_figure(fig, out, name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.per_category < 1 or args.max_new_tokens < 1:
        raise SystemExit("--per-category and --max-new-tokens must be >= 1")
    with tempfile.TemporaryDirectory(prefix=f"{NAME}-") as workdir:
        rows, spans = measure(args, Path(workdir))
    table, pairs = summarize(rows, spans)
    machine = machine_info()
    settings = {key: value for key, value in vars(args).items() if key not in ("out", "name")}
    text = markdown_table(table, ["system", "requests", "median_wall_s", "tokens_per_s"])
    text += "\n" + markdown_table([pairs], list(pairs))
    write_json(args.out, args.name, {"machine": machine, "settings": settings, "systems": table, "pairs": pairs,
                                     "rows": rows})
    write_markdown(args.out, args.name, "What tracing costs a request: traced and untraced systems, paired",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{text}\n")
    chart(rows, pairs, args.out, args.name)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
