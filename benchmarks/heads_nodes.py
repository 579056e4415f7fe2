"""How many nodes should the heads' tree hold? One process, every node budget on the same prompts, side by side.

For each budget in --nodes (0: the cost rule of tandem/spec/heads_trees.py, from the target's fitted
forward cost) two variants run: with the payoff check (the heads asked while they measure faster,
as spec-eagle) and asked every round (as spec-eagle-always). Every variant and target-only run each
prompt back to back, in a rotating order, greedy, batch 1. Reported per variant, for humaneval and
the Spec-Bench mix: tokens/s, speedup over target-only, tokens a round, drafting ms a round, and
whether the output equals target-only's (it must).

Writes heads_nodes.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    ALL_CATEGORIES,
    DEFAULT_SPEC_BENCH,
    HUMANEVAL,
    grouped_bars,
    load_prompts,
    machine_info,
    machine_line,
    markdown_table,
    new_figure,
    save_figure,
    write_json,
    write_markdown,
)
from benchmarks.runners import RunOutput, engine_config, resolve_model_dir, run_ours  # noqa: E402
from tandem import model_store  # noqa: E402
from tandem.engine import ModelEngine  # noqa: E402
from tandem.heads.locate import resolve_heads  # noqa: E402
from tandem.heads.serving import load_drafter  # noqa: E402
from tandem.inprocess import SpeculativeGenerator  # noqa: E402
from tandem.spec.options import SpecOptions  # noqa: E402
from tandem.tokenizer import encode_prompt, load_tokenizer, stop_token_ids  # noqa: E402

MIX = "spec-bench-mix"


@dataclass
class Totals:
    """One variant over one group of prompts."""

    tokens: int = 0
    seconds: float = 0.0
    draft_s: float = 0.0
    rounds: int = 0
    outputs: dict[str, list[int]] = field(default_factory=dict)  # prompt id -> generated tokens

    def add(self, prompt_id: str, out: RunOutput, draft_s: float) -> None:
        self.tokens += len(out.token_ids)
        self.seconds += out.seconds
        self.draft_s += draft_s
        self.rounds += out.stats.rounds if out.stats is not None else 0
        self.outputs[prompt_id] = out.token_ids

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="qwen-coder-1.5b")
    parser.add_argument("--heads", default="qwen-coder-1.5b-eagle-answers", help="heads: a path or a cached name")
    parser.add_argument("--nodes", default="0,2,3,4,8", help="comma-separated budgets; 0: the cost rule")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    parser.add_argument("--per-category", type=int, default=1)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="which prompts of each category")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--cache-dir", default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    budgets = [int(n) for n in args.nodes.split(",")]

    target_dir = resolve_model_dir(args.target, args.cache_dir)
    tokenizer = load_tokenizer(target_dir)
    target = ModelEngine.load(engine_config(target_dir, args.dtype, "auto"))
    stop = stop_token_ids(target_dir, tokenizer, target.config)
    heads = load_drafter(resolve_heads(args.heads, model_store.cache_root_from(args.cache_dir, os.environ)), target)
    variants = {"target-only": SpeculativeGenerator(target, None, SpecOptions("none", 0))}
    for n in budgets:
        label = "cost rule" if n == 0 else f"{n} nodes"
        for adaptive, way in ((True, "payoff"), (False, "always")):
            variants[f"{way}, {label}"] = SpeculativeGenerator(
                target, None, SpecOptions(heads.kind, 4, adaptive, heads_nodes=n), heads=heads)

    prompts = load_prompts(ALL_CATEGORIES, args.per_category, args.seed, DEFAULT_SPEC_BENCH)
    encoded = [encode_prompt(tokenizer, p.text, chat=True) for p in prompts]
    run_ours(variants["target-only"], encoded[0], 4, stop)  # warm-up
    names = list(variants)
    totals = {(name, group): Totals() for name in names for group in (HUMANEVAL, MIX)}
    for i, (prompt, ids) in enumerate(zip(prompts, encoded)):
        group = HUMANEVAL if prompt.category == HUMANEVAL else MIX
        for name in names[i % len(names):] + names[: i % len(names)]:  # a rotating order: noise hits all alike
            before = heads.seconds
            out = run_ours(variants[name], ids, args.max_new_tokens, stop)
            totals[(name, group)].add(prompt.prompt_id, out, heads.seconds - before)
        print(f"{i + 1}/{len(prompts)} {prompt.category} done", flush=True)

    records = []
    for group in (HUMANEVAL, MIX):
        plain = totals[("target-only", group)]
        for name in names:
            t = totals[(name, group)]
            heads_run = name != "target-only" and t.rounds > 0
            records.append({
                "variant": name, "prompts": group, "tokens_per_s": round(t.rate, 2),
                "x_target_only": round(t.rate / plain.rate, 3),
                "tokens_per_round": round(t.tokens / t.rounds, 2) if heads_run else None,
                "draft_ms_per_round": round(1e3 * t.draft_s / t.rounds, 1) if heads_run else None,
                "same_as_target_only": t.outputs == plain.outputs,
            })
    info = machine_info()
    write_json(args.out, "heads_nodes", {"machine": info, "args": vars(args), "records": records})
    columns = ["variant", "prompts", "tokens_per_s", "x_target_only", "tokens_per_round", "draft_ms_per_round",
               "same_as_target_only"]
    body = (f"{machine_line(info)}\n\n`{args.target}` {args.dtype}, heads `{args.heads}`, "
            f"{args.per_category} prompt(s) per category, {args.max_new_tokens} tokens, greedy.\n\n"
            + markdown_table(records, columns))
    write_markdown(args.out, "heads_nodes", "Heads' node budget, side by side", body)
    fig, (ax,) = new_figure(width=9.0)
    heads_names = [n for n in names if n != "target-only"]
    grouped_bars(ax, heads_names, {group: [r["x_target_only"] for r in records if r["prompts"] == group
                                           and r["variant"] != "target-only"] for group in (HUMANEVAL, MIX)},
                 "x target-only")
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_title(f"heads' node budget, {info['cpu']}", fontsize="small")
    save_figure(fig, args.out, "heads_nodes")
    print(markdown_table(records, columns))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
