"""Questions after one long system prompt, as a served chat sees them: what each method gains, first and after.

A chat service sends the same long system prompt (instructions, reference text) before
every question. With prefix caching on (the default of every worker), the target reads it
once; so does the draft, which caches a prompt's blocks once it has drafted after them. A
lone request's draft waits to read a long prompt until the answer can repay the read
(``SpeculationLoop._draft_waits``); what it must read is priced less the blocks its own
cache holds (``DraftProposer.unread``), so a cached system prompt is read at once.

Each method runs on engines of its own (a fresh prefix cache each, as a newly started
server has), so the first question is cold for every method and the later ones find the
system prompt cached. Questions run in order, every method on a question back to back
(rotating which goes first). Methods:

  target-only        plain decoding (the baseline)
  spec-hybrid        n-gram lookup when the text repeats, the draft model otherwise; the draft
                     waits while its read would not pay (the default)
  spec-hybrid-eager  the same, the draft reading every prompt at once (SpecOptions.draft_waits off)

The system prompt is Spec-Bench rag question ``--system-from``'s text (a retrieved passage and
its question, about 650 tokens with the template); the questions are Spec-Bench mt_bench and qa
first turns (``--questions``, half each, a seeded sample). Reported per method: the first
question, the rest, and all; tokens/s and its ratio to target-only's in the same group; draft
waiting rounds; prompts whose output differs from target-only's.

Writes shared_prompt.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/shared_prompt.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    DEFAULT_RESULTS_DIR,
    DEFAULT_SPEC_BENCH,
    grouped_bars,
    load_prompts,
    machine_info,
    machine_line,
    markdown_table,
    names_from,
    new_figure,
    save_figure,
    timed,
    write_json,
    write_markdown,
)
from tandem.cli.draft_flags import add_draft_flags, draft_engine_options  # noqa: E402

NAME = "shared_prompt"
BASELINE = "target-only"
METHODS = (BASELINE, "spec-hybrid", "spec-hybrid-eager")
GROUPS = ("first", "rest", "all")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--target", default="qwen-coder-1.5b", help="a catalog name or a model directory")
    parser.add_argument("--draft", default="qwen-coder-0.5b", help="a catalog name or a model directory")
    add_draft_flags(parser)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)} "
                                                                      f"({BASELINE} always runs)")
    parser.add_argument("--questions", type=int, default=8, help="questions after the system prompt (default 8)")
    parser.add_argument("--system-from", type=int, default=0, metavar="I",
                        help="the system prompt is the text of Spec-Bench's I-th rag question (default 0)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0, help="which questions are sampled")
    parser.add_argument("--k", type=int, default=4, help="largest k (adaptive)")
    parser.add_argument("--spec-bench", type=Path, default=DEFAULT_SPEC_BENCH)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    parser.add_argument("--name", default=NAME, help="file name of the results (without extension)")
    return parser


def methods_from(text: str) -> list[str]:
    """The methods asked for, target-only first whether asked or not."""
    return [BASELINE, *[m for m in names_from(text, METHODS) if m != BASELINE]]


def system_prompt(spec_bench: Path, index: int) -> str:
    """The text of Spec-Bench's ``index``-th rag question (first turn)."""
    with spec_bench.open(encoding="utf-8") as f:
        rag = [json.loads(line)["turns"][0] for line in f if line.strip() and json.loads(line)["category"] == "rag"]
    if not 0 <= index < len(rag):
        raise SystemExit(f"--system-from: Spec-Bench has {len(rag)} rag questions, got {index}")
    return rag[index]


def generator_for(method: str, target_config: Any, draft_config: Any, k: int) -> Any:
    """``method``'s own engines (fresh prefix caches), warmed up, behind one generator kept for the run."""
    from tandem.engine import ModelEngine
    from tandem.inprocess import SpeculativeGenerator
    from tandem.spec.options import SpecOptions

    target = ModelEngine.load(target_config)
    target.warmup()
    if method == BASELINE:
        return SpeculativeGenerator(target, None, SpecOptions("none", 0))
    draft = ModelEngine.load(draft_config)
    draft.warmup()
    return SpeculativeGenerator(target, draft, SpecOptions("hybrid", k, hybrid_min_match=3,
                                                           draft_waits=method != "spec-hybrid-eager"))


def measure(generators: dict[str, Any], prompts: Sequence[list[int]], max_new_tokens: int,
            stop_ids: frozenset[int]) -> list[dict[str, Any]]:
    """One row per question and method: the questions in order, the methods on each in a rotating order."""
    from tqdm import tqdm

    from tandem.inprocess import GenerationRequest
    from tandem.sampling import SamplingParams

    methods = list(generators)
    rows = []
    for i in tqdm(range(len(prompts)), desc=NAME, unit="question", file=sys.stderr):
        shift = i % len(methods)
        for method in methods[shift:] + methods[:shift]:
            request = GenerationRequest(list(prompts[i]), max_new_tokens, SamplingParams(), stop_ids)
            (result,), seconds = timed(lambda g=generators[method], r=request: g.generate([r]))
            stats = result.stats
            rows.append({"question": i, "method": method, "prompt_tokens": len(prompts[i]),
                         "tokens": len(result.token_ids), "token_ids": result.token_ids, "seconds": seconds,
                         "draft_wait_rounds": stats.draft_wait_rounds, "rounds": stats.rounds,
                         "target_reused": stats.prompt_tokens_reused})
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method and group (the first question, the rest, all): tokens/s, its ratio to target-only's in the
    same group, waiting rounds, and outputs that differ from target-only's."""
    reference = {r["question"]: r["token_ids"] for r in rows if r["method"] == BASELINE}
    chosen = {"first": lambda q: q == 0, "rest": lambda q: q > 0, "all": lambda q: True}
    out = []
    for group in GROUPS:
        rates = {}
        for method in dict.fromkeys(r["method"] for r in rows):
            picked = [r for r in rows if r["method"] == method and chosen[group](r["question"])]
            if not picked:
                continue
            tokens, seconds = sum(r["tokens"] for r in picked), sum(r["seconds"] for r in picked)
            rates[method] = tokens / seconds
            out.append({"group": group, "method": method, "questions": len(picked), "tokens_per_s": rates[method],
                        "x_target_only": rates[method] / rates[BASELINE] if BASELINE in rates else None,
                        "draft_wait_rounds": sum(r["draft_wait_rounds"] for r in picked),
                        "mismatches": sum(r["token_ids"] != reference[r["question"]] for r in picked)})
    return out


def report(rows: list[dict[str, Any]], summary: list[dict[str, Any]], settings: dict[str, Any], out: Path,
           name: str) -> str:
    """Write JSON, markdown and the chart; the markdown table."""
    machine = machine_info()
    columns = ["group", "method", "questions", "tokens_per_s", "x_target_only", "draft_wait_rounds", "mismatches"]
    table = markdown_table(summary, columns)
    write_json(out, name, {"machine": machine, "settings": settings, "summary": summary,
                           "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]})
    write_markdown(out, name, "Questions after one long system prompt: each method, cold and cached",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{table}\n")
    fig, (ax,) = new_figure()
    methods = list(dict.fromkeys(s["method"] for s in summary))
    series = {m: [next((s["x_target_only"] for s in summary if (s["group"], s["method"]) == (g, m)), None)
                  for g in GROUPS] for m in methods}
    grouped_bars(ax, list(GROUPS), series, "tokens/s over target-only")
    ax.set_title("questions after one long system prompt, batch 1")
    save_figure(fig, out, name)
    return table


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    methods = methods_from(args.methods)
    if args.questions < 1:
        raise SystemExit(f"--questions must be at least 1, got {args.questions}")
    from benchmarks.runners import engine_config, resolve_model_dir
    from tandem.tokenizer import check_same_tokenizer, encode_messages, load_tokenizer, stop_token_ids

    system = system_prompt(args.spec_bench, args.system_from)
    target_dir = resolve_model_dir(args.target, args.cache_dir)
    tokenizer = load_tokenizer(target_dir)
    draft_dir = resolve_model_dir(args.draft, args.cache_dir)
    check_same_tokenizer(tokenizer, target_dir, draft_dir)
    # A server's engines: prefix caching on (the benchmarks' engine_config turns it off).
    target_config = dataclasses.replace(engine_config(target_dir, args.dtype), prefix_caching=True)
    draft_config = dataclasses.replace(engine_config(draft_dir, args.dtype, draft_options=draft_engine_options(args)),
                                       prefix_caching=True)
    questions = load_prompts(["mt_bench", "qa"], (args.questions + 1) // 2, args.seed, args.spec_bench)
    questions = questions[:args.questions]
    prompts = [encode_messages(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q.text}])
               for q in questions]
    lengths = sorted(len(p) for p in prompts)
    print(f"[{NAME}] {len(methods)} methods, each on engines of its own; {len(prompts)} questions after one system "
          f"prompt, {lengths[0]}-{lengths[-1]} prompt tokens in all", file=sys.stderr, flush=True)
    generators = {m: generator_for(m, target_config, draft_config, args.k) for m in methods}
    rows = measure(generators, prompts, args.max_new_tokens, stop_token_ids(target_dir, tokenizer,
                                                                            generators[BASELINE].target.engine.config))
    settings = {"target": args.target, "draft": args.draft, "dtype": args.dtype, "methods": methods,
                "questions": [q.prompt_id for q in questions], "system_from": f"rag #{args.system_from}",
                "max_new_tokens": args.max_new_tokens, "seed": args.seed, "k": args.k,
                "draft_options": draft_engine_options(args)}
    print(report(rows, summarize(rows), settings, args.out, args.name))
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
