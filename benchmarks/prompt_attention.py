"""A prompt's prefill with this checkout's attention backend and another revision's, side by side.

The SDPA backend computes every prompt row in its attention piece's call (tandem/attention/sdpa.py): a
piece is 4 query rows, so a 1,024-token prompt was 256 calls per layer, each mostly call overhead on a
CPU. Now the pieces of a prompt that read the same number of keys share a call. This benchmark prices
one whole prefill of each ``--lengths`` prompt (nothing cached before it), and a ``--chunk``-token chunk
of a prompt after ``--chunk-after`` cached prompt tokens (how a prompt is read beside running streams,
tandem/rpc/prefill_chunks.py), with this checkout's backend and the backend of ``--baseline`` loaded
beside it, every (shape, backend) taking turns so that noise hits both. Each row also says whether both
backends gave bitwise the same last-token logits (they must: the batch axis does not change a row).

Each row: median ms of both backends, their ratio and this checkout's prompt tokens per second. Writes
prompt_attention.json / .md / .png into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/prompt_attention.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.attention_ab import baseline_backend  # noqa: E402
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

NAME = "prompt_attention"
BASELINE = "381c8da"  # every prompt piece in a call of its own


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="a catalog name or a model directory (default: %(default)s)")
    parser.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                        help="auto: bf16 where the CPU multiplies it natively, else fp32 (default: %(default)s)")
    parser.add_argument("--lengths", type=lambda text: sorted(set(positive_ints(text, "--lengths"))),
                        default=[128, 512, 1024, 2048], help="comma-separated whole prompts' tokens (default: "
                        "128,512,1024,2048)")
    parser.add_argument("--chunk", type=int, default=256, help="tokens of the chunk row (default: %(default)s)")
    parser.add_argument("--chunk-after", type=int, default=1024,
                        help="cached prompt tokens before the chunk (default: %(default)s)")
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the other backend (default: %(default)s)")
    parser.add_argument("--reps", type=int, default=5, help="timed prefills per (shape, backend)")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    parser.add_argument("--name", default=NAME, help="file name of the results (without extension)")
    return parser


def shapes_of(lengths: list[int], chunk: int, chunk_after: int) -> dict[str, tuple[int, int]]:
    """Each row's (cached prompt tokens, new prompt tokens), by label."""
    shapes = {f"prompt {n}": (0, n) for n in lengths}
    if chunk > 0:
        shapes[f"chunk {chunk} after {chunk_after}"] = (chunk_after, chunk)
    return shapes


def measure(engine: Any, backends: dict[str, Any], shapes: dict[str, tuple[int, int]],
            reps: int) -> tuple[dict[tuple[str, str], float], dict[str, bool]]:
    """Median ms of each (shape, backend)'s prefill, and per shape whether both backends' last logits are equal."""
    import torch

    from tandem.engine import ForwardItem

    tokens = [t % engine.config.vocab_size for t in probe_tokens(max(c + n for c, n in shapes.values()))]
    calls, keys, logits = [], [], {}
    for shape, (cached, new) in shapes.items():
        seq_id = (NAME, shape)
        for label, backend in backends.items():
            def run(seq_id=seq_id, cached=cached, new=new, backend=backend) -> torch.Tensor:
                engine.backend = backend
                if cached and not engine.kv_cache.has_sequence(seq_id):  # the cached part, untimed the first time
                    engine.forward([ForwardItem(seq_id, tokens[:cached], num_logits=1, prompt=True)])
                return engine.forward([ForwardItem(seq_id, tokens[cached : cached + new], num_logits=1,
                                                   prompt=True)])[0]

            def undo(seq_id=seq_id, cached=cached) -> None:
                if cached:
                    engine.rollback(seq_id, cached)
                else:
                    engine.release(seq_id)

            logits[(shape, label)] = run()
            undo()
            calls.append((run, undo))
            keys.append((shape, label))
    try:
        medians = interleaved_medians(calls, reps)
    finally:
        for shape in shapes:
            if engine.kv_cache.has_sequence((NAME, shape)):
                engine.release((NAME, shape))
    same = {shape: torch.equal(*(logits[(shape, label)] for label in backends)) for shape in shapes}
    return {key: seconds * 1000 for key, seconds in zip(keys, medians)}, same


def chart(rows: list[dict[str, Any]], out: Path, name: str) -> Path:
    fig, (ax,) = new_figure()
    labels = [r["shape"] for r in rows]
    ax.bar(labels, [r["ratio"] for r in rows])
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_ylabel("ms per prefill, this checkout / baseline")
    ax.set_title("a prompt's attention pieces: what one prefill pays")
    ax.tick_params(axis="x", labelrotation=20)
    return save_figure(fig, out, name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.chunk < 0 or args.chunk_after < 0:
        raise SystemExit("--chunk and --chunk-after: a count of tokens, 0 or more")
    from tandem.engine import ModelEngine

    shapes = shapes_of(args.lengths, args.chunk, args.chunk_after)
    cfg = engine_config(resolve_model_dir(args.model, args.cache_dir), args.dtype)
    needed = sum(c + n for c, n in shapes.values()) + 1024
    engine = ModelEngine.load(dataclasses.replace(cfg, kv_cache_tokens=max(cfg.kv_cache_tokens, needed)))
    backends = {"baseline": baseline_backend(args.baseline, engine.backend.dtype), "now": engine.backend}
    print(f"[{NAME}] {len(shapes)} shapes x 2 backends x {args.reps} reps", file=sys.stderr, flush=True)
    ms, same = measure(engine, backends, shapes, args.reps)
    rows = []
    for shape, (_, new) in shapes.items():
        base, now = ms[(shape, "baseline")], ms[(shape, "now")]
        rows.append({"shape": shape, "baseline ms": base, "now ms": now, "ratio": now / base,
                     "now tokens/s": new / (now / 1000), "same logits": same[shape]})
    machine = machine_info()
    table = markdown_table(rows, ["shape", "baseline ms", "now ms", "ratio", "now tokens/s", "same logits"])
    settings = {"model": args.model, "dtype": str(engine.backend.dtype).removeprefix("torch."),
                "lengths": args.lengths, "chunk": args.chunk, "chunk_after": args.chunk_after, "reps": args.reps,
                "baseline": args.baseline}
    write_json(args.out, args.name, {"machine": machine, "settings": settings, "rows": rows})
    write_markdown(args.out, args.name, "A prompt's prefill, against the baseline revision's attention",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{table}\n")
    chart(rows, args.out, args.name)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
