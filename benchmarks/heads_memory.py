"""What speculation heads add to a target worker's memory (issue: at most 10% more than without).

In one process: load the target engine as a worker does (weights and its KV pool), read
the resident memory, then load each set of heads with its drafter (an EAGLE head's own KV
pool, sized like the target's) and read it again. Two measures per set:

- held: bytes the worker holds for good, counted from the tensors (weights, buffers and
  KV pools, which are allocated whole at start): heads / target;
- RSS: the process's resident memory before and after loading the heads (VmRSS; the KV
  pools are zero pages until used, so RSS understates both sides alike).

Heads come from ``--heads`` (paths or prepared names); without any, heads of the default
shapes ``tandem heads prepare`` trains are built with random weights (the shapes decide the
memory, not the values). Writes heads_memory.{json,md,png} into --out.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/heads_memory.py` from anywhere
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

NAME = "heads_memory"
GOAL = 0.10  # heads may add at most this share of the target worker's memory
COLUMNS = ["heads", "kind", "target_mb", "heads_weights_mb", "heads_kv_mb", "held_ratio", "rss_before_mb",
           "rss_after_mb", "rss_ratio"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="heads_memory.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen-coder-1.5b", help="target model (default: %(default)s)")
    p.add_argument("--heads", action="append", default=None, metavar="PATH|NAME",
                   help="heads to measure (repeat); default: random heads of the default medusa and eagle shapes")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--kv-cache-tokens", type=int, default=16384, help="the worker's KV pool (default: %(default)s)")
    p.add_argument("--cache-dir", default=None, help="model cache root (default: $TANDEM_HOME or ~/.cache/tandem)")
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    return p


def rss_mb() -> float:
    for line in Path(f"/proc/{os.getpid()}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def tensor_mb(tensors: Any) -> float:
    seen, total = set(), 0
    for t in tensors:
        if id(t) not in seen:  # tied weights count once
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total / 2**20


def module_tensors(module: Any) -> list[Any]:
    """Parameters, buffers, and the packed copies that replace a packed layer's weight (tandem.models.packed)."""
    packed = [m.packed_weight for m in module.modules() if getattr(m, "packed_weight", None) is not None]
    return [*module.parameters(), *module.buffers(), *packed]


def default_heads(target: Any) -> list[tuple[str, Callable[[], Any]]]:
    """Random heads of the shapes `tandem heads prepare` trains by default (memory depends on shapes only)."""
    from tandem.heads.fingerprint import target_fingerprint
    from tandem.heads.store import build_heads
    from tandem.heads.train.options import TrainOptions, feature_streams
    from tandem.heads.train.pipeline import heads_config

    out = []
    for kind in ("medusa", "eagle"):
        options = TrainOptions(kind)
        cfg = heads_config(options, target.config, options.draft_vocab_for(target.config),
                           feature_streams(kind, target.config), target_fingerprint(target.model), "target")
        out.append((f"default {kind} (random)", lambda cfg=cfg: build_heads(cfg).to(target.dtype)))
    return out


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks.runners import engine_config, resolve_model_dir
    from tandem import model_store
    from tandem.engine import ModelEngine
    from tandem.heads.drafters import EagleDrafter
    from tandem.heads.locate import resolve_heads
    from tandem.heads.serving import drafter_for
    from tandem.heads.store import load_heads

    target = ModelEngine.load(engine_config(resolve_model_dir(args.target, args.cache_dir), args.dtype, "auto"))
    target.warmup()
    cache = target.kv_cache
    target_mb = tensor_mb([*module_tensors(target.model), cache.key, cache.value])
    root = model_store.cache_root_from(args.cache_dir, os.environ)
    loaders = [(spec, lambda spec=spec: load_heads(resolve_heads(spec, root), target.dtype, target.device,
                                                    target_num_layers=target.config.num_layers))
               for spec in args.heads] if args.heads else default_heads(target)
    rows = []
    for name, load in loaders:
        before = rss_mb()  # the heads are read from disk after this
        heads = load()
        drafter = drafter_for(heads, target, name)
        weights = tensor_mb(module_tensors(heads))
        kv = tensor_mb([drafter.cache.key, drafter.cache.value]) if isinstance(drafter, EagleDrafter) else 0.0
        after = rss_mb()
        rows.append({"heads": name, "kind": heads.config.kind, "target_mb": target_mb, "heads_weights_mb": weights,
                     "heads_kv_mb": kv, "held_ratio": (weights + kv) / target_mb, "rss_before_mb": before,
                     "rss_after_mb": after, "rss_ratio": after / before - 1})
        del drafter
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = measure(args)
    info = machine_info()
    verdicts = [f"  {'PASS' if r['held_ratio'] <= GOAL else 'FAIL'}  {r['heads']}: heads hold {r['held_ratio']:.1%} "
                f"of the target worker's memory (goal <= {GOAL:.0%})" for r in rows]
    write_json(args.out, NAME, {"settings": vars(args), "machine": info, "rows": rows, "verdicts": verdicts})
    body = f"{machine_line(info)}\n\n{markdown_table(rows, COLUMNS)}\n\n" + "\n".join(verdicts) + "\n"
    write_markdown(args.out, NAME, "Speculation heads: memory of a target worker with and without", body)
    fig, (ax,) = new_figure()
    grouped_bars(ax, [r["heads"] for r in rows], {"held (weights + KV)": [100 * r["held_ratio"] for r in rows],
                                                   "resident (RSS)": [100 * r["rss_ratio"] for r in rows]},
                 "% over the target worker alone")
    ax.axhline(100 * GOAL, color="gray", linestyle="--", linewidth=1)
    save_figure(fig, args.out, NAME)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
