"""A prompt that starts like one the target is computing now waits a step, then reuses it from the prefix cache.

The prefix cache serves blocks already computed and committed. Prompts that share a long
prefix and reach the target together each computed it: in one batch (the ``n`` choices of one
HTTP request, sent at once), or beside a prompt still being computed in chunks (beside running
streams) or in scored steps of 256 rows (an evaluation harness's answers after one context, sent
concurrently). So a new Prefill whose full blocks are, beyond what is cached, among those of a
prompt being computed (one still in chunks, or an earlier new Prefill of this batch) answers
``Unfinished`` without starting: the batcher puts it back at the head of the queue, and each step
it looks again, until that prompt is computed and its blocks are committed; then it takes them
from the cache and computes only the rest.

Waiting pays when the shared tokens cost more than what the wait adds. Computed beside each
other, the two prompts' tokens all go through the model; one after the other, the follower's
shared tokens do not, for about one more step's fixed cost. So a Prefill waits when
``t * shared > base`` (``t`` a prompt token's measured price, ``base`` a step's, the worker's own
fits); before they are measured, when at least ``MIN_SHARED_TOKENS`` are shared. A scored prompt
(``prompt_logprobs``) starts on cached blocks only with their kept scores
(``tandem.prompt_score_cache``), so it waits only for a scored prompt with the same top count. A
wait ends when the prompt waited for is computed, fails or is released: the follower then
computes what it lacks. The prompt waited for is always ahead of it in the queue (an unfinished
call goes back first) or in the same batch, so the wait ends.

Output does not depend on any of this: a prompt's rows are the same after a cached prefix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.spec.proposers import common_prefix_len

MIN_SHARED_TOKENS = 256  # shared tokens worth a wait before the worker has measured its costs


@dataclass(frozen=True, slots=True)
class PromptRead:
    """A prompt being computed: its tokens, and its top count if scored (None: plain)."""

    tokens: Sequence[int]
    scored: int | None


def shared_blocks(a: Sequence[int], b: Sequence[int], block_size: int) -> int:
    """Full blocks ``b`` starts with that are ``a``'s too (of ``b``'s tokens but its last: a Prefill computes it)."""
    return min(common_prefix_len(a, b), len(b) - 1) // block_size


def should_wait(follower: PromptRead, reads: Sequence[PromptRead], cached_tokens: int, block_size: int,
                prompt_token_s: float, base_s: float) -> bool:
    """Whether a new Prefill of ``follower`` should wait for one of ``reads`` (prompts being computed): the tokens
    it would take from the cache once they are, beyond the ``cached_tokens`` it could take now, are worth it."""
    gain = 0
    for read in reads:
        if follower.scored is not None and read.scored != follower.scored:
            continue  # its blocks would come without the scores this prompt needs
        gain = max(gain, shared_blocks(read.tokens, follower.tokens, block_size) * block_size - cached_tokens)
    if gain <= 0:
        return False
    if prompt_token_s <= 0:
        return gain >= MIN_SHARED_TOKENS
    return prompt_token_s * gain > base_s
