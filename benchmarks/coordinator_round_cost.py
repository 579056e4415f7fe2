"""The coordinator's own work in one n-gram round, by history length: full rescans against the per-request index.

What a round of a ``ngram`` request costs on the coordinator's event loop
besides waiting for its target (no model runs here): the prompt lookup over the
request's own text (the chain's match and, for a token tree, its other
continuations), the continuation cache's local lookup and its ``learn`` of the
round's new tokens. Two ways, at 100, 1,000 and 8,000 tokens of history:

- ``old``: main before the index (issue 23, defect 8): ``lookup_match`` and
  ``lookup_continuations`` scan the whole history (numpy), and ``learn`` packs
  the whole history to read the observations of its last tokens;
- ``new``: ``NgramIndex`` (the round indexes only its new tokens, then probes
  a dict per n-gram size) and ``learn`` packing only the tail it needs.

Each sample is one round at exactly that length: the history's last ``--step``
tokens are the round's commits (the index has seen the rest; restored,
untimed, after every timed round), then the round's lookups and learn. Both
ways must propose the same (checked). The history is real text: the token ids
of benchmarks/results/rollout_recording.json (Qwen2.5-Coder prompts and
samples), in order, repeated as needed. The continuation cache holds that
history's observations (local tier, no Redis). Median of --reps interleaved
samples. The 1-minute load average before and after is recorded: other
processes on the cores inflate every figure.

    python benchmarks/coordinator_round_cost.py
    python benchmarks/coordinator_round_cost.py --lengths 100 1000 8000 --reps 200

Writes coordinator_round_cost.json, .md and .png into --out (default benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/coordinator_round_cost.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    DEFAULT_RESULTS_DIR,
    grouped_bars,
    markdown_table,
    new_figure,
    save_figure,
    write_json,
    write_markdown,
)
from tandem.spec.continuations import continuation_items, pack_tokens  # noqa: E402
from tandem.spec.ngram import NgramIndex, lookup_continuations, lookup_match  # noqa: E402
from tandem.spec.options import SpecOptions  # noqa: E402
from tandem.spec.shared_cache import SharedContinuations  # noqa: E402

NAME = "coordinator_round_cost"
RECORDING = _REPO_ROOT / "benchmarks" / "results" / "rollout_recording.json"
LENGTHS = (100, 1000, 8000)
OPTIONS = SpecOptions("ngram", 4, tree="on", tree_width=2)  # the defaults of an n-gram request, with a tree
K = OPTIONS.k_max
BRANCHES = OPTIONS.tree_width + 1  # the loop asks for the tree's width + 1 continuations


def recorded_tokens(length: int) -> list[int]:
    """``length`` token ids of the recorded rollouts (prompt then sample, row after row), repeated if short."""
    rows = json.loads(RECORDING.read_text(encoding="utf-8"))["rows"]
    ids = [t for row in rows for t in (*row["prompt_ids"], *row["token_ids"])]
    while len(ids) < length:
        ids += ids
    return ids[:length]


def old_learn(cache: SharedContinuations, tokens: list[int], start: int) -> None:
    """``SharedContinuations.learn`` on main before the index: pack the whole history (local tier only)."""
    local = cache.local
    local.add_items(list(continuation_items(pack_tokens(tokens), start, False, local.orders,
                                            local.max_continuation)))


def old_own_text(history: list[int]) -> tuple[Any, ...]:
    """Main before the index: scan the whole history for the chain's match and the tree's branches."""
    lo, hi = OPTIONS.ngram_min, OPTIONS.ngram_max
    return lookup_match(history, K, lo, hi), lookup_continuations(history, K, lo, hi, BRANCHES)


def new_own_text(history: list[int], index: NgramIndex) -> tuple[Any, ...]:
    """The loop now: the request's index takes the round's new tokens, then probes."""
    lo, hi = OPTIONS.ngram_min, OPTIONS.ngram_max
    return index.lookup_match(history, K, lo, hi), index.lookup_continuations(history, K, lo, hi, BRANCHES)


def timed_us(fn: Callable[[], Any]) -> tuple[Any, float]:
    """``fn()``'s result and its wall-clock microseconds."""
    start = time.perf_counter()
    result = fn()
    return result, (time.perf_counter() - start) * 1e6


def one_pass(source: list[int], rounds: int, step: int, samples: dict[str, list[float]]) -> None:
    """A request's last ``rounds`` rounds before it reaches ``len(source)`` tokens, run both ways.

    Untimed first: the history up to the window, its index and the caches that learned it. Then
    each round commits ``step`` tokens and runs both ways' lookups and learn (which way goes first
    alternates, so the machine's noise falls on both), and both must propose the same.
    """
    begin = len(source) - rounds * step
    history = source[:begin]
    old_cache, new_cache = SharedContinuations("old", None), SharedContinuations("new", None)
    old_cache.learn(history, 0)
    new_cache.learn(history, 0)
    index = NgramIndex()
    new_own_text(history, index)
    for r in range(rounds):
        learned = len(history)
        history += source[learned : learned + step]
        ways = [("old", partial(old_own_text, history), old_cache,
                 partial(old_learn, old_cache, history, learned)),
                ("new", partial(new_own_text, history, index), new_cache,
                 partial(new_cache.learn, history, learned))]
        proposals = {}
        for name, own_text, cache, learn in ways if r % 2 else ways[::-1]:
            proposals[name], own_us = timed_us(own_text)
            hit, cache_us = timed_us(partial(cache.local.lookup, history, K))  # the same work both ways
            _, learn_us = timed_us(learn)
            proposals[name] += (hit,)
            for part, us in (("own_text", own_us), ("cache_lookup", cache_us), ("learn", learn_us),
                             ("round", own_us + cache_us + learn_us)):
                samples[f"{name}_{part}_us"].append(us)
        assert proposals["old"] == proposals["new"], f"the two ways proposed differently at {len(history)} tokens"


def index_bytes_per_token(history: list[int]) -> float:
    """Memory an ``NgramIndex`` holds for ``history`` (sizes ngram_min..ngram_max), per token."""
    tracemalloc.start()
    index = NgramIndex()
    index.lookup_match(history, K, OPTIONS.ngram_min, OPTIONS.ngram_max)
    held, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    del index
    return held / len(history)


def measure(length: int, step: int, reps: int) -> dict[str, Any]:
    """Median microseconds of ``reps`` rounds ending at ``length`` tokens (all in its last quarter)."""
    rounds = max(1, min(64, length // 4 // step))
    source = recorded_tokens(length)
    samples: dict[str, list[float]] = {f"{way}_{part}_us": [] for way in ("old", "new")
                                       for part in ("round", "own_text", "cache_lookup", "learn")}
    while len(samples["old_round_us"]) < reps:
        one_pass(source, min(rounds, reps - len(samples["old_round_us"])), step, samples)
    record: dict[str, Any] = {"history_tokens": length, "rounds_from": length - rounds * step}
    record.update({name: round(statistics.median(taken), 1) for name, taken in samples.items()})
    record["speedup"] = round(record["old_round_us"] / record["new_round_us"], 1)
    return record


def chart(records: list[dict[str, Any]], out: Path) -> Path:
    fig, (ax,) = new_figure()
    grouped_bars(ax, [f"{r['history_tokens']:,} tokens" for r in records],
                 {"old: rescan the history": [r["old_round_us"] for r in records],
                  "new: per-request index": [r["new_round_us"] for r in records]},
                 "coordinator us per n-gram round (median, log)")
    ax.set_yscale("log")
    ax.set_title("One n-gram round's lookups + learn on the coordinator, no model")
    return save_figure(fig, out, NAME)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS), help="history lengths (tokens)")
    parser.add_argument("--step", type=int, default=3, help="tokens a round commits (accepted drafts + 1)")
    parser.add_argument("--reps", type=int, default=200, help="timed rounds per measurement (median)")
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.step < 1 or args.reps < 1 or any(n <= args.step for n in args.lengths):
        parser.error("need --step >= 1, --reps >= 1 and every length above --step")

    load_before = os.getloadavg()[0]
    records = []
    for length in args.lengths:
        record = measure(length, args.step, args.reps)
        records.append(record)
        print(f"{length:>6} tokens: old {record['old_round_us']:>8.1f} us/round, new {record['new_round_us']:>6.1f} "
              f"us/round ({record['speedup']}x)", flush=True)
    index_bytes = round(index_bytes_per_token(recorded_tokens(max(args.lengths))))
    columns = ["history_tokens", "rounds_from", "old_round_us", "new_round_us", "speedup", "old_own_text_us",
               "new_own_text_us", "old_cache_lookup_us", "new_cache_lookup_us", "old_learn_us", "new_learn_us"]
    table = markdown_table(records, columns)
    print(table)
    print(f"index memory: {index_bytes} bytes per history token (n-gram sizes "
          f"{OPTIONS.ngram_min}..{OPTIONS.ngram_max})")
    settings = {"step": args.step, "reps": args.reps, "lengths": args.lengths, "k": K, "branches": BRANCHES,
                "ngram_sizes": [OPTIONS.ngram_min, OPTIONS.ngram_max], "python": platform.python_version(),
                "machine": platform.machine(), "cpus": os.cpu_count(),
                "load_avg_1min_before_after": [load_before, os.getloadavg()[0]]}
    payload = {"settings": settings, "records": records, "index_bytes_per_token": index_bytes}
    print(f"wrote {write_json(args.out, NAME, payload)}")
    body = (f"{table}\n\nMicroseconds per round (median of {args.reps}); a round commits {args.step} tokens. "
            f"Index memory: {index_bytes} bytes per history token.\n")
    print(f"wrote {write_markdown(args.out, NAME, 'Coordinator work per n-gram round', body)}")
    print(f"wrote {chart(records, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
