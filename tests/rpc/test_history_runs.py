"""How a worker feeds tokens it has not read: as the target first read them (tandem/rpc/sequence_engine.py)."""

from __future__ import annotations

from tandem.attention.sdpa import ROWWISE_MAX_QUERY
from tandem.rpc.sequence_engine import Run, history_runs


def tokens_of(runs: list[Run]) -> list[list[int]]:
    return [run.tokens for run in runs]


def test_the_prompt_is_one_prompt_run_and_generated_tokens_come_in_short_runs():
    tokens = list(range(40))
    runs = history_runs(tokens, 0, prompt_len=5)
    assert runs[0] == Run(tokens[:5], True) and sum(tokens_of(runs), []) == tokens
    assert len(runs) > 2 and all(len(r.tokens) <= ROWWISE_MAX_QUERY and not r.prompt for r in runs[1:])
    assert history_runs(tokens, 0, prompt_len=0) == [Run(tokens, True)]  # 0: all of it is prompt


def test_a_feed_that_starts_inside_the_prompt_or_after_it_keeps_the_same_boundaries():
    tokens = list(range(40))
    assert history_runs(tokens, 3, prompt_len=5)[0] == Run([3, 4], True)  # the rest of the prompt, alone
    assert history_runs(tokens, 3, prompt_len=5)[1:] == history_runs(tokens, 0, prompt_len=5)[1:]
    after = history_runs(tokens, 30, prompt_len=5)
    assert sum(tokens_of(after), []) == tokens[30:]
    assert all(len(r.tokens) <= ROWWISE_MAX_QUERY and not r.prompt for r in after)
    assert history_runs(tokens, 40, prompt_len=5) == []
    # a draft's first read after the target's Prefill: the prompt, then the target's first token alone
    assert history_runs(tokens[:6], 0, prompt_len=5) == [Run(tokens[:5], True), Run([5], False)]
