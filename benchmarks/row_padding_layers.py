"""Per-layer cost of a packed linear layer at 2..9 rows, and the row count a lone row is padded to.

oneDNN chooses its kernel by the row count; on some CPUs one and two rows take slower kernels than
three to nine (issue 28: an AMD EPYC Zen 4 ran the Qwen2.5-Coder-1.5B forward of one new token at
192 ms and of five at 155 ms). ``tandem.models.row_padding`` measures each packed weight shape at
load and pads small calls to the cheapest count; this script shows, for the Qwen2.5-Coder-1.5B
layer shapes, what it measures and chooses on this machine: the cost at 2..9 rows, a lone row as
padded to two (the old rule) and as tuned (the new one).

The weights are random (the cost does not depend on their values) and called back to back, so a
weight that fits the last-level cache is measured from it: the figures are each kernel's cost,
not the cost of streaming the model from memory in a real forward (engine_speed.py measures that).

Writes row_padding_layers.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    machine_info,
    machine_line,
    markdown_table,
    new_figure,
    save_figure,
    write_json,
    write_markdown,
)
from tandem.models.packed import pack_weight  # noqa: E402
from tandem.models.row_padding import MAX_PADDED_ROWS, measure_padding, padded_rows  # noqa: E402

# Qwen2.5-Coder-1.5B's linear layers as the engine fuses them (hidden 1536, 12 query and 2 KV heads of
# 128, MLP 8960, vocabulary 151,936). The q/k/v projection has a bias; the benchmark leaves it out (the
# kernel choice is the matmul's).
SHAPES = (("qkv", 2048, 1536), ("o", 1536, 1536), ("gate_up", 17920, 1536), ("down", 1536, 8960),
          ("lm_head", 151936, 1536))
ROWS = tuple(range(2, MAX_PADDED_ROWS + 2))


def median_ms(x: torch.Tensor, packed: torch.Tensor, reps: int) -> float:
    for _ in range(3):  # first-call setup, caches
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--reps", type=int, default=41, help="calls per row count (lm_head: a quarter)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    records = []
    for name, out_features, in_features in SHAPES:
        packed = pack_weight(torch.randn(out_features, in_features, dtype=dtype))
        reps = args.reps if out_features < 100_000 else max(5, args.reps // 4)
        cost = {rows: median_ms(torch.zeros(rows, in_features, dtype=dtype), packed, reps) for rows in ROWS}
        padding, _ = measure_padding(packed, in_features, None, dtype)
        tuned = padded_rows(padding, 1)
        records.append({"layer": f"{name} {out_features}x{in_features}",
                        **{f"rows_{rows}_ms": round(ms, 4) for rows, ms in cost.items()},
                        "lone_row_old_ms": round(cost[2], 4), "lone_row_padded_to": tuned,
                        "lone_row_new_ms": round(cost[tuned], 4)})
        print(records[-1], flush=True)
    machine = machine_info()
    settings = {"dtype": args.dtype, "threads": args.threads, "reps": args.reps}
    write_json(args.out, "row_padding_layers", {"settings": settings, "machine": machine, "records": records})
    columns = ["layer", *[f"rows_{rows}_ms" for rows in ROWS], "lone_row_old_ms", "lone_row_padded_to",
               "lone_row_new_ms"]
    write_markdown(args.out, "row_padding_layers", "Packed linear cost by row count",
                   markdown_table(records, columns) + "\n\n" + machine_line(machine))
    fig, (ax,) = new_figure()
    for record in records:
        base = record["rows_2_ms"]
        ax.plot(ROWS, [record[f"rows_{rows}_ms"] / base for rows in ROWS], marker="o", label=record["layer"])
    ax.set_xlabel("rows in the call")
    ax.set_ylabel("cost / cost of 2 rows")
    ax.legend()
    save_figure(fig, args.out, "row_padding_layers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
