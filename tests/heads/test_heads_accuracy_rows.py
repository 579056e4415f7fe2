"""benchmarks/heads_accuracy.py scores a guess only where it is a token a head would draft in the answer."""

from __future__ import annotations

from benchmarks.heads_accuracy import answer_rows


def test_rows_scored_are_the_drafted_answer_tokens() -> None:
    # 4 prompt tokens (0-3), 4 answer tokens (4-7). Row t with `ahead` a guesses the label at t + a, which is
    # the target's token t + a + 1: drafted tokens are 5, 6, 7 (4 is the target's own first token).
    prompt_len, seq_len = 4, 8
    step1 = answer_rows(seq_len - 1, 1, prompt_len, seq_len)  # rows t = 0..6 guess tokens t + 2
    assert step1.nonzero().flatten().tolist() == [3, 4, 5]  # tokens 5, 6, 7
    step3 = answer_rows(seq_len - 3, 3, prompt_len, seq_len)  # rows t = 0..4 guess tokens t + 4
    assert step3.nonzero().flatten().tolist() == [1, 2, 3]  # tokens 5, 6, 7


def test_a_one_token_answer_has_nothing_to_score() -> None:
    assert not answer_rows(4, 1, 5, 6).any()
