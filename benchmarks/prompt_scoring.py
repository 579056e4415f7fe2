"""The price of scoring a prompt: a target Prefill with and without ``prompt_logprobs``, batch 1.

Completions' ``echo`` with ``logprobs`` (lm-evaluation-harness's log-likelihood and perplexity
requests) asks the target for the log-probability of every prompt token, so every row of the
prompt goes through lm_head (151,936 ids for Qwen: the largest matmul of a row) and a
log-softmax, where a plain Prefill computes the last row's only; the prompt runs 256 rows a step
(tandem/prompt_logprobs.py). This times both on the worker's own engine (``TargetEngine``), the
two taking turns per length (medians kept), prefix cache off for both, and reports milliseconds,
their ratio and scored tokens per second.

Then multiple choice as lm-evaluation-harness sends it: one context, then each answer scored
after it (``--choices`` requests of context + answer, one at a time), on a target with prefix
caching on (each scored prompt keeps its blocks' scores: tandem/prompt_score_cache.py) and one
with it off, taking turns; every question a new context. It checks that both give bitwise the
same scores, and reports milliseconds per question and the speedup.

Writes prompt_scoring.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
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
    parser.add_argument("--contexts", default="256,1024",
                        help="comma-separated context lengths of the multiple-choice questions (tokens)")
    parser.add_argument("--choices", type=int, default=4, help="answers per question")
    parser.add_argument("--answer-tokens", type=int, default=16, help="tokens per answer")
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


def question(target: Any, context: list[int], answers: list[list[int]]) -> list[tuple]:
    """Each answer scored after ``context``, one request at a time, each released after; the scores."""
    from tandem.rpc.batcher import Unfinished
    from tandem.sampling import SamplingParams
    from target_worker.engine import PrefillCall, ReleaseCall

    scores = []
    for j, answer in enumerate(answers):
        call = PrefillCall(f"{NAME}-choice-{j}", [*context, *answer], SamplingParams(prompt_logprobs=TOP))
        while True:
            [result] = target.run_batch([call])
            if isinstance(result, BaseException):
                raise result
            if not isinstance(result, Unfinished):
                break
        target.run_batch([ReleaseCall(call.seq_id)])
        scores.append(tuple((s.logprob, tuple(s.top_ids), tuple(s.top_logprobs)) for s in result.prompt_logprobs))
    return scores


def measure_choices(cached: Any, uncached: Any, length: int, choices: int, answer_tokens: int,
                    reps: int) -> dict[str, float]:
    """Median ms per question of ``choices`` answers after a ``length``-token context, scores kept and not; every
    question (each target's n-th the same) a new context."""
    vocab = min(cached.vocab_size, 21_000)

    def make(n: int) -> tuple[list[int], list[list[int]]]:
        # a context of its own per question and per length (the longer contexts must not start with a shorter one)
        context = [(t + 37 * n + 1009 * length) % vocab for t in probe_tokens(length)]
        answers = [[(t + 101 * (j + 1) + n) % vocab for t in probe_tokens(answer_tokens)] for j in range(choices)]
        return context, answers

    if question(cached, *make(-1)) != question(uncached, *make(-1)):
        raise RuntimeError(f"a {length}-token question's scores differ with the kept scores from computed ones")
    asked = {"cached": 0, "uncached": 0}

    def ask(name: str, target: Any) -> None:
        asked[name] += 1
        question(target, *make(asked[name]))

    calls = [(lambda: ask("uncached", uncached), None), (lambda: ask("cached", cached), None)]
    off, on = interleaved_medians(calls, reps, warmup=1)
    return {"cache off ms": off * 1000, "cache on ms": on * 1000, "speedup": off / on}


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
    contexts = positive_ints(args.contexts, "--contexts")
    if args.choices < 1 or args.answer_tokens < 1:
        raise SystemExit("--choices and --answer-tokens must be >= 1")
    import torch

    from tandem.engine import ModelEngine
    from target_worker.engine import TargetEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir = resolve_model_dir(args.model, args.cache_dir)
    config = engine_config(model_dir, args.dtype)
    target = TargetEngine(ModelEngine.load(config), prefill_chunk_tokens=0)
    if max(lengths) >= target.max_context or max(contexts) + args.answer_tokens >= target.max_context:
        raise SystemExit(f"--lengths / --contexts: {max(*lengths, max(contexts) + args.answer_tokens)} tokens do "
                         f"not fit the model's context of {target.max_context}")
    rows = []
    for length in lengths:
        print(f"[{NAME}] {length} tokens", file=sys.stderr, flush=True)
        rows.append({"prompt tokens": length, **measure(target, length, args.reps)})
    cached = TargetEngine(ModelEngine.load(replace(config, prefix_caching=True)), prefill_chunk_tokens=0)
    if cached.score_cache is None:
        raise SystemExit("this engine's rows are not fixed by position here: scored prompts keep no scores")
    choice_rows = []
    for length in contexts:
        print(f"[{NAME}] multiple choice after {length} tokens", file=sys.stderr, flush=True)
        choice_rows.append({"context tokens": length, "answers": args.choices, "answer tokens": args.answer_tokens,
                            **measure_choices(cached, target, length, args.choices, args.answer_tokens, args.reps)})
    machine = machine_info()
    table = markdown_table(rows, ["prompt tokens", "plain ms", "scored ms", "scored / plain", "scored tokens/s"])
    choice_table = markdown_table(choice_rows, ["context tokens", "answers", "answer tokens", "cache off ms",
                                                "cache on ms", "speedup"])
    settings = {"model": args.model, "dtype": args.dtype, "lengths": lengths, "reps": args.reps, "top": TOP,
                "contexts": contexts, "choices": args.choices, "answer_tokens": args.answer_tokens}
    write_json(args.out, args.name, {"machine": machine, "settings": settings, "rows": rows,
                                     "choice_rows": choice_rows})
    write_markdown(args.out, args.name, "The price of scoring a prompt",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{table}\n\n"
                   f"Multiple choice, ms per question (every answer scored after the context):\n\n{choice_table}\n")
    chart(rows, args.out, args.name)
    print(table)
    print(choice_table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
