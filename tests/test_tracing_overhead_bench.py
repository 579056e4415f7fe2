"""benchmarks/tracing_overhead.py's arithmetic: pairs by prompt, ratios only where both wrote the same tokens."""

from __future__ import annotations

import pytest

from benchmarks.tracing_overhead import summarize


def row(system: str, prompt: str, wall_s: float, tokens: int = 10) -> dict:
    return {"system": system, "prompt": prompt, "category": "qa", "wall_s": wall_s, "tokens": tokens, "first": False}


def test_the_overhead_is_the_median_of_same_prompt_ratios_and_spans_count_the_uncounted_first_call():
    rows = [row("untraced", "a", 1.0), row("traced", "a", 1.1),
            row("traced", "b", 2.0), row("untraced", "b", 2.0),
            row("untraced", "c", 1.0), row("traced", "c", 0.9),
            row("untraced", "d", 1.0, tokens=10), row("traced", "d", 9.0, tokens=11)]  # differs: not compared
    table, pairs = summarize(rows, spans=50)
    assert [t["system"] for t in table] == ["untraced", "traced"] and [t["requests"] for t in table] == [4, 4]
    assert table[0]["tokens_per_s"] == pytest.approx(40 / 5.0) and table[1]["tokens_per_s"] == pytest.approx(41 / 13.0)
    assert pairs["pairs"] == 4 and pairs["pairs_same_tokens"] == 3
    assert pairs["ratio_median"] == pytest.approx(1.0)
    assert pairs["spans_per_request"] == pytest.approx(50 / 5)
