"""Speculative decoding, side by side: our methods and transformers' on the same prompts.

Greedy (or sampled: --temperature), batch 1, one process, every model loaded once. Each prompt runs every
method back to back (in a rotating order), so machine noise hits all methods
alike. Methods:

  target-only       our engine, plain decoding (the baseline of every speedup; always run)
  spec-draft        our engine + the draft model, adaptive k up to --k
  spec-hybrid       our engine + n-gram lookup when the text repeats (3+ token match), the draft model otherwise
  spec-ngram        our engine + prompt lookup (n-gram match in prompt and output)
  spec-early-exit   our engine + the target's own first layers as drafter (not run by default)
  spec-*-tree       spec-draft, spec-hybrid, spec-ngram with speculation trees (--tree: auto or on): the
                    draft's next-best tokens and other n-gram continuations verified beside the chain
  spec-*-eager      spec-draft, spec-hybrid with the draft reading a long prompt at once, as before the
                    loop let it wait until the answer repays the read (tandem.spec.loop, _draft_waits)
  spec-*-full       spec-draft, spec-hybrid with the draft drafting all of the k chosen, as before it stopped
                    where it is unsure (tandem.spec.adaptive.stop_below; not run by default)
  spec-*-wide       spec-draft, spec-hybrid with k up to --wide-k (not run by default)
  spec-*-short      spec-ngram, spec-hybrid with lookup rounds (the text's own repeats, the continuation cache)
                    verifying at most --k tokens, as before they chose up to 15 by their kind of match (not run
                    by default)
  spec-*-always     spec-medusa, spec-eagle asking the heads for a tree every round, whether or not that
                    measures faster (the plain methods ask only while it does: tandem.spec.heads_payoff)
  spec-*-hybrid     spec-medusa, spec-eagle with the draft model beside the heads: hybrid rounds while the
                    heads measure slower (what method auto runs when the target has heads and a draft is there)
  hf-plain          transformers generate(do_sample=False) (the second baseline of every speedup; always run)
  hf-assisted       transformers generate(assistant_model=draft), --hf-assistant-tokens per round
  hf-prompt-lookup  transformers generate(prompt_lookup_num_tokens=--hf-pld-tokens)

Prompts: HumanEval (category humaneval) and Spec-Bench (mt_bench, translation,
summarization, qa, math_reasoning, rag; first turn), --per-category of each,
wrapped in the target's chat template. Reported per method and category, plus
spec-bench-mix (every category but humaneval) and all:

  tokens_per_s       generated tokens / wall seconds of the generate calls (prefill included)
  speedup            tokens_per_s / target-only's tokens_per_s in the same category (markdown: x target-only)
  speedup_vs_hf_plain    the same over hf-plain's, transformers' plain generate (markdown: x hf-plain)
  mean_accepted_len  draft tokens accepted per speculative round (ours only)
  acceptance_rate    a, per-token acceptance: accepted / (accepted + rejections), each judged draft
                     token one trial (ours only: transformers does not expose it). Drafts after a
                     round's first rejection are never judged; accepted_per_drafted counts them
                     as failures and is lower.
  mean_k             mean k chosen per round, zeros included (ours only)
  predicted_speedup  E(k) / (k c + 1), E(k) = (1 - a^(k+1)) / (1 - a)   (Leviathan et al. 2023),
                     as sum E(k_r) / sum (k_r c + 1) over the rounds run, since adaptive k varies
                     c = draft step cost / target step cost: median 1-token forward over a
                     128-token prefix, drafter / target, measured once per run (0 for n-gram)
  decode_speedup     speedup of the decoding phase alone: from the first token (after the target's
                     prefill, which every method pays alike) to the last; the draft's own prefill
                     stays in (ours and hf-plain, whose first token a streamer times);
                     decode_speedup_vs_hf_plain the same over hf-plain's decoding phase
  efficiency         decode_speedup / predicted_speedup: the formula models decoding, not prefill
  mismatches         prompts whose token ids differ from target-only's (bf16 near-ties can flip)

Done when: spec-draft >= 1.45x on humaneval, >= 1.2x on spec-bench-mix (over target-only),
>= 1.2x hf-assisted's tokens/s over all prompts, efficiency >= 0.85.

The JSON and markdown also record the machine: CPU model name, torch's version and thread count.

Writes spec_bench.json / .md / .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/spec_bench.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    ALL,
    ALL_CATEGORIES,
    DEFAULT_RESULTS_DIR,
    DEFAULT_SPEC_BENCH,
    HUMANEVAL,
    MIX,
    Prompt,
    grouped_bars,
    load_prompts,
    machine_info,
    machine_line,
    markdown_table,
    new_figure,
    quick_default,
    save_figure,
    threshold_line,
    write_json,
    write_markdown,
)
from tandem.cli.draft_flags import add_draft_flags, draft_engine_options  # noqa: E402
from tandem.config import PACKED_WEIGHTS  # noqa: E402
from tandem.spec.adaptive import MAX_K, expected_tokens  # noqa: E402

if TYPE_CHECKING:  # runners imports torch: keep `--help` instant
    from benchmarks.runners import RunOutput

NAME = "spec_bench"
BASELINE = "target-only"
HF_BASELINE = "hf-plain"  # transformers' plain generate: every speedup is given over it too
BASELINES = (BASELINE, HF_BASELINE)
METHODS = ("target-only", "spec-draft", "spec-hybrid", "spec-draft-full", "spec-hybrid-full", "spec-draft-wide",
           "spec-hybrid-wide", "spec-ngram", "spec-ngram-short", "spec-hybrid-short",
           "spec-early-exit", "spec-draft-tree", "spec-hybrid-tree", "spec-ngram-tree", "spec-draft-eager",
           "spec-hybrid-eager", "spec-medusa", "spec-eagle", "spec-medusa-always",
           "spec-eagle-always", "spec-medusa-hybrid", "spec-eagle-hybrid", "hf-plain", "hf-assisted",
           "hf-prompt-lookup")
# the target's own heads (--medusa/--eagle-heads); "-always": asked every round (no payoff check); "-hybrid":
# the draft model's hybrid rounds while the heads do not pay
HEADS_METHODS = {"spec-medusa": "medusa", "spec-eagle": "eagle", "spec-medusa-always": "medusa",
                 "spec-eagle-always": "eagle", "spec-medusa-hybrid": "medusa", "spec-eagle-hybrid": "eagle"}
HEADS_WITH_DRAFT = ("spec-medusa-hybrid", "spec-eagle-hybrid")
FULL_METHODS = ("spec-draft-full", "spec-hybrid-full")  # the draft drafts all of k (no stop where it is unsure)
WIDE_METHODS = ("spec-draft-wide", "spec-hybrid-wide")  # k up to --wide-k instead of --k
SHORT_METHODS = ("spec-ngram-short", "spec-hybrid-short")  # lookup rounds capped at --k, not up to 15
DEFAULT_METHODS = tuple(m for m in METHODS if m != "spec-early-exit" and not m.endswith("-tree")
                        and m not in HEADS_METHODS and m not in FULL_METHODS + WIDE_METHODS + SHORT_METHODS)
OURS_SPEC = {"spec-draft": "draft", "spec-hybrid": "hybrid", "spec-ngram": "ngram", "spec-early-exit": "early-exit",
             "spec-draft-tree": "draft", "spec-hybrid-tree": "hybrid", "spec-ngram-tree": "ngram",
             "spec-draft-eager": "draft", "spec-hybrid-eager": "hybrid", "spec-draft-full": "draft",
             "spec-hybrid-full": "hybrid", "spec-draft-wide": "draft", "spec-hybrid-wide": "hybrid",
             "spec-ngram-short": "ngram", "spec-hybrid-short": "hybrid", **HEADS_METHODS}
EAGER_METHODS = ("spec-draft-eager", "spec-hybrid-eager")  # the draft reads a long prompt at once (no waiting)
TREE_METHODS = ("spec-draft-tree", "spec-hybrid-tree", "spec-ngram-tree")
COLUMNS = ("method", "category", "prompts", "tokens", "tokens_per_s", "speedup", "speedup_vs_hf_plain",
           "decode_speedup", "decode_speedup_vs_hf_plain", "mean_accepted_len", "acceptance_rate",
           "accepted_per_drafted", "mean_k", "tree_rounds", "branch_tokens", "tokens_per_round",
           "draft_ms_per_round", "depth_acceptance", "predicted_speedup", "efficiency", "mismatches")
# The JSON keeps "speedup" (over target-only, as before); the markdown names both baselines.
HEADERS = {"speedup": "x target-only", "speedup_vs_hf_plain": "x hf-plain",
           "decode_speedup": "decode x target-only", "decode_speedup_vs_hf_plain": "decode x hf-plain"}

Runner = Callable[[list[int], int], "RunOutput"]  # (prompt ids, max new tokens) -> output


# ----- flags -------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="spec_bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen-coder-1.5b",
                   help="target model: catalog name, HF directory or .gguf (default: %(default)s)")
    p.add_argument("--draft", default="qwen-coder-0.5b",
                   help="draft model for spec-draft and hf-assisted (default: %(default)s)")
    add_draft_flags(p)
    p.add_argument("--methods", default=",".join(DEFAULT_METHODS),
                   help=f"comma-separated subset of {', '.join(METHODS)}; target-only and hf-plain are always "
                        "added (they are the baselines of every speedup) (default: %(default)s)")
    p.add_argument("--categories", default=",".join(ALL_CATEGORIES),
                   help="comma-separated prompt categories (default: %(default)s)")
    p.add_argument("--per-category", type=int, default=None, help="prompts per category (default: 3; --quick: 1)")
    p.add_argument("--limit", type=int, default=None, help="cap on the total number of prompts (smoke runs)")
    p.add_argument("--select", choices=("sample", "first"), default="sample",
                   help="which prompts of a category: a seeded sample or the first ones in file order "
                        "(default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt sample (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="tokens generated per prompt at most (default: 128; --quick: 32)")
    p.add_argument("--quick", action="store_true", help="a smoke run: 1 prompt per category, 32 tokens, 3 cost reps")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sample every method at this temperature (top-p 1, top-k off, unseeded: each draft token is "
                        "judged by the rejection rule); 0: greedy. Sampled outputs differ run to run, so methods "
                        "compare over the same prompts, not the same tokens (default: %(default)s)")
    p.add_argument("--k", type=int, default=4, help="most draft tokens per round of our methods (default: %(default)s)")
    p.add_argument("--fixed-k", action="store_true", help="our methods always draft --k tokens instead of adapting k")
    p.add_argument("--wide-k", type=int, default=6,
                   help="the spec-*-wide methods' most draft tokens per round (default: %(default)s)")
    p.add_argument("--tree", choices=("auto", "on"), default="auto",
                   help="the spec-*-tree methods: a tree when the cost model says it pays (auto), or whenever "
                        "there are candidates (on) (default: %(default)s)")
    p.add_argument("--tree-width", type=int, default=2,
                   help="the spec-*-tree methods: most other candidates per position (default: %(default)s)")
    p.add_argument("--ngram-min", type=int, default=1,
                   help="spec-ngram: shortest n-gram matched (default: %(default)s)")
    p.add_argument("--ngram-max", type=int, default=4, help="spec-ngram: longest n-gram matched (default: %(default)s)")
    p.add_argument("--early-exit-layers", type=int, default=None,
                   help="spec-early-exit: target layers used (default: a quarter)")
    p.add_argument("--hf-assistant-tokens", type=int, default=None,
                   help="hf-assisted: draft tokens per round, constant schedule "
                        "(default: --k; transformers' own default is 20)")
    p.add_argument("--hf-pld-tokens", type=int, default=10,
                   help="hf-prompt-lookup: prompt_lookup_num_tokens "
                        "(default: %(default)s, as transformers' docs suggest)")
    p.add_argument("--hf-pld-ngram", type=int, default=None,
                   help="hf-prompt-lookup: max_matching_ngram_size (default: transformers' own, 2)")
    p.add_argument("--medusa-heads", default="qwen-coder-1.5b-medusa", metavar="PATH|NAME",
                   help="spec-medusa: the target's Medusa heads (a directory, or heads prepared with `tandem heads "
                        "prepare`; default: %(default)s)")
    p.add_argument("--eagle-heads", default="qwen-coder-1.5b-eagle", metavar="PATH|NAME",
                   help="spec-eagle: the target's EAGLE-3 head (default: %(default)s)")
    p.add_argument("--heads-nodes", type=int, default=0,
                   help="spec-medusa/eagle: most nodes of the heads' tree (default 0: chosen from the measured "
                        "verification cost)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                   help="dtype of every model (default: %(default)s)")
    p.add_argument("--packed-weights", default="auto", choices=PACKED_WEIGHTS,
                   help="our engine's linear weights packed for oneDNN (auto: fp32, and bf16 on a native-bf16 CPU) "
                        "or the dense ones (off: MKL in fp32, ATen's row-invariant kernels in bf16) "
                        "(default: %(default)s)")
    p.add_argument("--cost-reps", type=int, default=None,
                   help="timed forwards when measuring the cost ratio c (default: 10; --quick: 3)")
    p.add_argument("--spec-bench", type=Path, default=DEFAULT_SPEC_BENCH,
                   help="Spec-Bench question.jsonl (default: %(default)s)")
    p.add_argument("--cache-dir", default=None,
                   help="Tandem model cache root (default: $TANDEM_HOME or ~/.cache/tandem)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR, help="results directory (default: %(default)s)")
    return p


def resolve_args(args: argparse.Namespace) -> argparse.Namespace:
    """Fill --quick-dependent defaults and check the method list before anything loads."""
    args.per_category = quick_default(args.per_category, args.quick, 1, 3)
    args.max_new_tokens = quick_default(args.max_new_tokens, args.quick, 32, 128)
    args.cost_reps = quick_default(args.cost_reps, args.quick, 3, 10)
    args.hf_assistant_tokens = args.hf_assistant_tokens if args.hf_assistant_tokens is not None else args.k
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise SystemExit(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    args.methods = [*BASELINES, *[m for m in dict.fromkeys(methods) if m not in BASELINES]]
    args.categories = [c.strip() for c in args.categories.split(",") if c.strip()]
    if min(args.per_category, args.max_new_tokens, args.cost_reps, args.k, args.wide_k, args.hf_assistant_tokens) <= 0:
        raise SystemExit("--per-category, --max-new-tokens, --cost-reps, --k, --wide-k and --hf-assistant-tokens "
                         "must be positive")
    if args.limit is not None and args.limit <= 0:
        raise SystemExit("--limit must be positive")
    if not 0 <= args.temperature < float("inf"):
        raise SystemExit(f"--temperature must be >= 0 and finite, got {args.temperature}")
    return args


# ----- loading -----------------------------------------------------------
@dataclass(slots=True)
class Bench:
    """Everything loaded once: the tokenizer, one runner per method, the measured cost ratios."""

    tokenizer: Any
    stop_ids: frozenset[int]
    runners: dict[str, Runner] = field(default_factory=dict)
    cost_ratio: dict[str, float] = field(default_factory=dict)  # method -> c (drafter step / target step)


def load_bench(args: argparse.Namespace) -> Bench:
    """Load each model once (ours and transformers' as the methods need) and build the runners."""
    from benchmarks.runners import engine_config, resolve_model_dir
    from draft_worker.engine import early_exit_engine
    from tandem.engine import ModelEngine
    from tandem.spec.options import SpecOptions
    from tandem.tokenizer import check_same_tokenizer, load_tokenizer, stop_token_ids

    needs_draft = bool({"spec-draft", "spec-hybrid", "spec-draft-tree", "spec-hybrid-tree", "hf-assisted",
                        *EAGER_METHODS, *FULL_METHODS, *WIDE_METHODS, *HEADS_WITH_DRAFT} & set(args.methods))
    target_dir = resolve_model_dir(args.target, args.cache_dir)
    draft_dir = resolve_model_dir(args.draft, args.cache_dir) if needs_draft else None
    tokenizer = load_tokenizer(target_dir)
    if draft_dir is not None:
        check_same_tokenizer(tokenizer, target_dir, draft_dir)
    target = ModelEngine.load(engine_config(target_dir, args.dtype, args.packed_weights))
    bench = Bench(tokenizer, stop_token_ids(target_dir, tokenizer, target.config))
    sampling = request_sampling(args)
    bench.runners[BASELINE] = ours_runner(target, None, SpecOptions("none", 0), bench.stop_ids, sampling)
    draft_engine = None
    for method in [m for m in args.methods if m in OURS_SPEC]:
        drafter = None  # the model that drafts (None: n-gram lookup)
        if OURS_SPEC[method] in ("draft", "hybrid") or method in HEADS_WITH_DRAFT:
            assert draft_dir is not None
            if draft_engine is None:  # one draft model serves every method
                draft_engine = ModelEngine.load(engine_config(draft_dir, args.dtype, args.packed_weights,
                                                                   draft_engine_options(args)))
                draft_engine.warmup()
            drafter = draft_engine
        if method in HEADS_METHODS:
            bench.runners[method] = heads_runner(target, method, args, bench.stop_ids, drafter)
            bench.cost_ratio[method] = 0.0  # the heads' cost is measured per round (draft_ms_per_round)
            continue
        elif method == "spec-early-exit":
            drafter = early_exit_engine(target, args.early_exit_layers or max(1, target.config.num_layers // 4))
            drafter.warmup()
        tree = args.tree if method in TREE_METHODS else "off"
        k = args.wide_k if method in WIDE_METHODS else args.k
        options = SpecOptions(OURS_SPEC[method], k, not args.fixed_k, ngram_min=args.ngram_min,
                              ngram_max=args.ngram_max, hybrid_min_match=min(3, args.ngram_max), tree=tree,
                              tree_width=args.tree_width, draft_waits=method not in EAGER_METHODS,
                              draft_stops=method not in FULL_METHODS,
                              lookup_k_max=k if method in SHORT_METHODS else MAX_K)
        bench.runners[method] = ours_runner(target, drafter, options, bench.stop_ids, sampling)
        bench.cost_ratio[method] = cost_ratio(target, drafter, args.cost_reps)
    add_hf_runners(bench, args, target_dir, draft_dir)
    return bench


def cost_ratio(target: Any, drafter: Any, reps: int) -> float:
    """c = drafter step / target step: median 1-token forwards over a 128-token prefix, taken in turns.

    ``drafter`` None is n-gram lookup: no model, cost counted as 0.
    """
    from benchmarks.runners import engine_probe, forward_seconds

    if drafter is None:
        return 0.0
    target_s, drafter_s = forward_seconds([engine_probe(target, 128, 1), engine_probe(drafter, 128, 1)], reps)
    return drafter_s / target_s


def ours_runner(target: Any, drafter: Any, options: Any, stop_ids: frozenset[int], sampling: Any = None) -> Runner:
    """A runner over one generator kept for the whole run, so its cost model stays warm as in a server."""
    from benchmarks.runners import run_ours
    from tandem.inprocess import SpeculativeGenerator

    generator = SpeculativeGenerator(target, drafter, options)
    return lambda ids, n: run_ours(generator, ids, n, stop_ids, sampling=sampling)


def request_sampling(args: argparse.Namespace) -> Any:
    """What every request of ours samples with (``--temperature``; 0: greedy)."""
    from tandem.sampling import SamplingParams

    return SamplingParams(temperature=args.temperature)


def heads_runner(target: Any, method: str, args: argparse.Namespace, stop_ids: frozenset[int],
                 draft: Any = None) -> Runner:
    """A runner over the target with its heads (and ``draft`` for the hybrid rounds of a ``-hybrid`` method);
    each run notes the seconds the heads spent drafting."""
    from benchmarks.runners import run_ours
    from tandem import model_store
    from tandem.heads.locate import resolve_heads
    from tandem.heads.serving import load_drafter
    from tandem.inprocess import SpeculativeGenerator
    from tandem.spec.options import SpecOptions

    kind = HEADS_METHODS[method]
    spec = args.medusa_heads if kind == "medusa" else args.eagle_heads
    root = model_store.cache_root_from(args.cache_dir, os.environ)
    heads = load_drafter(resolve_heads(spec, root), target)
    # adaptive_k off: heads rounds ask every time (the payoff check is part of adaptivity)
    adaptive = not args.fixed_k and not method.endswith("-always")
    options = SpecOptions(kind, args.k, adaptive, heads_nodes=args.heads_nodes, ngram_min=args.ngram_min,
                          ngram_max=args.ngram_max, hybrid_min_match=min(3, args.ngram_max),
                          heads_fallback="hybrid" if method in HEADS_WITH_DRAFT else "plain")
    generator = SpeculativeGenerator(target, draft, options, heads=heads)

    sampling = request_sampling(args)

    def run(ids: list[int], n: int) -> RunOutput:
        before = heads.seconds
        out = run_ours(generator, ids, n, stop_ids, sampling=sampling)
        out.draft_seconds = heads.seconds - before
        return out

    return run


def add_hf_runners(bench: Bench, args: argparse.Namespace, target_dir: Path, draft_dir: Path | None) -> None:
    """transformers' plain, assisted and prompt-lookup generation, stopping on our stop ids."""
    from benchmarks.runners import load_hf_model, run_hf, set_assistant_tokens

    wanted = [m for m in args.methods if m.startswith("hf-")]
    if not wanted:
        return
    model = load_hf_model(target_dir, args.dtype)
    eos = sorted(bench.stop_ids)
    extra: dict[str, dict[str, Any]] = {"hf-plain": {}}
    sampled = {"do_sample": True, "temperature": args.temperature, "top_p": 1.0, "top_k": 0} if args.temperature else {}
    if "hf-assisted" in wanted:
        assert draft_dir is not None
        assistant = load_hf_model(draft_dir, args.dtype)
        set_assistant_tokens(assistant, args.hf_assistant_tokens)
        extra["hf-assisted"] = {"assistant_model": assistant}
    pld: dict[str, Any] = {"prompt_lookup_num_tokens": args.hf_pld_tokens}
    if args.hf_pld_ngram is not None:
        pld["max_matching_ngram_size"] = args.hf_pld_ngram
    extra["hf-prompt-lookup"] = pld
    for method in wanted:
        # hf-plain, a baseline of decode_speedup, times its prefill apart as our methods do
        kwargs = {"eos_token_id": eos, "time_first_token": method == HF_BASELINE, **sampled, **extra[method]}
        bench.runners[method] = lambda ids, n, kw=kwargs: run_hf(model, ids, n, **kw)


# ----- running -----------------------------------------------------------
def run_prompt(bench: Bench, methods: list[str], prompt: Prompt, prompt_ids: list[int], max_new: int,
               rotation: int, greedy: bool = True) -> list[dict[str, Any]]:
    """Every method on one prompt, back to back, starting at a rotating method; one row per method (sampled:
    nothing to compare with target-only's tokens, ``matches_target_only`` None)."""
    order = methods[rotation % len(methods):] + methods[: rotation % len(methods)]
    outputs = {m: bench.runners[m](prompt_ids, max_new) for m in order}
    reference = outputs[BASELINE].token_ids
    rows = []
    for method in methods:
        out = outputs[method]
        row: dict[str, Any] = {"prompt_id": prompt.prompt_id, "category": prompt.category, "method": method,
                               "prompt_tokens": len(prompt_ids), "tokens": len(out.token_ids),
                               "seconds": out.seconds,
                               "matches_target_only": out.token_ids == reference if greedy else None}
        if out.stats is not None:
            s = out.stats
            # The decoding phase: after the target's prefill (which every method pays alike), to the last token.
            row.update(decode_tokens=s.generated - 1, decode_seconds=s.elapsed_s - s.first_token_s)
            row.update(drafted=s.drafted, accepted=s.accepted, rejected=s.rejected, rounds=s.rounds,
                       spec_rounds=s.spec_rounds, ngram_rounds=s.ngram_rounds,
                       k_sum=sum(k * n for k, n in s.k_counts.items()), k_rounds=s.rounds,
                       k_counts=dict(s.k_counts), tree_rounds=s.tree_rounds, branch_tokens=s.branch_tokens,
                       depth_offered=dict(s.depth_offered), depth_kept=dict(s.depth_kept),
                       draft_wait_rounds=s.draft_wait_rounds, draft_seconds=out.draft_seconds)
        elif out.first_token_s is not None and out.token_ids:  # hf-plain: the same phase, by its streamer
            row.update(decode_tokens=len(out.token_ids) - 1, decode_seconds=out.seconds - out.first_token_s)
        rows.append(row)
    return rows


def run_all(bench: Bench, prompts: list[Prompt], args: argparse.Namespace) -> list[dict[str, Any]]:
    """Warm every method up once (untimed), then run all prompts with a progress bar."""
    from tqdm import tqdm

    from tandem.tokenizer import encode_prompt

    encoded = [encode_prompt(bench.tokenizer, p.text, chat=True) for p in prompts]
    for method in args.methods:  # first-call allocations and cost models, outside the measurement
        bench.runners[method](encoded[0], min(8, args.max_new_tokens))
    runs: list[dict[str, Any]] = []
    bar = tqdm(list(zip(prompts, encoded)), desc=NAME, unit="prompt", file=sys.stderr)
    for i, (prompt, ids) in enumerate(bar):
        bar.set_postfix(category=prompt.category, prompt_tokens=len(ids))
        runs.extend(run_prompt(bench, args.methods, prompt, ids, args.max_new_tokens, i, not args.temperature))
    return runs


# ----- aggregation -------------------------------------------------------
def predicted_speedup(a: float, k_counts: Counter[int], c: float) -> float:
    """Leviathan et al.'s E(k) / (k c + 1), over the rounds actually run: k varies when adaptive.

    Expected tokens of all rounds over their cost in target steps: sum E(k_r) / sum (k_r c + 1).
    """
    tokens = sum(n * expected_tokens(a, k) for k, n in k_counts.items())
    steps = sum(n * (k * c + 1.0) for k, n in k_counts.items())
    return tokens / steps


def ratio(value: float | None, baseline: dict[str, Any] | None, key: str) -> float | None:
    """``value`` over ``baseline[key]``; None where either is missing or zero."""
    base = baseline.get(key) if baseline else None
    return value / base if value and base else None


def aggregate(runs: list[dict[str, Any]], method: str, category: str, baselines: dict[str, dict[str, Any]],
              cost_ratio: float | None) -> dict[str, Any]:
    """One table row from the per-prompt rows of one method in one category.

    ``baselines``: target-only's and hf-plain's rows of the same category, where measured (empty for those rows
    themselves); every speedup is given over each.
    """
    tokens = sum(r["tokens"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    tps = tokens / seconds if seconds else None
    decode_seconds = sum(r.get("decode_seconds", 0.0) for r in runs)
    decode_tps = sum(r.get("decode_tokens", 0) for r in runs) / decode_seconds if decode_seconds > 0 else None
    ours_base, hf_base = baselines.get(BASELINE), baselines.get(HF_BASELINE)
    decode_speedup = ratio(decode_tps, ours_base, "decode_tokens_per_s")
    row: dict[str, Any] = {
        "method": method, "category": category, "prompts": len(runs), "tokens": tokens,
        "seconds": round(seconds, 4), "tokens_per_s": tps, "speedup": ratio(tps, ours_base, "tokens_per_s"),
        "speedup_vs_hf_plain": ratio(tps, hf_base, "tokens_per_s"),
        "decode_tokens_per_s": decode_tps, "decode_speedup": decode_speedup,
        "decode_speedup_vs_hf_plain": ratio(decode_tps, hf_base, "decode_tokens_per_s"),
        "mean_accepted_len": None, "acceptance_rate": None, "mean_k": None, "cost_ratio": cost_ratio,
        "tree_rounds": None, "branch_tokens": None, "tokens_per_round": None, "draft_ms_per_round": None,
        "depth_acceptance": None, "predicted_speedup": None, "efficiency": None,
        # sampled runs (None) have no target-only tokens to equal
        "mismatches": None if any(r["matches_target_only"] is None for r in runs) else sum(
            not r["matches_target_only"] for r in runs),
    }
    row["mismatch_rate"] = row["mismatches"] / len(runs) if runs and row["mismatches"] is not None else None
    if method in OURS_SPEC:
        drafted = sum(r["drafted"] for r in runs)
        accepted = sum(r["accepted"] for r in runs)
        judged = accepted + sum(r["rejected"] for r in runs)
        k_counts: Counter[int] = Counter()
        for r in runs:
            k_counts.update({int(k): n for k, n in r["k_counts"].items()})
        spec_rounds = sum(r["spec_rounds"] for r in runs)
        k_rounds = sum(r["k_rounds"] for r in runs)
        a = accepted / judged if judged else None
        k = sum(r["k_sum"] for r in runs) / k_rounds if k_rounds else None
        row.update(mean_accepted_len=accepted / spec_rounds if spec_rounds else None, acceptance_rate=a, mean_k=k,
                   accepted_per_drafted=accepted / drafted if drafted else None,
                   tree_rounds=sum(r.get("tree_rounds", 0) for r in runs),
                   branch_tokens=sum(r.get("branch_tokens", 0) for r in runs))
        rounds = sum(r["rounds"] for r in runs)
        row["tokens_per_round"] = (accepted + rounds) / rounds if rounds else None
    if method in HEADS_METHODS:
        rounds = sum(r["rounds"] for r in runs)
        row["draft_ms_per_round"] = 1000 * sum(r.get("draft_seconds") or 0.0 for r in runs) / rounds if rounds \
            else None
        offered: Counter[int] = Counter()
        kept: Counter[int] = Counter()
        for r in runs:
            offered.update({int(d): n for d, n in r.get("depth_offered", {}).items()})
            kept.update({int(d): n for d, n in r.get("depth_kept", {}).items()})
        # per head position (tree depth): the share of rounds reaching it that kept a token there
        row["depth_acceptance"] = " ".join(f"{kept[d] / n:.2f}" for d, n in sorted(offered.items()))
        if a is not None and k_counts and cost_ratio is not None:
            row["predicted_speedup"] = predicted_speedup(a, k_counts, cost_ratio)
            # The formula models decoding; the target's prefill, the same for every method, is left out.
            row["efficiency"] = decode_speedup / row["predicted_speedup"] if decode_speedup else None
    return row


def summarize(runs: list[dict[str, Any]], methods: list[str], cost_ratio: dict[str, float]) -> list[dict[str, Any]]:
    """Rows per method for each category present, then spec-bench-mix and all."""
    categories = list(dict.fromkeys(r["category"] for r in runs))
    groups: dict[str, Callable[[dict[str, Any]], bool]] = {c: (lambda r, c=c: r["category"] == c) for c in categories}
    if any(c != HUMANEVAL for c in categories):
        groups[MIX] = lambda r: r["category"] != HUMANEVAL
    groups[ALL] = lambda r: True
    rows = []
    for category, keep in groups.items():
        selected = [r for r in runs if keep(r)]
        bases = {b: aggregate([r for r in selected if r["method"] == b], b, category, {}, None)
                 for b in BASELINES if b in methods}
        for method in methods:
            mine = [r for r in selected if r["method"] == method]
            rows.append(aggregate(mine, method, category, bases, cost_ratio.get(method)))
    return rows


def thresholds(rows: list[dict[str, Any]]) -> list[str]:
    """The Done-when lines for spec-draft (n/a where this run did not measure what they need)."""
    def get(method: str, category: str, key: str) -> float | None:
        row = next((r for r in rows if r["method"] == method and r["category"] == category), None)
        return row[key] if row else None

    ours_all, hf_all = get("spec-draft", ALL, "tokens_per_s"), get("hf-assisted", ALL, "tokens_per_s")
    return [
        threshold_line("spec-draft speedup on humaneval", get("spec-draft", HUMANEVAL, "speedup"), ">=", 1.45),
        threshold_line("spec-draft speedup on spec-bench-mix", get("spec-draft", MIX, "speedup"), ">=", 1.2),
        threshold_line("spec-draft / hf-assisted tokens/s (all)",
                       ours_all / hf_all if ours_all and hf_all else None, ">=", 1.2),
        threshold_line("spec-draft efficiency (all)", get("spec-draft", ALL, "efficiency"), ">=", 0.85),
    ]


def notes(rows: list[dict[str, Any]]) -> list[str]:
    """What a reader of the numbers should see: the two baselines side by side; methods that hardly speculated."""
    lines = []
    ours = next((r for r in rows if r["method"] == BASELINE and r["category"] == ALL), None)
    if ours and ours["speedup_vs_hf_plain"]:
        lines.append(f"  note  baselines (all): target-only {ours['tokens_per_s']:.2f} tokens/s = "
                     f"{ours['speedup_vs_hf_plain']:.3f}x hf-plain's; every speedup is given over both")
        if ours["speedup_vs_hf_plain"] < 1.0:
            lines.append("  note  target-only is slower than hf-plain here: the speedups over target-only "
                         "are flattered; x hf-plain is the fairer figure")
    lines += [
        f"  note  {r['method']}: mean k {r['mean_k']:.2f} over all prompts: it hardly speculated "
        "(adaptive k chose 0; compare with --fixed-k)"
        for r in rows
        if r["category"] == ALL and r["method"] in OURS_SPEC and r["mean_k"] is not None and r["mean_k"] < 0.5
    ]
    return lines


# ----- output ------------------------------------------------------------
def chart(rows: list[dict[str, Any]], methods: list[str], out: Path, decoding: str = "greedy") -> Path:
    """Grouped bars per category, one bar per method: speedup over target-only (left), over hf-plain (right).

    Both panels show every method, the baselines too (a panel's own at 1.0), so a method keeps its colour.
    """
    categories = list(dict.fromkeys(r["category"] for r in rows))
    fig, axes = new_figure(ncols=len(BASELINES), width=max(7.0, 1.2 * len(categories)))
    for ax, baseline, key in zip(axes, BASELINES, ("speedup", "speedup_vs_hf_plain")):
        by = {(r["method"], r["category"]): r[key] for r in rows}
        grouped_bars(ax, categories, {m: [by.get((m, c)) for c in categories] for m in methods},
                     f"speedup over {baseline} (tokens/s ratio)")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_title(f"{decoding}, batch 1: speedup over {baseline} per category")
    return save_figure(fig, out, NAME)


def write_results(args: argparse.Namespace, prompts: list[Prompt], bench: Bench, runs: list[dict[str, Any]],
                  rows: list[dict[str, Any]], verdicts: list[str]) -> list[Path]:
    """spec_bench.json (settings, machine, cost ratios, rows, per-prompt runs), .md and .png."""
    settings = {
        "target": args.target, "draft": args.draft, "dtype": args.dtype, "methods": args.methods,
        "k": args.k, "wide_k": args.wide_k, "adaptive_k": not args.fixed_k, "tree": args.tree,
        "tree_width": args.tree_width, "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
        "per_category": args.per_category, "select": args.select, "seed": args.seed,
        "hf_assistant_tokens": args.hf_assistant_tokens, "hf_pld_tokens": args.hf_pld_tokens,
        "hf_pld_ngram": args.hf_pld_ngram, "quick": args.quick, "baselines": list(BASELINES),
        "prompts": [p.prompt_id for p in prompts],
    }
    machine = machine_info()
    table = markdown_table(rows, COLUMNS, HEADERS)
    costs = ", ".join(f"{m}: {c:.3f}" for m, c in bench.cost_ratio.items()) or "none measured"
    body = (f"Settings: `{ {k: v for k, v in settings.items() if k != 'prompts'} }`\n\n{machine_line(machine)}\n\n"
            f"Cost ratio c (drafter step / target step): {costs}\n\n"
            "Every speedup over both baselines, measured in this run: our target-only (x target-only) and "
            f"transformers' plain generate (x hf-plain).\n\n{table}\n\n"
            "Done when:\n\n```\n" + "\n".join(verdicts) + "\n```")
    return [
        write_json(args.out, NAME, {"settings": settings, "machine": machine, "cost_ratio": bench.cost_ratio,
                                    "records": rows, "thresholds": verdicts, "runs": runs}),
        write_markdown(args.out, NAME, "Spec-Bench: speculative decoding side by side", body),
        chart(rows, args.methods, args.out,
              f"sampled at temperature {args.temperature:g}" if args.temperature else "greedy"),
    ]


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; ``tandem bench`` calls this with its own argv."""
    args = resolve_args(build_parser().parse_args(argv))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    prompts = load_prompts(args.categories, args.per_category,
                           args.seed if args.select == "sample" else None, args.spec_bench)
    prompts = prompts[: args.limit] if args.limit else prompts
    if not prompts:
        raise SystemExit("no prompts selected: check --categories, --per-category and --limit")
    bench = load_bench(args)
    runs = run_all(bench, prompts, args)
    rows = summarize(runs, args.methods, bench.cost_ratio)
    verdicts = thresholds(rows) + notes(rows)
    paths = write_results(args, prompts, bench, runs, rows, verdicts)
    print(markdown_table(rows, COLUMNS, HEADERS))
    print(machine_line(machine_info()))
    print("cost ratio c: " + (", ".join(f"{m} {c:.3f}" for m, c in bench.cost_ratio.items()) or "none"))
    print("Done-when thresholds (spec-draft):")
    print("\n".join(verdicts))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    sys.exit(main())
