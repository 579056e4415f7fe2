"""Two versions of the SDPA attention backend side by side: one forward of each shape, on one loaded model.

The backend of another git revision (``--baseline``, default: the last commit that attended decode and
verify rows one by one over exactly their visible keys) is loaded from git beside this checkout's, and
both run the shapes of verify_cost.py (a decode step, a chain of 5, trees of 6 and 12 nodes) over the
same cached contexts, every (shape, backend) pair taking turns so that noise hits all of them. What it
prices: computing every row in its attention piece's call, which makes generated tokens' KV bitwise a
prompt's and lets the prefix cache keep them (tandem/attention/sdpa.py).

Writes attention_ab.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/attention_ab.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    DEFAULT_RESULTS_DIR,
    interleaved_medians,
    machine_info,
    machine_line,
    markdown_table,
    write_json,
    write_markdown,
)
from benchmarks.runners import engine_config, probe_tokens, resolve_model_dir  # noqa: E402
from benchmarks.verify_cost import SHAPES, chart, contexts_from  # noqa: E402

NAME = "attention_ab"
BASELINE = "09ec316"  # rows of decode and verify runs attended one by one (before rows were fixed by position)
BACKEND_PATH = "tandem/attention/sdpa.py"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--baseline", default=BASELINE, help="git revision of the other backend (default: %(default)s)")
    parser.add_argument("--model", default="qwen-coder-1.5b", help="a catalog name or a model directory")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--contexts", default="300,1000,2000", help="comma-separated cached context lengths")
    parser.add_argument("--reps", type=int, default=11, help="timed forwards per shape, backend and context")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    parser.add_argument("--name", default=NAME, help="file name of the results (without extension)")
    return parser


def baseline_backend(revision: str, dtype: Any) -> Any:
    """The SDPA backend as it was at ``revision``, loaded from git under a module name of its own."""
    try:
        source = subprocess.run(["git", "-C", str(_REPO_ROOT), "show", f"{revision}:{BACKEND_PATH}"],
                                check=True, capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise SystemExit(f"--baseline {revision}: cannot read {BACKEND_PATH} from git ({exc})") from None
    path = Path(tempfile.mkdtemp()) / "baseline_sdpa.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_sdpa", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["baseline_sdpa"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module.SdpaAttention(dtype)


def measure(engine: Any, backends: dict[str, Any], context: int, reps: int) -> dict[str, float]:
    """Median ms of one forward per (shape, backend) over ``context`` cached tokens; sequences released."""
    from tandem.engine import ForwardItem

    calls, names = [], []
    for shape, (count, parents) in SHAPES.items():
        for label, backend in backends.items():
            seq_id = (NAME, shape, label, context)
            tokens = [t % engine.config.vocab_size for t in probe_tokens(context + count)]
            engine.forward([ForwardItem(seq_id, tokens[:context], num_logits=1, prompt=True)])
            item = ForwardItem(seq_id, tokens[context:], num_logits=count, parents=parents)

            def run(item=item, backend=backend) -> None:
                engine.backend = backend
                engine.forward([item])

            calls.append((run, lambda seq_id=seq_id: engine.rollback(seq_id, context)))
            names.append(f"{shape} {label}")
    try:
        medians = interleaved_medians(calls, reps)
    finally:
        for seq_id in list(engine.kv_cache.sequences()):
            engine.release(seq_id)
    return {name: seconds * 1000 for name, seconds in zip(names, medians)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    contexts = contexts_from(args.contexts)
    from tandem.engine import ModelEngine

    engine = ModelEngine.load(engine_config(resolve_model_dir(args.model, args.cache_dir), args.dtype))
    backends = {"baseline": baseline_backend(args.baseline, engine.backend.dtype), "now": engine.backend}
    rows = []
    for context in contexts:
        print(f"[{NAME}] context {context}", file=sys.stderr, flush=True)
        ms = measure(engine, backends, context, args.reps)
        row: dict[str, Any] = {"context": context}
        for shape in SHAPES:
            row[f"{shape} baseline ms"] = ms[f"{shape} baseline"]
            row[f"{shape} now ms"] = ms[f"{shape} now"]
            row[f"{shape} ratio"] = ms[f"{shape} now"] / ms[f"{shape} baseline"]
        rows.append(row)
    machine = machine_info()
    columns = ["context", *(f"{s} {c}" for s in SHAPES for c in ("baseline ms", "now ms", "ratio"))]
    table = markdown_table(rows, columns)
    settings = {"model": args.model, "dtype": args.dtype, "contexts": contexts, "reps": args.reps,
                "baseline": args.baseline, "shapes": SHAPES}
    write_json(args.out, args.name, {"machine": machine, "settings": settings, "rows": rows})
    write_markdown(args.out, args.name, "SDPA backend: rows by position against the baseline revision",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{table}\n")
    chart(rows, args.out, args.name, column="{shape} ratio", ylabel="ms per forward, this checkout / baseline",
          title="rows by position: what one forward pays, batch 1")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
