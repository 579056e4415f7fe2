"""Does speculation still pay under penalties? Greedy decoding with and without them, side by side.

Repetition, frequency and presence penalties (tandem.penalties) push the text away from what it has
said already: the very repeats an n-gram lookup proposes, and some of what a draft model would say.
Each verified row is adjusted for its own context, so the output stays the target alone's; what
this measures is what the penalties cost speculation.

Per prompt and setting (``plain``: none; ``penalised``: the flags' penalties), target-only decoding
runs first and is the reference; then every method, in a rotating order. Reported per setting and
method, over all prompts: tokens/s and its ratio to target-only under the SAME setting, acceptance
(kept / drafted), tokens per round, and how many prompts gave exactly target-only's output.

Writes penalties.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/penalties.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import names_from  # noqa: E402
from benchmarks.sampling_settings import (  # noqa: E402
    METHODS,
    add_flags,
    load,
    measure,
    report,
    run_settings,
    summarize,
)

NAME = "penalties"
TITLE = "Speculation under penalties: greedy, with and without them"
SETTINGS = ("plain", "penalised")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_flags(parser, NAME)
    parser.add_argument("--repetition-penalty", type=float, default=1.1, help="the penalised setting's (> 0)")
    parser.add_argument("--frequency-penalty", type=float, default=0.3, help="the penalised setting's")
    parser.add_argument("--presence-penalty", type=float, default=0.3, help="the penalised setting's")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    methods = names_from(args.methods, METHODS)
    from tandem.sampling import SamplingParams
    from tandem.tokenizer import encode_prompt

    samplings = {"plain": SamplingParams(),
                 "penalised": SamplingParams(repetition_penalty=args.repetition_penalty,  # checked before models load
                                             frequency_penalty=args.frequency_penalty,
                                             presence_penalty=args.presence_penalty)}
    _, tokenizer, target, draft, prompts, stop_ids = load(args, methods)
    encoded = [encode_prompt(tokenizer, p.text, chat=True) for p in prompts]
    print(f"[{NAME}] {len(encoded)} prompts x {len(samplings)} settings x (1 + {len(methods)}) runs", file=sys.stderr,
          flush=True)
    rows = measure(target, draft, encoded, methods, args.max_new_tokens, samplings, args.k, stop_ids,
                   adaptive_k=not args.fixed_k, name=NAME)
    settings = {**run_settings(args, methods), "repetition_penalty": args.repetition_penalty,
                "frequency_penalty": args.frequency_penalty, "presence_penalty": args.presence_penalty}
    print(report(rows, summarize(rows), settings, args.out, args.name, TITLE))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
