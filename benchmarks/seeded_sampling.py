"""Seeded sampling with speculation: the rejection rule against the target's own seeded draws, side by side.

A seeded request (temperature > 0) is verified in one of two ways (tandem.spec.rejection):

  exact           the target keeps its own seeded draw at each position; drafts equal to it are kept.
                  Output = plain seeded decoding's, whatever was proposed (the default for seeded requests)
  rejection-rule  Leviathan/Chen rejection sampling (SamplingOptions.rejection_rule): lossless too, but
                  its draws depend on the rounds, so the output differs from plain seeded decoding's

Both are lossless; what this measures is what exactness costs. Per prompt, plain seeded
decoding (method none) runs first and is the reference; then every method under each rule,
in a rotating order. Reported per method and rule, over all prompts: tokens/s and its ratio
to plain seeded decoding's, acceptance (kept / drafted), tokens per round, and how many
prompts gave exactly the plain seeded output.

Writes seeded_sampling.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/seeded_sampling.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    grouped_bars,
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
from benchmarks.sampling_settings import METHODS, add_flags, load, run_settings  # noqa: E402

NAME = "seeded_sampling"
RULES = ("exact", "rejection-rule")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_flags(parser, NAME, seed_help="prompt i is sampled with seed + i; prompts chosen by it")
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=0.95)
    return parser


def methods_from(text: str) -> list[str]:
    return names_from(text, METHODS)


def measure(target: Any, draft: Any, prompts: Sequence[list[int]], methods: Sequence[str], max_new_tokens: int,
            temperature: float, top_p: float, seed: int, k: int, stop_ids: frozenset[int] = frozenset(),
            adaptive_k: bool = True) -> list[dict[str, Any]]:
    """One row per prompt and run: plain seeded decoding first, then each method under each rule (rotating)."""
    from tandem.inprocess import GenerationRequest, SpeculativeGenerator
    from tandem.sampling import SamplingParams
    from tandem.spec.options import SpecOptions

    generators = {"none": SpeculativeGenerator(target, None, SpecOptions("none", 0))}
    for method in methods:  # one generator per method, kept for the run: its cost model stays warm
        generators[method] = SpeculativeGenerator(target, None if method == "ngram" else draft,
                                                  SpecOptions(method, k, adaptive_k, hybrid_min_match=3))
    def one(i: int, method: str, rule: str) -> dict[str, Any]:
        """Prompt ``i`` sampled with seed + i, by ``method`` under ``rule``."""
        sampling = SamplingParams(temperature, top_p, seed=seed + i, rejection_rule=rule == "rejection-rule")
        request = GenerationRequest(list(prompts[i]), max_new_tokens, sampling, stop_ids)
        (result,), seconds = timed(lambda: generators[method].generate([request]))
        stats = result.stats
        return {"prompt": i, "method": method, "rule": rule, "tokens": len(result.token_ids),
                "token_ids": result.token_ids, "seconds": seconds, "drafted": stats.drafted,
                "accepted": stats.accepted, "rounds": stats.rounds}

    from tqdm import tqdm

    runs = [(m, rule) for m in methods for rule in RULES]
    rows = []
    for i in tqdm(range(len(prompts)), desc=NAME, unit="prompt", file=sys.stderr):
        plain = one(i, "none", "exact")
        rows.append(plain)
        shift = i % len(runs)
        for method, rule in runs[shift:] + runs[:shift]:
            row = one(i, method, rule)
            row["same_as_plain"] = row["token_ids"] == plain["token_ids"]
            rows.append(row)
    return rows


def summarize(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per method and rule, over every prompt: tokens/s, ratio to plain seeded decoding, acceptance, sameness."""
    plain = [r for r in rows if r["method"] == "none"]
    plain_rate = sum(r["tokens"] for r in plain) / sum(r["seconds"] for r in plain)
    out = [{"method": "none", "rule": "-", "prompts": len(plain), "tokens_per_s": plain_rate, "x_plain": 1.0,
            "acceptance": None, "tokens_per_round": 1.0, "same_as_plain": len(plain)}]
    keys = dict.fromkeys((r["method"], r["rule"]) for r in rows if r["method"] != "none")
    for method, rule in keys:
        group = [r for r in rows if (r["method"], r["rule"]) == (method, rule)]
        tokens, seconds = sum(r["tokens"] for r in group), sum(r["seconds"] for r in group)
        drafted, accepted = sum(r["drafted"] for r in group), sum(r["accepted"] for r in group)
        out.append({"method": method, "rule": rule, "prompts": len(group), "tokens_per_s": tokens / seconds,
                    "x_plain": tokens / seconds / plain_rate, "acceptance": accepted / drafted if drafted else None,
                    "tokens_per_round": tokens / max(1, sum(r["rounds"] for r in group)),
                    "same_as_plain": sum(r["same_as_plain"] for r in group)})
    return out


def report(rows: list[dict[str, Any]], summary: list[dict[str, Any]], settings: dict[str, Any], out: Path,
           name: str) -> str:
    """Write JSON, markdown and the chart; the markdown table."""
    machine = machine_info()
    columns = ["method", "rule", "prompts", "tokens_per_s", "x_plain", "acceptance", "tokens_per_round",
               "same_as_plain"]
    table = markdown_table(summary, columns)
    write_json(out, name, {"machine": machine, "settings": settings, "summary": summary,
                           "runs": [{k: v for k, v in r.items() if k != "token_ids"} for r in rows]})
    write_markdown(out, name, "Seeded sampling: exact seeded draws against the rejection rule",
                   f"{machine_line(machine)}\n\nSettings: `{settings}`\n\n{table}\n")
    fig, (ax,) = new_figure()
    methods = [s["method"] for s in summary if s["rule"] == RULES[0]]
    series = {rule: [next(s["x_plain"] for s in summary if (s["method"], s["rule"]) == (m, rule)) for m in methods]
              for rule in RULES}
    grouped_bars(ax, methods, series, "tokens/s over plain seeded decoding")
    ax.set_title("seeded sampling, batch 1")
    save_figure(fig, out, name)
    return table


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    methods = methods_from(args.methods)
    from tandem.tokenizer import encode_prompt

    _, tokenizer, target, draft, prompts, stop_ids = load(args, methods)
    encoded = [encode_prompt(tokenizer, p.text, chat=True) for p in prompts]
    print(f"[{NAME}] {len(encoded)} prompts x (1 + {len(methods) * len(RULES)}) runs", file=sys.stderr, flush=True)
    rows = measure(target, draft, encoded, methods, args.max_new_tokens, args.temperature, args.top_p, args.seed,
                   args.k, stop_ids, adaptive_k=not args.fixed_k)
    settings = {**run_settings(args, methods), "temperature": args.temperature, "top_p": args.top_p}
    print(report(rows, summarize(rows), settings, args.out, args.name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
