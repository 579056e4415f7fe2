"""The target's log-probabilities of a prompt's own tokens (``SamplingParams.prompt_logprobs``: OpenAI's ``echo``).

Prompt token ``i`` (``i >= 1``) is scored by row ``i - 1``, whose logits are the target's
distribution after tokens ``0..i-1``; the first token has no score. The log-probabilities are
the raw logits' log-softmax, as the emitted tokens' (``tandem.spec.rejection``): before
penalties, bias, grammar, temperature, top-k and top-p. Since rows are fixed by position
(``tandem/attention/sdpa.py``), a prompt token's score equals bitwise the score the target
gives the same token when it emits it after the same text.

A prompt asking for them is computed in runs of at most ``SCORED_ROWS_PER_STEP`` rows, so the
logits held at once stay bounded (256 rows of Qwen's 151,936 ids: 156 MB in float32). It starts
on the prefix cache only where its blocks' scores were kept too (``tandem.prompt_score_cache``):
a cached block keeps KV, not logits.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.spec.transport import TokenLogprob

SCORED_ROWS_PER_STEP = 256


def score_rows(logits: torch.Tensor, next_tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Row ``r`` of ``logits`` ``[R, vocab]`` scores ``next_tokens[r]``, with its rank (1 + how many tokens the row
    finds more likely) and its ``top`` most likely tokens.

    Computed where the logits are and read with one copy (a host sync per call: a scored prompt's step
    has to hand its scores back anyway)."""
    rows = len(next_tokens)
    if rows == 0:
        return []
    if logits.shape[0] != rows:
        raise ValueError(f"{logits.shape[0]} rows of logits for {rows} tokens to score")
    logp = torch.log_softmax(logits.float(), dim=-1)  # [R, vocab]
    tokens = torch.tensor(list(next_tokens), dtype=torch.int64, device="cpu").to(logp.device)  # [R]
    chosen = logp.gather(1, tokens[:, None])  # [R, 1]
    ranks = (logp > chosen).sum(dim=-1).float() + 1  # [R]; float32: exact below 2**24
    parts = [chosen.squeeze(1), ranks]  # [R] each
    if top:
        values, ids = logp.topk(top, dim=-1)  # [R, top] each, most likely first
        parts += [values.flatten(), ids.flatten().float()]  # ids as float32: exact below 2**24
    flat = torch.cat(parts).tolist()
    values_at, ids_at = 2 * rows, 2 * rows + rows * top
    return [TokenLogprob(flat[r], [int(i) for i in flat[ids_at + r * top: ids_at + (r + 1) * top]],
                         flat[values_at + r * top: values_at + (r + 1) * top], int(flat[rows + r]))
            for r in range(rows)]
