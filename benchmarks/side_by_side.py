"""Methods side by side on the same requests, in one process: target-only first on each request (the reference of
its speed and of its tokens), then every other method in an order that rotates from request to request, so that
machine noise and a warming cache hit them alike; and the per-method summary those runs make."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

Row = dict[str, Any]


def rotating_runs(count: int, methods: Sequence[str], one: Callable[[int, str], Row], desc: str) -> list[Row]:
    """``one(i, method)`` for each request ``i``: ``none`` first, then ``methods`` rotated by ``i``. Each row gets
    ``same_as_target_only``: its ``token_ids`` are the ``none`` row's."""
    from tqdm import tqdm

    rows = []
    for i in tqdm(range(count), desc=desc, unit="request", file=sys.stderr):
        plain = one(i, "none")
        plain["same_as_target_only"] = True
        rows.append(plain)
        shift = i % len(methods)
        for method in [*methods[shift:], *methods[:shift]]:
            row = one(i, method)
            row["same_as_target_only"] = row["token_ids"] == plain["token_ids"]
            rows.append(row)
    return rows


def per_method(rows: Sequence[Row], unit: str, extra: Callable[[list[Row]], Row] | None = None) -> list[Row]:
    """Per method (target-only first), over its rows: how many (``unit``), tokens, tokens/s (generated tokens over
    the generate calls' wall seconds) and its ratio to target-only's, tokens per round (the prefill's token counts
    as a round), acceptance, ``extra``'s columns, and answers equal to target-only's."""
    out = []
    plain_rate = None
    for method in dict.fromkeys(r["method"] for r in rows):
        group = [r for r in rows if r["method"] == method]
        tokens, seconds = sum(r["tokens"] for r in group), sum(r["seconds"] for r in group)
        drafted, accepted = sum(r["drafted"] for r in group), sum(r["accepted"] for r in group)
        rate = tokens / seconds
        plain_rate = plain_rate or rate  # target-only comes first
        out.append({"method": "target-only" if method == "none" else method, unit: len(group), "tokens": tokens,
                    "tokens_per_s": rate, "x_target_only": rate / plain_rate,
                    "tokens_per_round": tokens / max(1, sum(r["rounds"] + 1 for r in group)),
                    "acceptance": accepted / drafted if drafted else None, **(extra(group) if extra else {}),
                    "same_as_target_only": sum(r["same_as_target_only"] for r in group)})
    return out
