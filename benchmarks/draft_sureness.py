"""How sure the draft is, against what the target keeps: the evidence behind the draft's stop rule.

The draft stops drafting once the product of its top probabilities along the chain falls below the
loop's ``stop_below`` (``tandem.spec.adaptive.stop_below``). That product stands for the chance that
the target keeps the whole chain. This measures how well one factor of it predicts one position.

For each prompt the target writes its greedy answer; then both models read prompt and answer once,
and at every answer position the draft's next-token distribution ``q`` is compared with the
target's ``p``:

  greedy kept        whether the draft's top token is the target's (what greedy verification keeps)
  sampled kept       sum over x of min(p_T(x), q_T(x)) at --temperature T: the chance that the
                     rejection rule keeps the draft's sampled token there (both sides sample at T)

Positions are binned by the draft's top probability at temperature 1, the number the stop rule
multiplies (``draft_worker.engine``, ``_note_sureness``). Reported per bin: positions, the share
kept greedy, the mean kept sampled. Answers are the target's greedy ones at both settings, so the
positions are the same; a sampled answer's contexts differ a little.

Writes draft_sureness.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    ALL_CATEGORIES,
    DEFAULT_RESULTS_DIR,
    DEFAULT_SPEC_BENCH,
    load_prompts,
    machine_info,
    machine_line,
    markdown_table,
    new_figure,
    save_figure,
    write_json,
    write_markdown,
)
from tandem.cli.draft_flags import add_draft_flags, draft_engine_options  # noqa: E402

NAME = "draft_sureness"
EDGES = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 1.0 + 1e-9)  # bins of the draft's top probability
COLUMNS = ["draft top probability", "positions", "greedy kept", "sampled kept"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="draft_sureness.py", description=__doc__.split("\n\n")[0], epilog=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen-coder-1.5b", help="target model (default: %(default)s)")
    p.add_argument("--draft", default="qwen-coder-0.5b", help="draft model (default: %(default)s)")
    add_draft_flags(p)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="the target's dtype (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=0.7,
                   help="the sampled setting's temperature (default: %(default)s)")
    p.add_argument("--categories", default=",".join(ALL_CATEGORIES),
                   help="comma-separated prompt categories (default: %(default)s)")
    p.add_argument("--per-category", type=int, default=2, help="prompts per category (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="answer tokens per prompt (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt sample (default: %(default)s)")
    p.add_argument("--spec-bench", type=Path, default=DEFAULT_SPEC_BENCH, help="Spec-Bench question.jsonl")
    p.add_argument("--cache-dir", default=None, help="Tandem model cache root (default: $TANDEM_HOME)")
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR, help="results directory (default: %(default)s)")
    p.add_argument("--name", default=NAME, help="file name of the results, without extension (default: %(default)s)")
    return p


def check_args(args: argparse.Namespace) -> argparse.Namespace:
    if not 0 < args.temperature < float("inf"):
        raise SystemExit(f"--temperature must be positive and finite, got {args.temperature}")
    if min(args.per_category, args.max_new_tokens) <= 0:
        raise SystemExit("--per-category and --max-new-tokens must be positive")
    args.categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    return args


def position_rows(target_logits: Any, draft_logits: Any, temperature: float) -> list[dict[str, float]]:
    """Per answer position: the draft's top probability, whether its top token is the target's, and the chance
    the rejection rule keeps its token sampled at ``temperature``. Logits ``[n, vocab]`` float32, target first;
    a draft with a smaller vocabulary (a lean one) proposes only its own ids: the target's mass beyond them is
    never matched."""
    import torch

    width = draft_logits.shape[-1]
    q1 = torch.softmax(draft_logits, dim=-1)  # [n, Vd]
    top, best = q1.max(dim=-1)
    p_t = torch.softmax(target_logits / temperature, dim=-1)[:, :width]  # [n, Vd]
    q_t = torch.softmax(draft_logits / temperature, dim=-1)
    kept = torch.minimum(p_t, q_t).sum(dim=-1)  # [n]
    greedy = best == target_logits.argmax(dim=-1)
    return [{"top": float(a), "greedy_kept": bool(g), "sampled_kept": float(s)}
            for a, g, s in zip(top.tolist(), greedy.tolist(), kept.tolist())]


def bins(rows: list[dict[str, float]]) -> list[dict[str, Any]]:
    out = []
    for low, high in zip(EDGES, EDGES[1:]):
        inside = [r for r in rows if low <= r["top"] < high]
        label = f"{low:g} and above" if high > 1.0 else f"{low:g}-{high:g}"
        out.append({"draft top probability": label, "positions": len(inside),
                    "greedy kept": sum(r["greedy_kept"] for r in inside) / len(inside) if inside else None,
                    "sampled kept": sum(r["sampled_kept"] for r in inside) / len(inside) if inside else None})
    return out


def measure(args: argparse.Namespace) -> list[dict[str, float]]:
    from tqdm import tqdm

    from benchmarks.runners import engine_config, resolve_model_dir
    from tandem.engine import ForwardItem, ModelEngine
    from tandem.inprocess import GenerationRequest, SpeculativeGenerator
    from tandem.sampling import SamplingParams
    from tandem.spec.options import SpecOptions
    from tandem.tokenizer import encode_prompt, load_tokenizer, stop_token_ids

    target_dir = resolve_model_dir(args.target, args.cache_dir)
    draft_dir = resolve_model_dir(args.draft, args.cache_dir)
    tokenizer = load_tokenizer(target_dir)
    target = ModelEngine.load(engine_config(target_dir, args.dtype))
    draft = ModelEngine.load(engine_config(draft_dir, args.dtype, draft_options=draft_engine_options(args)))
    stops = frozenset(stop_token_ids(target_dir, tokenizer, target.config))
    writer = SpeculativeGenerator(target, None, SpecOptions("none", 0))
    prompts = load_prompts(args.categories, args.per_category, args.seed, args.spec_bench)
    rows: list[dict[str, float]] = []
    for prompt in tqdm(prompts, desc=NAME, unit="prompt", file=sys.stderr):
        ids = encode_prompt(tokenizer, prompt.text, chat=True)
        [answer] = writer.generate([GenerationRequest(ids, args.max_new_tokens, SamplingParams(), stops)])
        tokens = answer.token_ids
        if not tokens:
            continue
        logits = []
        for engine in (target, draft):  # the rows that predict each answer token: [len(tokens), vocab]
            [out] = engine.forward([ForwardItem("read", [*ids, *tokens], num_logits=len(tokens) + 1, prompt=True)])
            engine.release("read")
            logits.append(out[:-1].float())
        for row in position_rows(*logits, args.temperature):
            rows.append({**row, "category": prompt.category})
    return rows


def chart(table: list[dict[str, Any]], temperature: float, out: Path, name: str) -> Path:
    fig, (ax,) = new_figure()
    labels = [r["draft top probability"] for r in table]
    for key, label in (("greedy kept", "greedy: the draft's top token is the target's"),
                       ("sampled kept", f"sampled at T={temperature:g}: chance the rejection rule keeps it")):
        ax.plot(labels, [r[key] if r[key] is not None else float("nan") for r in table], marker="o", label=label)
    ax.set_xlabel("the draft's top probability (temperature 1)")
    ax.set_ylabel("kept")
    ax.set_ylim(0, 1.05)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("How sure the draft is, against what the target keeps")
    return save_figure(fig, out, name)


def main(argv: list[str] | None = None) -> int:
    args = check_args(build_parser().parse_args(argv))
    rows = measure(args)
    table = bins(rows)
    settings = {"target": args.target, "draft": args.draft, "dtype": args.dtype, "temperature": args.temperature,
                "categories": args.categories, "per_category": args.per_category,
                "max_new_tokens": args.max_new_tokens, "draft_options": draft_engine_options(args)}
    machine = machine_info()
    text = markdown_table(table, COLUMNS)
    body = f"Settings: `{settings}`\n\n{machine_line(machine)}\n\n{len(rows)} answer positions.\n\n{text}"
    paths = [write_json(args.out, args.name, {"settings": settings, "machine": machine, "bins": table,
                                              "positions": rows}),
             write_markdown(args.out, args.name, "How sure the draft is, against what the target keeps", body),
             chart(table, args.temperature, args.out, args.name)]
    print(text)
    print(machine_line(machine))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
