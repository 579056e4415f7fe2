"""Does speculation pay for tool calls? Greedy answers to tool-use requests, calls left to the model or enforced.

Fourteen requests (benchmarks/data/tool_tasks: eleven a tool answers, three that need none) under a chat
template that shows the model five function tools, as the coordinator renders them. Three settings on the
same prompts: ``auto`` (the model decides: it writes a call or an answer, nothing constrains it),
``required`` (tool_choice "required": a grammar of one or more calls to these tools, each under its
schema, which the target enforces on every row it verifies, as the coordinator asks it to) and
``required_one`` (the same with parallel_tool_calls false: exactly one call). Drafts are not
constrained. A call's JSON repeats names the prompt holds (tool and argument names), which n-gram
proposals can copy from the prompt.

Per prompt and setting, target-only runs first and is the reference, then each method in a rotating
order; each method runs twice, as served and ``-unforced`` (without proposing the tokens the grammar
forces, which the target lists after each verification). Reported per setting and method: tokens/s
and its ratio to target-only under the same setting, acceptance, tokens per round, how many prompts
gave exactly target-only's output, how many answers held calls (parsed as the coordinator parses
them: in ``auto``, calls written as plain JSON too), how many held a call that is not valid, and how
many forced tokens were proposed and kept. ``--settings`` runs some of the three (``auto`` alone: does the model
call on its own?).

Writes tool_calls.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/tool_calls.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import names_from  # noqa: E402
from benchmarks.sampling_settings import (  # noqa: E402
    GRAMMAR_METHODS,
    add_counts,
    add_flags,
    load_models,
    measure,
    report,
    run_settings,
    summarize,
)

NAME = "tool_calls"
TITLE = "Speculation for tool calls: greedy, calls left to the model (auto) or enforced (required)"
TASKS = _REPO_ROOT / "benchmarks" / "data" / "tool_tasks" / "tasks.json"
SETTINGS = ("auto", "required", "required_one")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    add_flags(parser, NAME, prompts=False, methods=GRAMMAR_METHODS)
    parser.add_argument("--tasks", type=Path, default=TASKS, help="tools and requests (default: %(default)s)")
    parser.add_argument("--limit", type=int, default=None, help="the first N requests only")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help="comma-separated subset of %(default)s (auto: does the model call on its own?)")
    return parser


def valid_calls(calls: list[Any], tools: dict[str, Any]) -> bool:
    """Every call names a tool and has the arguments its schema requires, and no others it forbids."""
    for call in calls:
        schema = tools.get(call.name)
        if schema is None:
            return False
        arguments = json.loads(call.arguments)
        properties = schema.get("properties", {})
        if set(schema.get("required", ())) - set(arguments) or (
                schema.get("additionalProperties") is False and set(arguments) - set(properties)):
            return False
    return True


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    methods = names_from(args.methods, GRAMMAR_METHODS)
    chosen = names_from(args.settings, SETTINGS, "--settings")
    from tandem.sampling import SamplingParams
    from tandem.structured_output import StructuredOutput
    from tandem.tokenizer import encode_messages
    from tandem.tool_calls import HermesFormat, ToolSpec, ToolUse, parse_tool_calls

    spec = json.loads(args.tasks.read_text())
    tasks = spec["tasks"][:args.limit]
    target_dir, tokenizer, target, draft, stop_ids = load_models(args, methods)
    fmt = HermesFormat.of(tokenizer)
    if fmt is None:
        raise SystemExit(f"{args.target}: its chat template shows the model no tools in the <tool_call> format")
    tools = tuple(ToolSpec(t["function"]["name"], t["function"].get("description", ""), t["function"]["parameters"])
                  for t in spec["tools"])
    shown = [t.template_entry() for t in tools]
    prompts = [encode_messages(tokenizer, [{"role": "user", "content": task}], shown) for task in tasks]
    samplings = {"auto": SamplingParams(),
                 "required": SamplingParams(grammar=fmt.grammar(ToolUse(tools, "required"))),
                 "required_one": SamplingParams(grammar=fmt.grammar(ToolUse(tools, "required", single_call=True)))}
    samplings = {setting: samplings[setting] for setting in chosen}
    print(f"[{NAME}] {len(prompts)} prompts x {len(samplings)} settings x (1 + {len(methods)}) runs", file=sys.stderr,
          flush=True)
    schemas = {t.name: t.schema for t in tools}
    rows = measure(target, draft, prompts, methods, args.max_new_tokens, samplings, args.k, stop_ids,
                   adaptive_k=not args.fixed_k, structured=StructuredOutput(target_dir, target.config), name=NAME)
    for row in rows:  # as the coordinator parses: auto's calls may be plain JSON too (tandem.json_tool_calls)
        names = frozenset(schemas) if row["setting"] == "auto" else frozenset()
        _, calls = parse_tool_calls(tokenizer.decode(row["token_ids"], skip_special_tokens=True), names)
        row["calls"] = len(calls)
        row["with_calls"] = bool(calls)
        row["invalid_calls"] = not valid_calls(calls, schemas)
    summary = summarize(rows)
    add_counts(summary, rows, {"answers_with_calls": "with_calls", "calls": "calls", "invalid": "invalid_calls",
                               "forced_kept": "forced"})
    settings = {**run_settings(args, methods), "tasks": len(tasks), "settings": chosen}
    print(report(rows, summary, settings, args.out, args.name, TITLE))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
