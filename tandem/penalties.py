"""Penalties and logit bias: each scored row's logits adjusted for the context that row predicts after.

A Verify scores several rows of one sequence in one pass, and row i predicts the token after the
committed history AND the drafted tokens on the path to it (a chain's first i drafts, a tree node's
ancestors). A penalty that counts "the text so far" must count those drafts at that row, or a drafted
token's row would be judged against another context than plain decoding gives it, and the output
would no longer be the target alone's. So the caller names each row's path (``row_paths``), and every
row gets its own counts, built on the device from one host-to-device copy.

The rules, in vLLM's order (its sampler; OpenAI's definitions of the last two):

1. ``logit_bias``: added to the named tokens' logits.
2. ``repetition_penalty`` r (CTRL, Keskar et al. 2019; transformers' ``RepetitionPenaltyLogitsProcessor``):
   every token present in the row's context, prompt included, has its logit divided by r when
   positive and multiplied by r otherwise.
3. ``frequency_penalty`` f and ``presence_penalty`` p: ``logit -= f * count + p * (count > 0)``, counts
   over the generated tokens of the row's context (the prompt is not counted).

Greedy takes the argmax of the adjusted row; sampling applies temperature, top-k and top-p after.
Log-probabilities stay the raw logits' (``tandem.spec.rejection``), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.sampling_params import SamplingParams


def prompt_presence(prompt: Sequence[int], vocab: int, device: torch.device | str) -> torch.Tensor:
    """``[vocab]`` bool: the tokens a prompt holds (a sequence keeps it: the prompt never changes)."""
    seen = torch.zeros(vocab, dtype=torch.bool, device=device)
    ids = sorted({t for t in prompt if t < vocab})
    if ids:
        seen[torch.tensor(ids, dtype=torch.int64, device="cpu").to(device, non_blocking=True)] = True
    return seen


def row_paths_of(tokens: Sequence[int], parents: Sequence[int] | None) -> list[list[int]]:
    """Each scored row's drafted path: row 0 (after the committed history) none, row i + 1 the tokens from
    the root to draft node i. ``parents`` None or empty: a chain (node i's parent is node i - 1)."""
    paths: list[list[int]] = [[]]
    for i, token in enumerate(tokens):
        parent = i - 1 if not parents else parents[i]
        paths.append([*paths[parent + 1], token])
    return paths


def adjust_logits(
    logits: torch.Tensor,  # [R, vocab] float32, row r predicting the token after output + row_paths[r]
    params: SamplingParams,
    prompt_seen: torch.Tensor | None,  # [vocab] bool (``prompt_presence``); None: the prompt is not penalised
    output: Sequence[int],  # the generated tokens committed before row 0
    row_paths: Sequence[Sequence[int]],  # [R] each row's drafted tokens after ``output`` (``row_paths_of``)
) -> torch.Tensor:
    """``[R, vocab]`` float32: the rows adjusted as the module doc says (a new tensor; ``logits`` is untouched).

    Token ids at or past ``vocab`` are left out (a draft may hold fewer ids than the target it serves).
    """
    rows, vocab = logits.shape
    assert len(row_paths) == rows, f"{len(row_paths)} row paths for {rows} rows"
    device = logits.device
    out = logits.float().clone()
    if params.logit_bias:
        kept = [(t, b) for t, b in params.logit_bias if t < vocab]
        if kept:
            ids = torch.tensor([t for t, _ in kept], dtype=torch.int64, device=device)
            out[:, ids] += torch.tensor([b for _, b in kept], dtype=out.dtype, device=device)
    if params.repetition_penalty == 1.0 and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0:
        return out
    # One copy, nothing read back: the committed output, then each drafted token's (row, id), for every
    # row that sees it.
    generated = [t for t in output if t < vocab]
    pairs = [(r, t) for r, path in enumerate(row_paths) for t in path if t < vocab]
    host = torch.tensor([*generated, *(r for r, _ in pairs), *(t for _, t in pairs)], dtype=torch.int64, device="cpu")
    committed, row_of, token_of = host.to(device, non_blocking=True).split([len(generated), len(pairs), len(pairs)])
    counts = torch.zeros(rows, vocab, dtype=out.dtype, device=device)  # [R, vocab]: each row's generated counts
    if generated:
        counts += torch.bincount(committed, minlength=vocab).to(out.dtype)  # [vocab], the same for every row
    if pairs:
        counts.index_put_((row_of, token_of), torch.ones(len(pairs), dtype=out.dtype, device=device), accumulate=True)
    present = counts > 0  # [R, vocab]
    if params.repetition_penalty != 1.0:
        seen = present if prompt_seen is None else present | prompt_seen  # [R, vocab]
        r = params.repetition_penalty
        out = torch.where(seen, torch.where(out > 0, out / r, out * r), out)
    if params.frequency_penalty:
        out -= params.frequency_penalty * counts
    if params.presence_penalty:
        out -= params.presence_penalty * present.to(out.dtype)
    return out
