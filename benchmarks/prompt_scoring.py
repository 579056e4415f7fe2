"""The price of scoring a prompt: a target Prefill with and without ``prompt_logprobs``, batch 1.

Completions' ``echo`` with ``logprobs`` (lm-evaluation-harness's log-likelihood and perplexity
requests) asks the target for the log-probability of every prompt token, so every row of the
prompt goes through lm_head (151,936 ids for Qwen: the largest matmul of a row) and a
log-softmax, where a plain Prefill computes the last row's only; the prompt runs 256 rows a step
(tandem/prompt_logprobs.py). This times both on the worker's own engine (``TargetEngine``), the
two taking turns per length (medians kept), prefix cache off for both (a scored prompt never
reads it), and reports milliseconds, their ratio and scored tokens per second.

Writes prompt_scoring.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/prompt_scoring.py` from anywhere
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

NAME = "prompt_scoring"
TOP = 1  # alternatives per token, as lm-evaluation-harness asks (logprobs: 1)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen-coder-1.5b", help="a catalog name or a model directory")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--lengths", default="128,512,2048", help="comma-separated prompt lengths (tokens)")
    parser.add_argument("--reps", type=int, default=5, help="timed Prefills per way and length (median kept)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    parser.add_argument("--name", default=NAME, help="file name of the results (without extension)")
    return parser


def prefill(target: Any, seq_id: str, tokens: list[int], scored: bool) -> int:
    """One Prefill to its answer (a scored prompt's steps included); the prompt tokens scored."""
    from tandem.rpc.batcher import Unfinished
    from tandem.sampling import SamplingParams
    from target_worker.engine import PrefillCall

    call = PrefillCall(seq_id, tokens, SamplingParams(prompt_logprobs=TOP if scored else None))
    while True:
        [result] = target.run_batch([call])
        if isinstance(result, BaseException):
            raise result
        if not isinstance(result, Unfinished):
            return len(result.prompt_logprobs or ())


def measure(target: Any, length: int, reps: int) -> dict[str, float]:
    """Median ms of a plain and of a scored Prefill of ``length`` tokens (each released after)."""
    from target_worker.engine import ReleaseCall

    tokens = [t % target.vocab_size for t in probe_tokens(length)]
    if prefill(target, "check", tokens, scored=True) != length - 1:  # every token but the first is scored
        raise RuntimeError(f"a scored Prefill of {length} tokens did not score {length - 1} of them")
    target.run_batch([ReleaseCall("check")])
    calls = [(lambda scored=scored: prefill(target, f"{NAME}-{scored}", tokens, scored),
              lambda scored=scored: target.run_batch([ReleaseCall(f"{NAME}-{scored}")])) for scored in (False, True)]
    plain, scored = interleaved_medians(calls, reps, warmup=1)
    return {"plain ms": plain * 1000, "scored ms": scored * 1000, "scored / plain": scored / plain,
            "scored tokens/s": (length - 1) / scored}


def chart(rows: list[dict[str, Any]], out: Path, name: str) -> Path:
    fig, (ax,) = new_figure()
    for column in ("plain ms", "scored ms"):
        ax.plot([r["prompt tokens"] for r in rows], [r[column] for r in rows], marker="o", label=column[:-3])
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt (tokens)")
    ax.set_ylabel("ms per Prefill (median)")
    ax.set_title("a Prefill with and without the prompt's log-probabilities")
    ax.legend()
    return save_figure(fig, out, name)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    lengths = positive_ints(args.lengths, "--lengths")
    import torch

    from tandem.engine import ModelEngine
    from target_worker.engine import TargetEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model, args.cache_dir)
    target = TargetEngine(ModelEngine.load(engine_config(model_dir, args.dtype)), prefill_chunk_tokens=0)
    if max(lengths) >= target.max_context:
        raise SystemExit(f"--lengths: {max(lengths)} tokens do not fit the model's context of {target.max_context}")
    rows = []
    for length in lengths:
        print(f"[{NAME}] {length} tokens", file=sys.stderr, flush=True)
        rows.append({"prompt tokens": length, **measure(target, length, args.reps)})
    machine = machine_info()
    table = markdown_table(rows, ["prompt tokens", "plain ms", "scored ms", "scored / plain", "scored tokens/s"])
    settings = {"model": args.model, "dtype": args.dtype, "lengths": lengths, "reps": args.reps, "top": TOP}
    write_json(args.out, args.name, {"machine": machine, "settings": settings, "rows": rows})
    write_markdown(args.out, args.name, "The price of scoring a prompt",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{table}\n")
    chart(rows, args.out, args.name)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
