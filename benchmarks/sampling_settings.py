"""One prompt set under several sampling settings, each method against target-only under the SAME setting.

What ``penalties.py`` and ``structured_output.py`` share: per prompt and setting, target-only decoding
runs first and is the reference, then every method in a rotating order (the settings take turns going
first too). Reported per setting and method, over all prompts: tokens/s and its ratio to target-only
under that setting, acceptance (kept / drafted), tokens per round, and how many prompts gave exactly
target-only's output.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import (
    ALL_CATEGORIES,
    DEFAULT_RESULTS_DIR,
    DEFAULT_SPEC_BENCH,
    grouped_bars,
    machine_info,
    machine_line,
    markdown_table,
    new_figure,
    save_figure,
    timed,
    write_json,
    write_markdown,
)


def measure(target: Any, draft: Any, prompts: Sequence[list[int]], methods: Sequence[str], max_new_tokens: int,
            samplings: dict[str, Any], k: int, stop_ids: frozenset[int] = frozenset(), adaptive_k: bool = True,
            structured: Any = None, name: str = "settings") -> list[dict[str, Any]]:
    """One row per prompt, setting and run: target-only first, then each method (rotating).
    ``samplings``: setting name -> its SamplingParams; ``structured``: the target's StructuredOutput (for
    settings with a response format)."""
    from tandem.inprocess import GenerationRequest, SpeculativeGenerator
    from tandem.spec.options import SpecOptions

    settings = list(samplings)
    generators = {"none": SpeculativeGenerator(target, None, SpecOptions("none", 0), structured=structured)}
    for listed in methods:  # one generator per method, kept for the run: its cost model stays warm
        method = listed.removesuffix(UNFORCED)  # "-unforced": without proposing what a grammar forces
        generators[listed] = SpeculativeGenerator(
            target, None if method == "ngram" else draft,
            SpecOptions(method, k, adaptive_k, hybrid_min_match=3, forced_proposals=listed == method),
            structured=structured)

    def one(i: int, setting: str, method: str) -> dict[str, Any]:
        request = GenerationRequest(list(prompts[i]), max_new_tokens, samplings[setting], stop_ids)
        (result,), seconds = timed(lambda: generators[method].generate([request]))
        stats = result.stats
        return {"prompt": i, "setting": setting, "method": method, "tokens": len(result.token_ids),
                "token_ids": result.token_ids, "seconds": seconds, "drafted": stats.drafted,
                "accepted": stats.accepted, "rounds": stats.rounds, "forced": stats.forced_tokens}

    from tqdm import tqdm

    rows = []
    for i in tqdm(range(len(prompts)), desc=name, unit="prompt", file=sys.stderr):
        shift = i % len(settings)  # which setting goes first turns too
        for setting in settings[shift:] + settings[:shift]:
            alone = one(i, setting, "none")
            rows.append(alone)
            shift = i % len(methods)
            for method in [*methods[shift:], *methods[:shift]]:
                row = one(i, setting, method)
                row["same_as_target_only"] = row["token_ids"] == alone["token_ids"]
                rows.append(row)
    return rows


def add_counts(summary: list[dict[str, Any]], rows: Sequence[dict[str, Any]], counts: dict[str, str]) -> None:
    """A script's own columns: ``counts`` maps a summary column to the run field it sums, per setting and method."""
    for entry in summary:
        method = "none" if entry["method"] == "target-only" else entry["method"]
        group = [r for r in rows if (r["setting"], r["method"]) == (entry["setting"], method)]
        for column, run_field in counts.items():
            entry[column] = sum(r[run_field] for r in group)


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per setting and method, over every prompt: tokens/s, ratio to target-only in that setting, acceptance."""
    out = []
    for setting in dict.fromkeys(r["setting"] for r in rows):
        alone = [r for r in rows if r["setting"] == setting and r["method"] == "none"]
        if not alone:
            continue
        base = sum(r["tokens"] for r in alone) / sum(r["seconds"] for r in alone)
        out.append({"setting": setting, "method": "target-only", "prompts": len(alone), "tokens_per_s": base,
                    "x_target_only": 1.0, "acceptance": None, "tokens_per_round": 1.0,
                    "same_as_target_only": len(alone)})
        for method in dict.fromkeys(r["method"] for r in rows if r["method"] != "none"):
            group = [r for r in rows if (r["setting"], r["method"]) == (setting, method)]
            tokens, seconds = sum(r["tokens"] for r in group), sum(r["seconds"] for r in group)
            drafted, accepted = sum(r["drafted"] for r in group), sum(r["accepted"] for r in group)
            out.append({"setting": setting, "method": method, "prompts": len(group), "tokens_per_s": tokens / seconds,
                        "x_target_only": tokens / seconds / base, "acceptance": accepted / drafted if drafted else None,
                        "tokens_per_round": tokens / max(1, sum(r["rounds"] for r in group)),
                        "same_as_target_only": sum(r["same_as_target_only"] for r in group)})
    return out


def report(rows: list[dict[str, Any]], summary: list[dict[str, Any]], settings: dict[str, Any], out: Path,
           name: str, title: str) -> str:
    """Write JSON, markdown and the chart; the markdown table."""
    machine = machine_info()
    columns = ["setting", "method", "prompts", "tokens_per_s", "x_target_only", "acceptance", "tokens_per_round",
               "same_as_target_only"]
    columns += [c for c in summary[0] if c not in columns]  # a script's own columns, added to the summary
    table = markdown_table(summary, columns)
    write_json(out, name, {"machine": machine, "settings": settings, "summary": summary,
                           "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]})
    write_markdown(out, name, title,
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{table}\n")
    fig, (ax,) = new_figure()
    methods = list(dict.fromkeys(s["method"] for s in summary))
    series = {setting: [next((s["x_target_only"] for s in summary if (s["setting"], s["method"]) == (setting, m)), 0.0)
                        for m in methods] for setting in dict.fromkeys(s["setting"] for s in summary)}
    grouped_bars(ax, methods, series, "tokens/s over target-only (same setting)")
    ax.set_title(title)
    save_figure(fig, out, name)
    return table


METHODS = ("draft", "hybrid", "ngram")
UNFORCED = "-unforced"  # a method's suffix: the same without proposing what a grammar forces
GRAMMAR_METHODS = (*METHODS, *(m + UNFORCED for m in METHODS))  # what scripts with grammars may run


def add_flags(parser: argparse.ArgumentParser, name: str, seed_help: str = "prompts chosen by it",
              prompts: bool = True, methods: Sequence[str] = METHODS) -> None:
    """The models, prompts, methods and output flags every script of this kind takes (seeded_sampling.py too);
    ``prompts`` False: a script with prompts of its own (no categories to choose); ``methods``: those it runs."""
    from tandem.cli.draft_flags import add_draft_flags

    parser.add_argument("--target", default="qwen-coder-1.5b", help="a catalog name or a model directory")
    parser.add_argument("--draft", default="qwen-coder-0.5b", help="a catalog name or a model directory")
    add_draft_flags(parser)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--methods", default=",".join(methods), help=f"comma-separated, of {', '.join(methods)}")
    if prompts:
        parser.add_argument("--categories", default=",".join(ALL_CATEGORIES),
                            help="HumanEval and Spec-Bench categories")
        parser.add_argument("--per-category", type=int, default=1)
        parser.add_argument("--seed", type=int, default=0, help=seed_help)
        parser.add_argument("--spec-bench", type=Path, default=DEFAULT_SPEC_BENCH)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="largest k (adaptive unless --fixed-k)")
    parser.add_argument("--fixed-k", action="store_true", help="always draft k tokens")
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    parser.add_argument("--name", default=name, help="file name of the results (without extension)")


def load(args: argparse.Namespace, methods: Sequence[str]) -> tuple[Path, Any, Any, Any, list[Any], frozenset[int]]:
    """The target (warm), the draft when a method needs it, the tokenizer, the chosen prompts and the stop ids:
    (target_dir, tokenizer, target, draft, prompts, stop_ids)."""
    from benchmarks.common import load_prompts

    target_dir, tokenizer, target, draft, stop_ids = load_models(args, methods)
    categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    prompts = load_prompts(categories, args.per_category, args.seed, args.spec_bench)
    return target_dir, tokenizer, target, draft, prompts, stop_ids


def load_models(args: argparse.Namespace, methods: Sequence[str]) -> tuple[Path, Any, Any, Any, frozenset[int]]:
    """(target_dir, tokenizer, target (warm), draft (when a method needs it), stop_ids)."""
    from benchmarks.runners import engine_config, resolve_model_dir
    from tandem.cli.draft_flags import draft_engine_options
    from tandem.engine import ModelEngine
    from tandem.tokenizer import check_same_tokenizer, load_tokenizer, stop_token_ids

    target_dir = resolve_model_dir(args.target, args.cache_dir)
    tokenizer = load_tokenizer(target_dir)
    target = ModelEngine.load(engine_config(target_dir, args.dtype))
    target.warmup()
    draft = None
    if set(methods) - {"ngram"}:
        draft_dir = resolve_model_dir(args.draft, args.cache_dir)
        check_same_tokenizer(tokenizer, target_dir, draft_dir)
        draft = ModelEngine.load(engine_config(draft_dir, args.dtype, draft_options=draft_engine_options(args)))
        draft.warmup()
    return target_dir, tokenizer, target, draft, frozenset(stop_token_ids(target_dir, tokenizer, target.config))


def run_settings(args: argparse.Namespace, methods: Sequence[str]) -> dict[str, Any]:
    """What every script of this kind records of its run."""
    from tandem.cli.draft_flags import draft_engine_options

    prompts = {name: getattr(args, name) for name in ("categories", "per_category", "seed") if hasattr(args, name)}
    return {"target": args.target, "draft": args.draft, "dtype": args.dtype, "methods": list(methods), **prompts,
            "max_new_tokens": args.max_new_tokens, "k": args.k, "adaptive_k": not args.fixed_k,
            "draft_options": draft_engine_options(args)}
