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

And vLLM's ``allowed_token_ids``: every other token's logit is -inf, on every row (first, so that nothing after
it can bring a token back; ids past a draft's smaller vocabulary are left out, and a draft that holds none of
them proposes unmasked, since its proposals are only proposals).

And vLLM's ``bad_words`` (``bad_word_ids``): a one-token word's token is -inf on every row; a longer word's last
token is -inf on each row whose generated text (the committed output, then the row's path) ends with the word's
other tokens, so no row writes the word's end, whatever was drafted before it.

And vLLM's ``min_tokens``: a row predicting generated position n < ``min_tokens`` (n: the committed
output's length plus the row's path) gets -inf for each of ``min_tokens_stop_ids``, so no stop token
ends the text early, whatever was drafted before it.

Greedy takes the argmax of the adjusted row; sampling applies temperature, top-k and top-p after.
Log-probabilities stay the raw logits' (``tandem.spec.rejection``), as vLLM reports them by default.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from tandem.sampling_params import SamplingParams


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
    prompt_tokens: Collection[int],  # the distinct ids of the prompt (a sequence keeps them: a frozenset)
    output: Sequence[int],  # the generated tokens committed before row 0
    row_paths: Sequence[Sequence[int]],  # [R] each row's drafted tokens after ``output`` (``row_paths_of``)
) -> torch.Tensor:
    """``[R, vocab]`` float32: the rows adjusted as the module doc says (a new tensor; ``logits`` is untouched).

    Only the columns of tokens the context holds can change, so the penalties gather those ``U`` columns,
    adjust ``[R, U]`` and scatter them back: O(R * U), not O(R * vocab) (151,936 ids for Qwen: 0.74 ms a
    row dense on a 2-core CPU). Token ids at or past ``vocab`` are left out (a draft may hold fewer ids
    than the target it serves).
    """
    rows, vocab = logits.shape
    assert len(row_paths) == rows, f"{len(row_paths)} row paths for {rows} rows"
    device = logits.device
    out = logits.float().clone()
    _keep_allowed(out, params.allowed_token_ids)
    _ban_bad_words(out, params.bad_word_ids, output, row_paths)
    _hold_stop_tokens(out, params, len(output), row_paths)
    if params.logit_bias:
        kept = [(t, b) for t, b in params.logit_bias if t < vocab]
        if kept:
            ids = torch.tensor([t for t, _ in kept], dtype=torch.int64, device="cpu").to(device, non_blocking=True)
            out[:, ids] += torch.tensor([b for _, b in kept], dtype=out.dtype, device="cpu").to(device,
                                                                                             non_blocking=True)
    repetition = params.repetition_penalty != 1.0
    if not repetition and params.frequency_penalty == 0.0 and params.presence_penalty == 0.0:
        return out
    # The columns that can change: every generated or drafted id (and the prompt's, for the repetition penalty).
    generated = [t for t in output if t < vocab]
    pairs = [(r, t) for r, path in enumerate(row_paths) for t in path if t < vocab]
    columns = {t: None for t in generated}
    columns.update((t, None) for _, t in pairs)
    if repetition:
        columns.update((t, None) for t in prompt_tokens if t < vocab)
    if not columns:
        return out
    ids = list(columns)
    where = {t: j for j, t in enumerate(ids)}  # token id -> its column among the U gathered
    host = [*ids, *(where[t] for t in generated), *(r for r, _ in pairs), *(where[t] for _, t in pairs)]
    if repetition:
        host += [1 if t in prompt_tokens else 0 for t in ids]
    # One copy, nothing read back.
    flat = torch.tensor(host, dtype=torch.int64, device="cpu").to(device, non_blocking=True)
    sizes = [len(ids), len(generated), len(pairs), len(pairs), len(ids) if repetition else 0]
    cols, committed, row_of, col_of, in_prompt = flat.split(sizes)
    one = torch.ones((), dtype=out.dtype, device=device)
    counts = torch.zeros(len(ids), dtype=out.dtype, device=device).index_add_(
        0, committed, one.expand(len(generated)))  # [U]: the committed output's counts, every row's
    counts = counts.expand(rows, len(ids)).clone()  # [R, U]
    counts.index_put_((row_of, col_of), one.expand(len(pairs)), accumulate=True)  # each row's drafts
    present = counts > 0  # [R, U]
    sub = out[:, cols]  # [R, U]
    if repetition:
        seen = present | in_prompt.bool()  # [R, U]
        r = params.repetition_penalty
        sub = torch.where(seen, torch.where(sub > 0, sub / r, sub * r), sub)
    sub = sub - params.frequency_penalty * counts - params.presence_penalty * present.to(out.dtype)
    out[:, cols] = sub
    return out


def _keep_allowed(out: torch.Tensor, allowed: Sequence[int]) -> None:
    """allowed_token_ids: every other column -inf, in place (none of them in this vocabulary: left as it is)."""
    ids = [t for t in allowed if t < out.shape[1]]
    if not ids:
        return
    cols = torch.tensor(ids, dtype=torch.int64, device="cpu").to(out.device, non_blocking=True)
    kept = out[:, cols]  # [R, A]
    out.fill_(float("-inf"))
    out[:, cols] = kept


def _ban_bad_words(out: torch.Tensor, words: Sequence[Sequence[int]], output: Sequence[int],
                   row_paths: Sequence[Sequence[int]]) -> None:
    """bad_words: each row's banned ends -inf, in place: a word's last token where the row's generated text (the
    committed output, then its path) ends with the word's other tokens (a one-token word: always)."""
    if not words:
        return
    vocab = out.shape[1]
    longest = max(len(w) for w in words) - 1
    tail = list(output[-longest:]) if longest else []  # all any row's match can reach into the committed output
    rows: list[int] = []
    cols: list[int] = []
    for r, path in enumerate(row_paths):
        context = [*tail, *path]
        for word in words:
            head, last = word[:-1], word[-1]
            if last < vocab and (not head or (len(context) >= len(head) and context[len(context) - len(head):]
                                              == list(head))):
                rows.append(r)
                cols.append(last)
    if rows:
        flat = torch.tensor([*rows, *cols], dtype=torch.int64, device="cpu").to(out.device, non_blocking=True)
        r_idx, c_idx = flat.split([len(rows), len(cols)])
        out[r_idx, c_idx] = float("-inf")


def _hold_stop_tokens(out: torch.Tensor, params: SamplingParams, committed: int,
                      row_paths: Sequence[Sequence[int]]) -> None:
    """min_tokens: the stop tokens' logits -inf, in place, on rows predicting a generated position before it."""
    if not params.min_tokens:
        return
    early = [r for r, path in enumerate(row_paths) if committed + len(path) < params.min_tokens]
    ids = [t for t in params.min_tokens_stop_ids if t < out.shape[1]]
    if not early or not ids:
        return
    flat = torch.tensor([*early, *ids], dtype=torch.int64, device="cpu").to(out.device, non_blocking=True)
    rows, cols = flat.split([len(early), len(ids)])
    out[rows[:, None], cols[None, :]] = float("-inf")
