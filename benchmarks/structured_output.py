"""Does speculation pay under a JSON grammar? Greedy JSON answers, free and constrained, side by side.

Every prompt asks for its answer as a JSON object. Two settings on the same prompts: ``free`` (the
model answers as it likes: often a code fence around JSON, or prose) and ``json`` (``response_format``
json_object: the target masks every verified row to what the grammar allows after that row's path,
tandem.structured_output). Drafts are not constrained: a draft model or an n-gram lookup proposes
freely, and the target turns down what the grammar refuses. What this measures is what the grammar
costs speculation, and what its masks cost a forward. With ``--settings ...,schema``, a third:
``response_format`` json_schema with ``SCHEMA``, whose keys the prompts do not name, so the grammar
forces them; with ``--methods ...,ngram-unforced`` a method runs without proposing what the grammar
forces too, side by side.

Per prompt and setting, target-only runs first and is the reference, then each method in a rotating
order. Reported per setting and method: tokens/s and its ratio to target-only under the same setting,
acceptance, tokens per round, how many prompts gave exactly target-only's output, and (json) how many
answers parse as a JSON object.

Writes structured_output.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/structured_output.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import names_from  # noqa: E402
from benchmarks.sampling_settings import (  # noqa: E402
    GRAMMAR_METHODS,
    METHODS,
    add_counts,
    add_flags,
    load,
    measure,
    report,
    run_settings,
    summarize,
)

NAME = "structured_output"
TITLE = "Speculation under a JSON grammar: greedy, free and constrained"
ASK = " Answer with a JSON object."  # appended to every prompt: every setting is asked for JSON
# The schema setting's: keys the prompt does not name, so the grammar forces them (GRAMMAR proposals).
SCHEMA = {"type": "object", "properties": {
    "topic": {"type": "string", "maxLength": 60}, "answer": {"type": "string", "maxLength": 160},
    "key_points": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3},
    "confidence": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["topic", "answer", "key_points", "confidence"], "additionalProperties": False}
SETTINGS = ("free", "json", "schema")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_flags(parser, NAME, methods=GRAMMAR_METHODS)
    parser.set_defaults(methods=",".join(METHODS))  # -unforced ones when asked
    parser.add_argument("--settings", default="free,json", help=f"comma-separated, of {', '.join(SETTINGS)} "
                        "(schema: SCHEMA, whose keys the prompts do not name)")
    return parser


def parses(text: str) -> bool:
    """Whether ``text`` is one JSON object (what json_object promises of a finished answer)."""
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    methods = names_from(args.methods, GRAMMAR_METHODS)
    chosen = names_from(args.settings, SETTINGS, "--settings")
    from tandem.sampling import SamplingParams
    from tandem.structured_output import StructuredOutput
    from tandem.tokenizer import encode_prompt

    target_dir, tokenizer, target, draft, prompts, stop_ids = load(args, methods)
    encoded = [encode_prompt(tokenizer, p.text + ASK, chat=True) for p in prompts]
    every = {"free": SamplingParams(), "json": SamplingParams(json_object=True),
             "schema": SamplingParams(json_schema=json.dumps(SCHEMA))}
    samplings = {name: every[name] for name in chosen}
    print(f"[{NAME}] {len(encoded)} prompts x {len(samplings)} settings x (1 + {len(methods)}) runs", file=sys.stderr,
          flush=True)
    rows = measure(target, draft, encoded, methods, args.max_new_tokens, samplings, args.k, stop_ids,
                   adaptive_k=not args.fixed_k, structured=StructuredOutput(target_dir, target.config), name=NAME)
    for row in rows:
        text = tokenizer.decode(row["token_ids"], skip_special_tokens=True)
        row["json_object"] = parses(text)
        row["finished"] = bool(row["token_ids"]) and row["token_ids"][-1] in stop_ids
    summary = summarize(rows)
    add_counts(summary, rows, {"finished": "finished", "parse_as_object": "json_object", "forced_kept": "forced"})
    settings = {**run_settings(args, methods), "ask": ASK}
    print(report(rows, summary, settings, args.out, args.name, TITLE))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
