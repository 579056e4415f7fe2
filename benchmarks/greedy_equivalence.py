"""Greedy speculative output against target-only output on the real pair, token for token.

For each dtype (float32, bfloat16) and each prompt (HumanEval and Spec-Bench,
chat template), decode greedily with the target alone and with draft-model
speculation (fixed k, so that every round verifies k+1 tokens at once), and
count the prompts whose token ids differ, with the first differing position.

This is a correctness measurement, not a speed one: in float32 every prompt
must match; in bfloat16 our batch-invariant kernels (RowStableLinear, row-wise
attention) are meant to make it match too, where a plain implementation flips
near-ties now and then.

Writes greedy_equivalence.json / .md into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tqdm import tqdm  # noqa: E402

from benchmarks.common import DEFAULT_SPEC_BENCH, load_prompts, markdown_table, write_json, write_markdown  # noqa: E402
from benchmarks.runners import engine_config, resolve_model_dir, run_ours  # noqa: E402
from tandem.cli.draft_flags import add_draft_flags, draft_engine_options  # noqa: E402
from tandem.pipeline import LocalPipeline  # noqa: E402
from tandem.spec.options import SpecOptions  # noqa: E402
from tandem.tokenizer import encode_prompt  # noqa: E402

CATEGORIES = ("humaneval", "mt_bench", "translation", "summarization", "qa", "math_reasoning", "rag")


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(args: argparse.Namespace, dtype: str, prompts: list) -> dict:
    target_dir, draft_dir = resolve_model_dir(args.target), resolve_model_dir(args.draft)
    pipeline = LocalPipeline.load(engine_config(target_dir, dtype), "draft",
                                  SpecOptions("draft", args.k, adaptive_k=False),
                                  engine_config(draft_dir, dtype, draft_options=draft_engine_options(args)))
    spec_gen = pipeline.generator()
    plain_gen = pipeline.generator(options=SpecOptions("none", 0))
    rows = []
    for prompt in tqdm(prompts, desc=f"greedy equivalence {dtype}", unit="prompt"):
        ids = encode_prompt(pipeline.tokenizer, prompt.text, chat=True)
        plain = run_ours(plain_gen, ids, args.max_new_tokens, pipeline.stop_ids, k_max=0)
        spec = run_ours(spec_gen, ids, args.max_new_tokens, pipeline.stop_ids, k_max=args.k, adaptive_k=False)
        diff = first_difference(plain.token_ids, spec.token_ids)
        rows.append({"dtype": dtype, "prompt": prompt.prompt_id, "category": prompt.category,
                     "tokens": len(plain.token_ids), "identical": diff is None, "first_difference": diff,
                     "drafted": spec.stats.drafted, "accepted": spec.stats.accepted})
    del pipeline, spec_gen, plain_gen
    gc.collect()
    return {"dtype": dtype, "prompts": len(rows), "identical": sum(r["identical"] for r in rows), "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen-coder-1.5b")
    p.add_argument("--draft", default="qwen-coder-0.5b")
    add_draft_flags(p)
    p.add_argument("--prompts", type=int, default=21, help="total prompts, spread over the categories (default: 21)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--spec-bench", type=Path, default=DEFAULT_SPEC_BENCH)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args(argv)
    per_category = max(1, -(-args.prompts // len(CATEGORIES)))
    prompts = load_prompts(CATEGORIES, per_category, 0, args.spec_bench)[: args.prompts]
    results = [compare(args, dtype, prompts) for dtype in args.dtypes.split(",")]
    summary = [{"dtype": r["dtype"], "prompts": r["prompts"], "identical": r["identical"],
                "differing": r["prompts"] - r["identical"],
                "tokens_compared": sum(row["tokens"] for row in r["rows"]),
                "accepted/drafted": f"{sum(x['accepted'] for x in r['rows'])}/{sum(x['drafted'] for x in r['rows'])}"}
               for r in results]
    columns = ["dtype", "prompts", "identical", "differing", "tokens_compared", "accepted/drafted"]
    table = markdown_table(summary, columns)
    differing = [row for r in results for row in r["rows"] if not row["identical"]]
    detail = markdown_table(differing, ["dtype", "prompt", "category", "first_difference"]) if differing else \
        "Every prompt identical."
    print(table)
    print(detail)
    write_json(args.out, "greedy_equivalence", {"args": {k: str(v) for k, v in vars(args).items()},
                                                "summary": summary, "results": results})
    write_markdown(args.out, "greedy_equivalence", "Greedy equivalence, speculative vs target-only",
                   table + "\n\n" + detail)
    return 0


if __name__ == "__main__":
    sys.exit(main())
