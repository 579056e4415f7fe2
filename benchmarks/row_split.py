"""What splitting large packed calls costs where oneDNN's kernels round rows by the call's row count, and what it fixes.

On a CPU with AMX, oneDNN's bf16 calls of more than 32 rows take another kernel than calls of up to 32, which
rounds some rows otherwise; ``tandem.models.row_invariance`` probes each packed shape at load and splits larger
calls into calls of the largest count found invariant. Two rules, side by side in one run, on one loaded model:

- ``one call``: every call computes all its rows at once (the rule before the split);
- ``split``: this checkout's rule, calls above the probed limit (or ``--limit``) in calls of that many.

Part 1, per packed layer shape (the head included) and row count: the median ms of a call under each rule, and
how many of its rows differ bitwise from the same rows computed two at a time (one row alone runs yet another
kernel). Part 2: a whole prefill of each ``--lengths`` prompt through the engine under each rule (medians of
``--reps``, taken in turns), and whether its last token's logits equal the ones that token gets when decoded
after the rest of the prompt: the promise the split keeps. Also the probe's own seconds at load.

Writes row_split.json / .md / .png into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/row_split.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    DEFAULT_RESULTS_DIR,
    interleaved_medians,
    machine_info,
    machine_line,
    markdown_table,
    new_figure,
    positive_ints,
    save_figure,
    write_json,
    write_markdown,
)
from benchmarks.runners import engine_config, probe_tokens, resolve_model_dir  # noqa: E402

NAME = "row_split"
RULES = ("one call", "split")


def packed_layers(model: Any) -> list[Any]:
    """Every packed ``RowStableLinear`` of ``model``."""
    from tandem.models.layers import RowStableLinear

    return [m for m in model.modules() if isinstance(m, RowStableLinear) and m.packed_weight is not None]


def one_per_shape(layers: list[Any]) -> list[Any]:
    chosen: dict[tuple[int, int, bool], Any] = {}
    for layer in layers:
        chosen.setdefault((layer.out_features, layer.in_features, layer.bias is not None), layer)
    return list(chosen.values())


@contextmanager
def rule(layers: list[Any], name: str, limits: dict[int, int]) -> Iterator[None]:
    """Inside the block, every layer computes its calls by the rule ``name``."""
    for layer in layers:
        layer.max_call_rows = None if name == "one call" else limits[id(layer)]
    try:
        yield
    finally:
        for layer in layers:
            layer.max_call_rows = limits[id(layer)]


def layer_costs(shapes: list[Any], all_layers: list[Any], limits: dict[int, int], counts: list[int],
                reps: int, dtype: Any) -> list[dict[str, Any]]:
    """Part 1: per shape and count, each rule's median ms and rows differing from two-row calls."""
    import torch

    rows_out = []
    for layer in shapes:
        x = torch.randn(max(counts), layer.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
        with torch.inference_mode():
            pairs = torch.cat([layer(x[i : i + 2]) for i in range(0, max(counts), 2)])  # [max count, out]
        for count in counts:
            calls, differing = [], {}
            for name in RULES:
                def run(name=name, rows=x[:count], layer=layer) -> Any:
                    with rule(all_layers, name, limits), torch.inference_mode():
                        return layer(rows)
                differing[name] = int((run() != pairs[:count]).any(-1).sum())
                calls.append((run, None))
            ms = [seconds * 1000 for seconds in interleaved_medians(calls, reps)]
            rows_out.append({"shape": f"{layer.out_features}x{layer.in_features}", "rows": count,
                             "one call ms": ms[0], "split ms": ms[1], "ratio": ms[1] / ms[0],
                             "one call rows differing": differing["one call"],
                             "split rows differing": differing["split"]})
    return rows_out


def prefill_costs(engine: Any, layers: list[Any], limits: dict[int, int], lengths: list[int],
                  reps: int) -> list[dict[str, Any]]:
    """Part 2: a whole prefill under each rule, and whether its last token's logits are that token's decoded ones."""
    import torch

    from tandem.engine import ForwardItem

    tokens = [t % engine.config.vocab_size for t in probe_tokens(max(lengths))]
    out = []
    for length in lengths:
        decoded_id = (NAME, "decoded", length)
        engine.forward([ForwardItem(decoded_id, tokens[: length - 1], num_logits=1, prompt=True)])
        decoded = engine.forward([ForwardItem(decoded_id, tokens[length - 1 : length], num_logits=1)])[0]
        engine.release(decoded_id)
        calls, same = [], {}
        for name in RULES:
            seq_id = (NAME, name, length)

            def run(seq_id=seq_id, length=length, name=name) -> torch.Tensor:
                with rule(layers, name, limits):
                    return engine.forward([ForwardItem(seq_id, tokens[:length], num_logits=1, prompt=True)])[0]

            same[name] = bool(torch.equal(run(), decoded))
            engine.release(seq_id)
            calls.append((run, lambda seq_id=seq_id: engine.release(seq_id)))
        ms = [seconds * 1000 for seconds in interleaved_medians(calls, reps)]
        out.append({"prompt tokens": length, "one call ms": ms[0], "split ms": ms[1], "ratio": ms[1] / ms[0],
                    "one call = decoded": same["one call"], "split = decoded": same["split"]})
    return out


def chart(costs: list[dict[str, Any]], prefills: list[dict[str, Any]], out: Path, name: str) -> Path:
    fig, (calls, whole) = new_figure(ncols=2, width=11.0)
    for shape in dict.fromkeys(r["shape"] for r in costs):
        mine = [r for r in costs if r["shape"] == shape]
        calls.plot([r["rows"] for r in mine], [r["ratio"] for r in mine], marker="o", label=shape)
    calls.axhline(1.0, color="grey", linewidth=0.8)
    calls.set_xscale("log", base=2)
    calls.set_xlabel("rows in the call")
    calls.set_ylabel("ms, split / one call")
    calls.set_title("one packed call, per layer shape")
    calls.legend(fontsize=7)
    whole.bar([str(r["prompt tokens"]) for r in prefills], [r["ratio"] for r in prefills])
    whole.axhline(1.0, color="grey", linewidth=0.8)
    whole.set_xlabel("prompt tokens")
    whole.set_ylabel("prefill ms, split / one call")
    whole.set_title("a whole prefill")
    return save_figure(fig, out, name)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen-coder-1.5b",
                        help="a catalog name or a model directory (default: %(default)s)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="bfloat16",
                        help="auto: bf16 where the CPU multiplies it natively, else fp32 (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None,
                        help="split calls above this many rows instead of the probed limit: to measure the cost "
                             "on a CPU whose kernels do not vary (none probed there)")
    parser.add_argument("--counts", type=lambda text: sorted(set(positive_ints(text, "--counts"))),
                        default=[2, 16, 32, 33, 64, 128, 256, 512],
                        help="comma-separated row counts for part 1 (default: 2,16,32,33,64,128,256,512)")
    parser.add_argument("--lengths", type=lambda text: sorted(set(positive_ints(text, "--lengths"))),
                        default=[300, 1000],
                        help="comma-separated whole prompts' tokens for part 2 (default: 300,1000)")
    parser.add_argument("--reps", type=int, default=5, help="timed runs per measurement (default: %(default)s)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    parser.add_argument("--name", default=NAME)
    return parser


def main(argv: list[str] | None = None) -> int:
    from tandem.engine import ModelEngine
    from tandem.models import row_padding

    args = build_parser().parse_args(argv)
    if args.reps < 1 or (args.limit is not None and args.limit < 2) or min(args.counts) < 2:
        raise SystemExit(f"--reps must be 1 or more, --limit and every --counts 2 or more; got {args.reps}, "
                         f"{args.limit} and {args.counts}")
    probe_seconds = [0.0]
    probe = row_padding.probe_call_limit

    def timed_probe(*probe_args: Any, **kwargs: Any) -> int:
        start = time.perf_counter()
        try:
            return probe(*probe_args, **kwargs)
        finally:
            probe_seconds[0] += time.perf_counter() - start

    row_padding.probe_call_limit = timed_probe
    cfg = engine_config(resolve_model_dir(args.model, args.cache_dir), args.dtype)
    load_start = time.perf_counter()
    engine = ModelEngine.load(dataclasses.replace(cfg, kv_cache_tokens=max(cfg.kv_cache_tokens,
                                                                           2 * max(args.lengths) + 64)))
    load_seconds = time.perf_counter() - load_start
    row_padding.probe_call_limit = probe
    layers = packed_layers(engine.model)
    if not layers:
        raise SystemExit(f"{args.model}: no layer is packed for oneDNN (a test-sized model, or packing off on this "
                         "CPU): nothing to split")
    probed = {layer.max_call_rows for layer in layers}
    if args.limit is None and probed == {None}:
        raise SystemExit("no layer's calls are limited on this CPU (its kernels are not probed: no AMX for this "
                         "dtype); give --limit N to measure what a split would cost here")
    limits = {id(layer): args.limit if args.limit is not None else layer.max_call_rows for layer in layers}
    print(f"[{NAME}] probed limits {sorted(probed, key=str)}, probes {probe_seconds[0]:.2f} s of a "
          f"{load_seconds:.1f} s load; part 1: {len(args.counts)} counts x {len(one_per_shape(layers))} shapes",
          file=sys.stderr, flush=True)
    costs = layer_costs(one_per_shape(layers), layers, limits, args.counts, args.reps, engine.dtype)
    print(f"[{NAME}] part 2: {len(args.lengths)} prefills x 2 rules x {args.reps} reps", file=sys.stderr, flush=True)
    prefills = prefill_costs(engine, layers, limits, args.lengths, args.reps)
    machine = machine_info()
    cost_table = markdown_table(costs, ["shape", "rows", "one call ms", "split ms", "ratio", "one call rows differing",
                                        "split rows differing"])
    prefill_table = markdown_table(prefills, ["prompt tokens", "one call ms", "split ms", "ratio",
                                              "one call = decoded", "split = decoded"])
    settings = {"model": args.model, "dtype": str(engine.dtype).removeprefix("torch."),
                "limits": sorted({limits[id(layer)] for layer in layers}, key=str),
                "probed limits": sorted(probed, key=str), "counts": args.counts,
                "lengths": args.lengths, "reps": args.reps, "probe seconds": round(probe_seconds[0], 3),
                "load seconds": round(load_seconds, 2)}
    write_json(args.out, args.name, {"machine": machine, "settings": settings, "calls": costs, "prefills": prefills})
    write_markdown(args.out, args.name, "Packed calls split at the probed limit, against one call",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{cost_table}\n\n{prefill_table}\n")
    chart(costs, prefills, args.out, args.name)
    print(cost_table, prefill_table, sep="\n\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
