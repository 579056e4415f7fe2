"""The distributed system against the in-process algorithm, and under concurrency.

One run, same prompts, greedy, bf16, the Qwen pair by default:

  in-process        LocalPipeline (draft method, adaptive k), batch 1
  services          `tandem up`-style local processes (LocalCluster), batch 1,
                    pipelined and not
  services x N      N concurrent streams (--concurrency, default 8), draft method and
                    target-only (method none), aggregate tokens/s

Reported: tokens/s of each, the ratio services / in-process at batch 1, the
aggregate speedup of N streams over one stream, and the coordinator's
overhead per round (round wall time not spent waiting for a worker, from its
Prometheus histogram). Done when (issue 4): ratio >= 0.9, N-stream aggregate
>= 2x one stream, and speculative aggregate >= target-only aggregate at N.

Writes distributed_bench.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    DEFAULT_SPEC_BENCH,
    fmt,
    grouped_bars,
    histogram_totals,
    load_prompts,
    markdown_table,
    new_figure,
    save_figure,
    threshold_line,
    write_json,
    write_markdown,
)
from benchmarks.runners import engine_config, resolve_model_dir, run_ours  # noqa: E402
from tandem.cli.draft_flags import add_draft_flags, draft_engine_options, draft_worker_args  # noqa: E402
from tandem.client import TandemClient, build_request  # noqa: E402
from tandem.cluster import ClusterSpec, LocalCluster  # noqa: E402
from tandem.pipeline import LocalPipeline  # noqa: E402
from tandem.spec.options import SpecOptions  # noqa: E402
from tandem.tokenizer import encode_prompt  # noqa: E402

CATEGORIES = ("humaneval", "mt_bench", "qa", "summarization")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen-coder-1.5b")
    p.add_argument("--draft", default="qwen-coder-0.5b")
    add_draft_flags(p)
    p.add_argument("--gather-fraction", type=float, default=None,
                   help="workers' batch gathering wait, in forward passes (default: the workers' own)")
    p.add_argument("--per-category", type=int, default=2, help="prompts per category (default: 2 -> 8 prompts)")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quick", action="store_true", help="1 prompt per category, 32 tokens, concurrency 4")
    p.add_argument("--spec-bench", type=Path, default=DEFAULT_SPEC_BENCH)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    if args.quick:
        args.per_category, args.max_new_tokens, args.concurrency = 1, 32, 4
    return args


def in_process(args: argparse.Namespace, prompts: list[list[int]]) -> dict:
    """Batch-1 tokens/s of the in-process speculative pipeline (the number the services must keep)."""
    target_dir, draft_dir = resolve_model_dir(args.target), resolve_model_dir(args.draft)
    pipeline = LocalPipeline.load(engine_config(target_dir, args.dtype), "draft", SpecOptions("draft", args.k),
                                  engine_config(draft_dir, args.dtype, draft_options=draft_engine_options(args)))
    generator = pipeline.generator()
    run_ours(generator, prompts[0], 8, pipeline.stop_ids)  # warm-up, untimed
    outputs = [run_ours(generator, ids, args.max_new_tokens, pipeline.stop_ids) for ids in prompts]
    tokens = sum(len(o.token_ids) for o in outputs)
    seconds = sum(o.seconds for o in outputs)
    result = {"mode": "in-process", "streams": 1, "tokens": tokens, "seconds": seconds,
              "rounds": sum(o.stats.rounds for o in outputs),
              "tokens_per_s": tokens / seconds, "token_ids": [o.token_ids for o in outputs]}
    del pipeline, generator
    gc.collect()
    return result


# The histograms the overheads are computed from, summed over every process of the cluster.
SCRAPED = ("tandem_coordinator_round_overhead_seconds", "tandem_target_batch_seconds", "tandem_draft_batch_seconds",
           "tandem_target_batch_size", "tandem_target_batch_tokens", "tandem_draft_batch_size",
           "tandem_coordinator_chosen_k")


def overheads(before: dict[str, float], after: dict[str, float], record: dict) -> dict[str, float]:
    """Per round, in ms: inside the coordinator, and end to end outside any model forward; and how
    the workers were used: mean calls and tokens per batch, share of the wall time busy, mean k."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}

    def mean(name: str) -> float:
        return delta.get(f"{name}_sum", 0.0) / max(1.0, delta.get(f"{name}_count", 0.0))

    rounds = max(1.0, record["rounds"])
    target_s = delta.get("tandem_target_batch_seconds_sum", 0.0)
    draft_s = delta.get("tandem_draft_batch_seconds_sum", 0.0)
    return {"coordinator_ms_per_round": 1000 * mean("tandem_coordinator_round_overhead_seconds"),
            "non_forward_ms_per_round": 1000 * (record["seconds"] - target_s - draft_s) / rounds,
            "target_batch_calls": mean("tandem_target_batch_size"),
            "target_batch_tokens": mean("tandem_target_batch_tokens"),
            "draft_batch_calls": mean("tandem_draft_batch_size"),
            "target_busy": target_s / record["wall_s"], "draft_busy": draft_s / record["wall_s"],
            "mean_k": mean("tandem_coordinator_chosen_k")}


def through_services(cluster: LocalCluster, client: TandemClient, prompts: list[list[int]], args: argparse.Namespace,
                     method: str, streams: int, pipelining: bool = True) -> dict:
    def one(ids: list[int]):
        t0 = time.perf_counter()
        reply = client.generate(build_request(ids, max_new_tokens=args.max_new_tokens, method=method, k=args.k,
                                              pipelining=pipelining))
        return reply, time.perf_counter() - t0

    start = time.perf_counter()
    before = histogram_totals(cluster.services, SCRAPED)
    if streams == 1:
        results = [one(ids) for ids in prompts]
        seconds = sum(s for _, s in results)
    else:
        jobs = [prompts[i % len(prompts)] for i in range(streams * 2)]  # two requests per stream
        with ThreadPoolExecutor(streams) as pool:
            results = list(pool.map(one, jobs))
        seconds = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r, _ in results)
    rounds = sum(r.stats.rounds for r, _ in results)
    drafted = sum(r.stats.drafted for r, _ in results)
    accepted = sum(r.stats.accepted for r, _ in results)
    record = {"mode": f"services {method}{'' if pipelining else ' unpipelined'}", "streams": streams,
              "tokens": tokens, "seconds": seconds, "wall_s": time.perf_counter() - start,
              "tokens_per_s": tokens / seconds, "rounds": rounds,
              "acceptance_rate": accepted / drafted if drafted else None,
              "token_ids": [list(r.token_ids) for r, _ in results] if streams == 1 else None,
              "pipelined": pipelining}
    record.update(overheads(before, histogram_totals(cluster.services, SCRAPED), record))
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    selected = load_prompts(CATEGORIES, args.per_category, 0, args.spec_bench)
    from tandem.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model_dir(args.target))
    prompts = [encode_prompt(tokenizer, p.text, chat=True) for p in selected]
    print(f"{len(prompts)} prompts x {args.max_new_tokens} tokens; in-process first", file=sys.stderr)
    records = [in_process(args, prompts)]
    # The coordinator allows pipelining; each request says whether it wants it (off is the local default).
    spec = ClusterSpec(target=args.target, draft=args.draft, dtype=args.dtype, pipelining=True,
                       draft_args=tuple(draft_worker_args(args)),
                       worker_args=() if args.gather_fraction is None
                       else ("--gather-fraction", str(args.gather_fraction)))
    with LocalCluster(spec) as cluster, TandemClient(cluster.coordinator.address, timeout_s=1800) as client:
        through_services(cluster, client, prompts[:1], args, "draft", 1)  # warm-up
        for method, pipelining in (("draft", False), ("draft", True), ("none", False)):
            records.append(through_services(cluster, client, prompts, args, method, 1, pipelining=pipelining))
        for method in ("draft", "none"):
            records.append(through_services(cluster, client, prompts, args, method, args.concurrency, pipelining=False))
    base = records[0]
    same = sum(a == b for a, b in zip(base["token_ids"], records[1]["token_ids"]))
    single = records[1]["tokens_per_s"]
    spec_n, none_n = records[4]["tokens_per_s"], records[5]["tokens_per_s"]
    summary = {
        "services_over_in_process": single / base["tokens_per_s"],
        "aggregate_over_single_stream": spec_n / single,
        "spec_over_target_only_at_concurrency": spec_n / none_n,
        "coordinator_overhead_ms_per_round": records[1]["coordinator_ms_per_round"],
        "non_forward_ms_per_round_unpipelined": records[1]["non_forward_ms_per_round"],
        "identical_outputs_in_process_vs_services": f"{same}/{len(prompts)}",
    }
    for r in records:
        r.pop("token_ids", None)
    columns = ["mode", "streams", "tokens", "seconds", "tokens_per_s", "acceptance_rate", "rounds", "mean_k",
               "target_batch_calls", "target_batch_tokens", "draft_batch_calls", "target_busy", "draft_busy",
               "coordinator_ms_per_round", "non_forward_ms_per_round"]
    table = markdown_table([{c: fmt(r.get(c)) for c in columns} for r in records], columns)
    lines = [
        threshold_line("services / in-process tokens/s at batch 1", summary["services_over_in_process"], ">=", 0.9),
        threshold_line(f"{args.concurrency}-stream aggregate / one stream",
                       summary["aggregate_over_single_stream"], ">=", 2.0),
        threshold_line(f"speculative / target-only aggregate at {args.concurrency} streams",
                       summary["spec_over_target_only_at_concurrency"], ">=", 1.0),
        f"  info  coordinator overhead per round (inside the coordinator): "
        f"{summary['coordinator_overhead_ms_per_round']:.2f} ms",
        f"  info  time per round outside any model forward (unpipelined, gRPC + queueing + coordinator): "
        f"{summary['non_forward_ms_per_round_unpipelined']:.2f} ms",
        f"  info  identical greedy outputs, in-process vs services: "
        f"{summary['identical_outputs_in_process_vs_services']}",
    ]
    print(table)
    print("\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out, "distributed_bench", {"args": {k: str(v) for k, v in vars(args).items()},
                                               "records": records, "summary": summary})
    write_markdown(args.out, "distributed_bench", "Distributed system benchmark", table + "\n\n" + "\n".join(lines))
    fig, axes = new_figure()
    grouped_bars(axes[0], [r["mode"] + f" x{r['streams']}" for r in records],
                 {"tokens/s": [r["tokens_per_s"] for r in records]}, "tokens/s")
    save_figure(fig, args.out, "distributed_bench")
    return 0


if __name__ == "__main__":
    sys.exit(main())
