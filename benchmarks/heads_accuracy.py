"""How often speculation heads guess what the target says, on the benchmark's own answers.

`tandem heads train` reports its heads' accuracy on held-back pieces of its training corpus.
What decides their speed is their accuracy on what the target is asked to write. This measures
that directly, without the noise and the tree of a timed run: for each prompt of spec_bench's
categories, the target's own greedy answer (target-only decoding); then one forward over
prompt + answer gives, per position, the features the heads read and the target's label (its
argmax), exactly as training's feature pass does; each head (or EAGLE draft step) is scored on
the positions whose guess lies inside the answer and is a token a head would draft (the first
answer token is the target's own). Top-1 and top-3 per category, head and step (a label outside
a head's draft vocabulary counts as a miss, as the training summary counts them; ``in_draft_vocab``
is the share of labels the head can say at all).

The serving side adds what this leaves out: trees (several guesses per depth), the n-gram
branch, and what a round costs (`benchmarks/spec_bench.py` measures those).

Writes heads_accuracy.{json,md,png} into --out.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/heads_accuracy.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    ALL,
    ALL_CATEGORIES,
    DEFAULT_RESULTS_DIR,
    DEFAULT_SPEC_BENCH,
    HUMANEVAL,
    MIX,
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

NAME = "heads_accuracy"
TOP_K = (1, 3)
COLUMNS = ["heads", "category", "step", "positions", "in_draft_vocab", "top1", "top3"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="heads_accuracy.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen-coder-1.5b", help="target model (default: %(default)s)")
    p.add_argument("--heads", action="append", required=True, metavar="PATH|NAME",
                   help="heads to score (repeat to compare several on the same answers)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="the target's dtype; heads run under bf16 autocast when bf16 (default: %(default)s)")
    p.add_argument("--steps", type=int, default=3, help="EAGLE draft steps scored (default: %(default)s)")
    p.add_argument("--categories", nargs="+", default=list(ALL_CATEGORIES), choices=ALL_CATEGORIES)
    p.add_argument("--per-category", type=int, default=1, help="prompts per category (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="answer length (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="prompt sample, as spec_bench's (default: %(default)s)")
    p.add_argument("--spec-bench", type=Path, default=DEFAULT_SPEC_BENCH)
    p.add_argument("--cache-dir", default=None, help="model cache root (default: $TANDEM_HOME or ~/.cache/tandem)")
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    return p


def answer_rows(num_rows: int, ahead: int, prompt_len: int, seq_len: int) -> Any:  # [R] bool
    """Which prediction rows to score: row ``t`` guesses the label at ``t + ahead``, the target's token
    ``t + ahead + 1``; scored when that token is in the answer and is not its first (the target's own)."""
    import torch

    label_index = torch.arange(num_rows) + ahead
    return (label_index >= prompt_len) & (label_index <= seq_len - 2)


def measure(args: argparse.Namespace) -> list[dict[str, Any]]:
    import torch

    from benchmarks.runners import engine_config, resolve_model_dir, run_ours
    from tandem import model_store
    from tandem.engine import FeatureSpec, ForwardItem, ModelEngine
    from tandem.heads.fingerprint import target_fingerprint
    from tandem.heads.locate import resolve_heads
    from tandem.heads.store import load_heads
    from tandem.heads.train.eagle_train import EagleObjective
    from tandem.heads.train.medusa_train import MedusaObjective
    from tandem.heads.train.shards import Batch
    from tandem.heads.train.vocab import OUT_OF_VOCAB, target_to_draft
    from tandem.inprocess import SpeculativeGenerator
    from tandem.spec.options import SpecOptions
    from tandem.tokenizer import encode_prompt, load_tokenizer, stop_token_ids

    target_dir = resolve_model_dir(args.target, args.cache_dir)
    tokenizer = load_tokenizer(target_dir)
    target = ModelEngine.load(engine_config(target_dir, args.dtype, "auto"))
    stop_ids = stop_token_ids(target_dir, tokenizer, target.config)
    plain = SpeculativeGenerator(target, None, SpecOptions("none", 0))
    root = model_store.cache_root_from(args.cache_dir, os.environ)
    embed = target.model.embed_tokens.weight.detach()  # [vocab, H], rows cast by the objective as it reads them
    fingerprint = target_fingerprint(target.model)
    scored = []  # (name, objective, streams)
    for spec in args.heads:
        heads = load_heads(resolve_heads(spec, root), torch.float32, torch.device("cpu"),
                           target_num_layers=target.config.num_layers)
        heads.config.check_target(target.config, fingerprint, spec)
        t2d = target_to_draft(heads.d2t, target.config.vocab_size)
        objective = (MedusaObjective(heads, t2d) if heads.config.kind == "medusa"  # type: ignore[arg-type]
                     else EagleObjective(heads, t2d, embed, args.steps))  # type: ignore[arg-type]
        scored.append((spec, objective, tuple(heads.config.feature_streams)))

    prompts = load_prompts(args.categories, args.per_category, args.seed, args.spec_bench)
    hits: dict[tuple[str, str, str], list[int]] = defaultdict(lambda: [0, 0, 0, 0])  # positions, top1, top3, sayable
    for n, prompt in enumerate(prompts, 1):
        ids = encode_prompt(tokenizer, prompt.text, chat=True)
        answer = run_ours(plain, ids, args.max_new_tokens, stop_ids).token_ids
        seq = ids + answer
        features: dict[tuple[int, ...], torch.Tensor] = {}  # one forward per set of streams the heads read
        for streams in dict.fromkeys(streams for _, _, streams in scored):
            item = ForwardItem(("heads-accuracy", n), seq, num_logits=len(seq), features=True)
            try:
                logits, feats = target.forward_with_features([item], FeatureSpec(streams))
            finally:
                target.release(item.seq_id)
            features[streams] = feats[0]  # type: ignore[assignment]
        labels = logits[0].argmax(dim=-1)  # [N] the target's own next tokens (the same from every forward)
        batch_of = {s: Batch(torch.tensor([seq]), labels[None].long(), f[None].to(torch.bfloat16),
                             torch.tensor([len(seq)])) for s, f in features.items()}
        for name, objective, streams in scored:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.dtype == "bfloat16"):
                predictions = objective.predictions(batch_of[streams])
            for step, (step_name, (logits, draft)) in enumerate(zip(objective.names, predictions), 1):
                keep = answer_rows(draft.numel(), step, len(ids), len(seq))
                guesses = logits[keep].topk(max(TOP_K), dim=-1).indices  # [R, 3] draft ids
                found = guesses == draft[keep][:, None]  # out-of-vocabulary labels (-100) never match
                for category in (prompt.category, ALL, *([MIX] if prompt.category != HUMANEVAL else [])):
                    cell = hits[(name, category, step_name)]
                    cell[0] += int(keep.sum())
                    cell[1] += int(found[:, :1].any(dim=-1).sum())
                    cell[2] += int(found[:, :3].any(dim=-1).sum())
                    cell[3] += int((draft[keep] != OUT_OF_VOCAB).sum())
        print(f"[{n}/{len(prompts)}] {prompt.category}: {len(ids)} prompt + {len(answer)} answer tokens",
              file=sys.stderr, flush=True)
    order = [*args.categories, MIX, ALL]
    return [{"heads": name, "category": category, "step": step, "positions": p,
             "in_draft_vocab": sayable / p if p else None, "top1": t1 / p if p else None,
             "top3": t3 / p if p else None}
            for (name, category, step), (p, t1, t3, sayable) in sorted(hits.items(), key=lambda kv: (
                args.heads.index(kv[0][0]), order.index(kv[0][1]), kv[0][2]))]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    rows = measure(args)
    info = machine_info()
    write_json(args.out, NAME, {"settings": vars(args), "machine": info, "rows": rows})
    body = f"{machine_line(info)}\n\n{markdown_table(rows, COLUMNS)}\n"
    write_markdown(args.out, NAME, "Speculation heads: accuracy on the target's own benchmark answers", body)
    fig, (ax,) = new_figure(width=9.0)
    first = [r for r in rows if r["step"] == rows[0]["step"]]  # step 1 / head 1 of every head
    categories = list(dict.fromkeys(r["category"] for r in first))
    series = {name: [next((100 * r["top1"] for r in first if r["heads"] == name and r["category"] == c
                           and r["top1"] is not None), None) for c in categories] for name in args.heads}
    grouped_bars(ax, categories, series, f"{rows[0]['step']}: top-1 %")
    save_figure(fig, args.out, NAME)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
