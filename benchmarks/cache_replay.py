"""Replay recorded rollouts through the n-gram proposers: tokens per round without running the target.

Why this is exact in distribution. With a deterministic proposal (n-gram
lookups propose tokens, not distributions), lossless verification accepts a
node's candidate child x with the target's probability p(x) and otherwise
samples from p without the candidates; that is the same law as drawing the
token y ~ p and going on iff y is a candidate. So walking a proposal tree
along a recorded target-only sample (drawn from p at every position) accepts
exactly as many tokens, in distribution, as verification would. The caches
learn the recorded samples, which are themselves draws of the target. What
replay cannot show is time: tokens per round become speed with the
measured cost of a verification of that many nodes (the ``cost`` step).

Three steps:

  record   sample ``--samples`` rollouts of each of ``--prompts`` HumanEval prompts
           (chat template) with the target alone at ``--temperature``, seed
           ``--seed + i`` for sample i, all samples of a prompt in one batch;
           writes the prompt and generated token ids to ``--recording``.
  cost     the target's forward of 1..33 new tokens over a cached prefix (the price of
           verifying a round's nodes), written to ``--costs``.
  replay   for each proposer (prompt lookup, a per-coordinator cache, one shared
           cache) and each policy variant, walk every sample in the benchmark's
           order (sample i on coordinator i % 2) and report tokens per round, the
           share of rounds proposing nothing and the nodes verified per round; with
           ``--costs``, the speed over target-only those rounds would have at those prices.

    python benchmarks/cache_replay.py record --prompts 4 --samples 8 --max-new-tokens 128
    python benchmarks/cache_replay.py cost
    python benchmarks/cache_replay.py replay --costs benchmarks/results/verify_costs.json
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import (  # noqa: E402
    HUMANEVAL,
    grouped_bars,
    load_prompts,
    markdown_table,
    new_figure,
    save_figure,
    write_json,
    write_markdown,
)
from tandem.spec.adaptive import TIE_MARGIN, AcceptanceTracker, MatchRates, choose_k  # noqa: E402
from tandem.spec.continuations import LocalContinuations  # noqa: E402
from tandem.spec.loop import PROMPT_TOKENS_LEARNED  # noqa: E402
from tandem.spec.ngram import lookup_match  # noqa: E402
from tandem.spec.proposers import CACHE, NGRAM  # noqa: E402
from tandem.spec.tree import ROOT, TokenTree, children_of  # noqa: E402

NAME = "cache_replay"
RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_RECORDING = RESULTS / "rollout_recording.json"
DEFAULT_COSTS = RESULTS / "verify_costs.json"
COST_ROWS = (1, 2, 3, 5, 9, 13, 17, 25, 33)


# ----- record -------------------------------------------------------------------------------------
def record(args: argparse.Namespace) -> int:
    from benchmarks.runners import engine_config, resolve_model_dir
    from tandem.engine import ModelEngine
    from tandem.inprocess import GenerationRequest, SpeculativeGenerator
    from tandem.sampling_params import SamplingParams
    from tandem.tokenizer import encode_prompt, load_tokenizer, stop_token_ids

    target_dir = resolve_model_dir(args.target)
    tokenizer = load_tokenizer(target_dir)
    config = engine_config(target_dir, args.dtype)
    engine = ModelEngine.load(config)
    stops = stop_token_ids(target_dir, tokenizer, engine.config)
    generator = SpeculativeGenerator(engine)
    prompts = load_prompts([HUMANEVAL], args.prompts, args.seed, None)
    rows = []
    for p, prompt in enumerate(prompts):
        ids = encode_prompt(tokenizer, prompt.text, chat=True)
        seeds = [args.seed + p * args.samples + i for i in range(args.samples)]
        requests = [GenerationRequest(ids, args.max_new_tokens, SamplingParams(args.temperature, seed=s), stops)
                    for s in seeds]
        for i, (seed, result) in enumerate(zip(seeds, generator.generate(requests))):
            rows.append({"prompt_id": prompt.prompt_id, "sample": i, "seed": seed, "prompt_ids": ids,
                         "token_ids": result.token_ids})
        print(f"{prompt.prompt_id}: {args.samples} samples", flush=True)
    payload = {"target": args.target, "dtype": str(config.resolved_dtype).removeprefix("torch."),
               "temperature": args.temperature,
               "max_new_tokens": args.max_new_tokens, "rows": rows}
    args.recording.write_text(json.dumps(payload))
    print(f"wrote {args.recording}")
    return 0


# ----- cost -------------------------------------------------------------------------------------
def cost(args: argparse.Namespace) -> int:
    from benchmarks.runners import engine_config, engine_probe, forward_seconds, resolve_model_dir
    from tandem.engine import ModelEngine

    config = engine_config(resolve_model_dir(args.target), args.dtype)
    engine = ModelEngine.load(config)
    seconds = forward_seconds([engine_probe(engine, args.prefix_len, n) for n in COST_ROWS], args.reps)
    payload = {"target": args.target, "dtype": str(config.resolved_dtype).removeprefix("torch."),
               "packed_weights": config.pack_weights, "prefix_len": args.prefix_len,
               "rows": list(COST_ROWS), "seconds": seconds}
    for n, sec in zip(COST_ROWS, seconds):
        print(f"{n:3d} rows: {1000 * sec:7.1f} ms ({sec / seconds[0]:.2f}x one)")
    args.costs.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.costs}")
    return 0


def relative_cost(costs: dict[str, Any] | None) -> Callable[[int], float]:
    """Rows -> the price of verifying them in plain steps (linear between the measured sizes)."""
    if costs is None:
        return lambda rows: 1.0
    xs, ys = costs["rows"], [s / costs["seconds"][0] for s in costs["seconds"]]

    def price(rows: int) -> float:
        for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
            if rows <= x1:
                return y0 + (y1 - y0) * (rows - x0) / (x1 - x0)
        return ys[-1] * rows / xs[-1]

    return price


# ----- replay -------------------------------------------------------------------------------------
FIXED, PER_REQUEST, PER_MATCH = "fixed", "per request", "per kind of match"


@dataclass(frozen=True)
class Policy:
    """How a round's proposal is made from the request's text and the cache, and how many tokens it verifies."""

    name: str
    k: int = 4
    k_rule: str = PER_MATCH  # FIXED: always k; PER_REQUEST: the request's rate, before the lookup (the loop
    # until the kinds of match); PER_MATCH: the rate of the kind of match, after the lookup (the loop's MatchRates)
    cache_min_n: int = 2
    cache_max_n: int = 8
    own_min_n: int = 1
    own_max_n: int = 4
    tree_runs: int = 0  # the cache's other runs verified beside the chain (0: a chain)


@dataclass
class PricedRounds:
    """tandem.spec.adaptive's ``RoundCost`` for n-gram rounds: drafting is free, verification at ``price``."""

    price: Callable[[int], float]
    speculation_margin: float = TIE_MARGIN

    def round_seconds(self, k: int, extra_nodes: int = 0) -> float:
        return self.price(k + 1 + extra_nodes)


def proposal_tree(history: list[int], cache: LocalContinuations | None,
                  k: int, policy: Policy) -> tuple[TokenTree, str, int]:
    """The loop's rule: the longer match of the request's own text and the cache proposes.

    Returns the tree (empty: nothing to propose), its source (NGRAM, CACHE or "none") and the match length.
    """
    tokens, matched = lookup_match(history, k, policy.own_min_n, policy.own_max_n)
    source = NGRAM if tokens else "none"
    runs: list[list[int]] = []
    if cache is not None:
        hit = cache.lookup(history, k)
        if hit is not None and hit.tokens:
            if hit.match_len > matched:
                tokens, source, matched = list(hit.tokens[:k]), CACHE, hit.match_len
            runs = [list(r) for r in hit.runs[: policy.tree_runs]]
    tree = TokenTree()
    if tokens:
        tree.add_path(tokens)
        for run in runs:
            tree.add_path(run[:k])
    return tree, source, matched


def accepted_along(tree: TokenTree, truth: Sequence[int]) -> int:
    """Tokens of ``truth`` the tree holds as a path from the root (what verification would keep)."""
    children = children_of(tree.parents)
    node, depth = ROOT, 0
    while depth < len(truth):
        nxt = next((c for c in children.get(node, []) if tree.tokens[c] == truth[depth]), None)
        if nxt is None:
            break
        node, depth = nxt, depth + 1
    return depth


def chain_of(tree: TokenTree, k: int) -> TokenTree:
    """The tree's first branch, cut to ``k`` tokens (what a kind of match earns is a chain's length)."""
    out = TokenTree()
    if k:
        out.add_path(tree.tokens[:k])
    return out


def replay_sample(prompt_ids: list[int], generated: list[int], cache: LocalContinuations | None,
                  policy: Policy, costs: PricedRounds, rates: MatchRates, sampled: bool,
                  totals: dict[str, float]) -> None:
    """One recorded sample, round by round, as the loop would speculate on it."""
    if cache is not None:
        cache.learn(prompt_ids, max(0, len(prompt_ids) - PROMPT_TOKENS_LEARNED))
    tracker = AcceptanceTracker()  # the request's own rate
    history, learned, t = list(prompt_ids), len(prompt_ids), 0
    while t < len(generated):
        k = min(policy.k, len(generated) - t - 1)
        if policy.k_rule == PER_REQUEST:
            k = choose_k(tracker.rate, costs, k)
        tree, source, matched = proposal_tree(history, cache, k, policy)
        if policy.k_rule == PER_MATCH and len(tree):
            tree = chain_of(tree, rates.choose_k(source, matched, sampled, costs, len(tree)))
        kept = accepted_along(tree, generated[t:]) if len(tree) else 0
        if len(tree):
            tracker.observe(len(tree), kept)
            rates.observe(source, matched, sampled, len(tree), kept)
        else:
            source = "none"
        step = kept + 1
        history.extend(generated[t : t + step])
        t += step
        totals["rounds"] += 1
        totals["tokens"] += step
        totals["nodes"] += len(tree)
        totals["steps"] += costs.price(len(tree) + 1)  # the verified rows: the nodes and the last committed token
        totals["oracle_steps"] += costs.price(kept + 1)  # had the round proposed only what was kept
        totals[f"rounds_{source}"] += 1
        if cache is not None:
            cache.learn(history, learned, final=t >= len(generated))
            learned = len(history)


def replay(rows: list[dict[str, Any]], policy: Policy, sharing: str, price: Callable[[int], float],
           sampled: bool = True, coordinators: int = 2) -> dict[str, Any]:
    """Every sample in the benchmark's order (sample i on coordinator i % 2); ``sharing``: "none" (the
    request's own text only), "local" (a cache per coordinator) or "shared" (one cache for all)."""
    def new_cache() -> LocalContinuations:
        return LocalContinuations("replay", min_n=policy.cache_min_n, max_n=policy.cache_max_n)

    caches: list[LocalContinuations | None]
    if sharing == "none":
        caches = [None] * coordinators
    elif sharing == "local":
        caches = [new_cache() for _ in range(coordinators)]
    else:
        caches = [new_cache()] * coordinators
    rates = [MatchRates() for _ in range(coordinators)]  # each coordinator learns its own
    costs = PricedRounds(price)
    totals: dict[str, float] = defaultdict(float)
    for i, row in enumerate(rows):
        replay_sample(row["prompt_ids"], row["token_ids"], caches[i % coordinators], policy, costs,
                      rates[i % coordinators], sampled, totals)
    r = totals["rounds"]
    return {"policy": policy.name, "sharing": sharing, "tokens_per_round": totals["tokens"] / r,
            "nodes_per_round": totals["nodes"] / r, "speed_vs_target_only": totals["tokens"] / totals["steps"],
            "oracle_speed": totals["tokens"] / totals["oracle_steps"], "none": totals["rounds_none"] / r,
            "own_text": totals[f"rounds_{NGRAM}"] / r, "cache": totals[f"rounds_{CACHE}"] / r}


SHARINGS = ("none", "local", "shared")
POLICIES = (
    Policy("k 4 fixed", k_rule=FIXED),
    Policy("k <= 4 per request", k_rule=PER_REQUEST),
    Policy("k <= 4 per kind of match"),
    Policy("k <= 8 per kind of match", k=8),
    Policy("k <= 8 per kind, cache n >= 1", k=8, cache_min_n=1),
    Policy("k 4 fixed + 3 cache runs", k_rule=FIXED, tree_runs=4),
)


def replay_all(args: argparse.Namespace) -> int:
    data = json.loads(args.recording.read_text())
    costs = json.loads(args.costs.read_text()) if args.costs else None
    price = relative_cost(costs)
    by_prompt: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in sorted(data["rows"], key=lambda r: (r["prompt_id"], r["sample"])):
        by_prompt[row["prompt_id"]].append(row)
    ordered = [row for group in by_prompt.values() for row in group[: args.samples or None]]
    records = []
    for policy in POLICIES:
        found = {sharing: replay(ordered, policy, sharing, price, data["temperature"] > 0) for sharing in SHARINGS}
        for rec in found.values():
            rec["shared_over_local"] = found["shared"]["speed_vs_target_only"] / found["local"]["speed_vs_target_only"]
            records.append(rec)
    samples = len(ordered) // max(1, len(by_prompt))
    workload = (f"{len(by_prompt)} prompts x {samples} samples x {data['max_new_tokens']} tokens at "
                f"T = {data['temperature']} ({data['target']}), two coordinators")
    priced = (f"verification priced by {args.costs.name} ({costs['target']}, {costs['dtype']})" if costs
              else "every round priced as one step")
    table = markdown_table(records, ["policy", "sharing", "tokens_per_round", "nodes_per_round",
                                     "speed_vs_target_only", "oracle_speed", "none", "own_text", "cache",
                                     "shared_over_local"])
    print(f"{workload}; {priced}\n\n{table}")
    settings = {"recording": str(args.recording), "costs": str(args.costs) if args.costs else None,
                "samples": samples, "prompts": len(by_prompt)}
    write_json(args.out, NAME, {"settings": settings, "workload": workload, "prices": costs, "records": records})
    write_markdown(args.out, NAME, "Rollouts replayed through the n-gram proposers", f"{workload}; {priced}\n\n{table}")
    fig, (ax,) = new_figure(width=9.0)
    names = [p.name for p in POLICIES]
    grouped_bars(ax, names, {sharing: [r["speed_vs_target_only"] for r in records if r["sharing"] == sharing]
                             for sharing in SHARINGS}, "speed vs target-only (replayed)")
    ax.set_title(workload, fontsize="small")
    print(f"wrote {save_figure(fig, args.out, NAME)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    rec = sub.add_parser("record", help="sample rollouts with the target alone and save their token ids")
    rec.add_argument("--target", default="qwen-coder-1.5b", help="catalog name or model directory")
    rec.add_argument("--dtype", default="auto", help="the target's dtype (auto: the engine's choice)")
    rec.add_argument("--prompts", type=int, default=4, help="HumanEval prompts")
    rec.add_argument("--samples", type=int, default=8, help="samples per prompt")
    rec.add_argument("--max-new-tokens", type=int, default=128)
    rec.add_argument("--temperature", type=float, default=0.8)
    rec.add_argument("--seed", type=int, default=0, help="prompt selection and the first sample's seed")
    rec.add_argument("--recording", type=Path, default=DEFAULT_RECORDING, help="where to write the token ids")
    cst = sub.add_parser("cost", help="measure the target's forward of 1..33 new tokens (verification prices)")
    cst.add_argument("--target", default="qwen-coder-1.5b", help="catalog name or model directory")
    cst.add_argument("--dtype", default="auto", help="the target's dtype (auto: the engine's choice)")
    cst.add_argument("--prefix-len", type=int, default=256, help="cached tokens before the probed ones")
    cst.add_argument("--reps", type=int, default=5, help="repetitions of each size (median kept)")
    cst.add_argument("--costs", type=Path, default=DEFAULT_COSTS, help="where to write the prices")
    rep = sub.add_parser("replay", help="replay a recording through the proposers and policies")
    rep.add_argument("--recording", type=Path, default=DEFAULT_RECORDING)
    rep.add_argument("--samples", type=int, default=0, help="first N samples of each prompt (0: all)")
    rep.add_argument("--costs", type=Path, default=None,
                     help="verification prices from the cost step (without: every round costs one step)")
    rep.add_argument("--out", type=Path, default=RESULTS, help="results directory (cache_replay.json/.md/.png)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return {"record": record, "cost": cost, "replay": replay_all}[args.step](args)


if __name__ == "__main__":
    raise SystemExit(main())
