"""Peak host memory while a tensor-parallel target loads, per rank, at TP=1 and TP=2 (issue 13).

For each model and size, a fresh process loads the model as rank 0 of N (starting ranks
1..N-1 as the worker does), waits until every rank has loaded its shard, and reads each
rank's peak RSS (``VmHWM`` in /proc). Each rank is compared with what it must hold: its
shard of the weights (its slices plus the whole embedding) and its KV pool (allocated
zeroed, so not resident until used: the bound is generous there). The goal: peak RSS at
most 1.3x shard + KV. "Over import" subtracts the RSS of a process that has imported
torch and Tandem and loaded nothing, which dominates for small models.

Writes tp_memory.json / .md into --out (default benchmarks/results). Linux only (/proc).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/tp_memory.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

import torch  # noqa: E402

from benchmarks.common import markdown_table, write_json, write_markdown  # noqa: E402
from benchmarks.runners import resolve_model_dir  # noqa: E402
from benchmarks.tp_common import add_flags, in_fresh_process, parse_sizes, split_refusal  # noqa: E402
from tandem.config import EngineConfig, ModelConfig  # noqa: E402
from tandem.models.tensor_parallel import ParallelModel, Shard, local_kv_heads, parallelize  # noqa: E402
from tandem.models.transformer import CausalLM  # noqa: E402
from tandem.parallel.engine import load_engine  # noqa: E402

NAME = "tp_memory"
GOAL = 1.3
COLUMNS = ["model", "ranks", "rank", "dtype", "load_s", "shard_mb", "kv_pool_mb", "peak_rss_mb",
           "import_rss_mb", "peak_over_shard_kv", "over_import_over_shard_kv"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tp_memory.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_flags(p, models="qwen-coder-0.5b,qwen-coder-1.5b", sizes="1,2")
    p.add_argument("--kv-cache-tokens", type=int, default=16384,
                   help="KV pool per rank, in tokens (default: %(default)s)")
    return p


def status_mb(pid: int, field: str) -> float:
    """``field`` (VmRSS, VmHWM) of process ``pid`` from /proc, in MiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def shard_and_kv_mb(model_dir: Path, shard: Shard, dtype: torch.dtype, kv_tokens: int) -> tuple[float, float]:
    """What rank ``shard`` must hold: its weights and its KV pool, in MiB (computed on the meta device)."""
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = parallelize(CausalLM(cfg), ParallelModel(shard, None))
    tied_view = cfg.tie_word_embeddings and not shard.is_whole  # lm_head is a view of the embedding's rows
    weights = sum(p.numel() for name, p in model.named_parameters() if not (tied_view and name == "lm_head.weight"))
    kv = 2 * cfg.num_layers * kv_tokens * local_kv_heads(model) * cfg.head_dim
    size = torch.finfo(dtype).bits // 8
    return weights * size / 2**20, kv * size / 2**20


def measure_load(model_dir: Path, ranks: int, dtype: str, kv_tokens: int) -> dict[str, Any]:
    """In a fresh process: load as rank 0 of ``ranks``, then every rank's peak RSS."""
    import_rss = status_mb(os.getpid(), "VmRSS")
    started = time.perf_counter()
    engine = load_engine(EngineConfig(model_dir, dtype=dtype, kv_cache_tokens=kv_tokens, tensor_parallel_size=ranks))
    load_s = time.perf_counter() - started
    pids = [os.getpid(), *(child.pid for child in getattr(engine, "ranks", None).children)] if ranks > 1 \
        else [os.getpid()]
    peaks = [status_mb(pid, "VmHWM") for pid in pids]  # every rank has loaded: rank 0 waited for them
    engine.close()
    return {"load_s": load_s, "import_rss_mb": import_rss, "peaks": peaks}


def rows_for(name: str, ranks: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    model_dir = resolve_model_dir(name, args.cache_dir)
    label = Path(name).name
    refused = split_refusal(model_dir, ranks)
    if refused:
        return [{"model": label, "ranks": ranks, "refused": refused}]
    measured = in_fresh_process(measure_load, model_dir, ranks, args.dtype, args.kv_cache_tokens)
    if "error" in measured:
        return [{"model": label, "ranks": ranks, "error": measured["error"]}]
    rows = []
    for rank, peak in enumerate(measured["peaks"]):
        shard_mb, kv_mb = shard_and_kv_mb(model_dir, Shard(rank, ranks), getattr(torch, args.dtype),
                                          args.kv_cache_tokens)
        rows.append({
            "model": label, "ranks": ranks, "rank": rank, "dtype": args.dtype, "load_s": measured["load_s"],
            "shard_mb": shard_mb, "kv_pool_mb": kv_mb, "peak_rss_mb": peak, "import_rss_mb": measured["import_rss_mb"],
            "peak_over_shard_kv": peak / (shard_mb + kv_mb),
            "over_import_over_shard_kv": (peak - measured["import_rss_mb"]) / (shard_mb + kv_mb),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows: list[dict[str, Any]] = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        for ranks in parse_sizes(args.tp):
            rows.extend(rows_for(name, ranks, args))
            print(rows[-1], file=sys.stderr)
    settings = {"models": args.models, "tp": args.tp, "dtype": args.dtype, "kv_cache_tokens": args.kv_cache_tokens,
                "cpus": os.cpu_count()}
    measured = [r for r in rows if "peak_rss_mb" in r]
    skipped = "\n".join(f"- {r['model']} x{r['ranks']}: {r.get('refused') or r.get('error')}"
                        for r in rows if "peak_rss_mb" not in r)
    table = markdown_table(measured, COLUMNS)
    write_json(args.out, NAME, {"settings": settings, "records": rows, "goal_peak_over_shard_kv": GOAL})
    write_markdown(args.out, NAME, "Peak host memory while loading, per tensor-parallel rank",
                   f"Settings: `{settings}`\n\nGoal: peak RSS <= {GOAL}x (shard + KV pool) per rank.\n\n{table}\n"
                   + (f"\nNot measured:\n\n{skipped}\n" if skipped else ""))
    print(table)
    print(f"wrote {args.out / (NAME + '.json')}, {args.out / (NAME + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
