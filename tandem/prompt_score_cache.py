"""Prompt tokens' scores kept by block, so that a scored prompt can start on the prefix cache.

The prefix cache keeps KV, not logits, and a scored prompt (``SamplingParams.prompt_logprobs``,
OpenAI's ``echo``) needs every row's. Evaluation harnesses send one context with each of its
answers (lm-evaluation-harness's multiple choice: a context, then each choice scored after it), so
without these the context was computed once per answer.

Token ``i``'s score is a function of tokens ``0..i`` alone (row ``i - 1``'s log-softmax, rows fixed
by position), so a full block's scores are named by the block's content hash (``block_hash``, the
same chain the KV blocks use) and the ``top`` count asked for: block ``j`` keeps the scores of its
own tokens, ``j * B .. j * B + B - 1``, the first block one fewer (token 0 has none). The row that
scores the first token after a reused prefix is the prefix's last row, which the cache does not
keep: the target recomputes that one row (``TargetEngine._reuse_prefix``).

Least recently used blocks go first once ``capacity_blocks`` are kept; a block's scores stay
only while prefix caching is on and are never a rejected token's (only prompts are scored).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tandem.block_pool import block_chain
from tandem.spec.transport import TokenLogprob

SCORE_CACHE_TOKENS = 65_536  # prompt tokens whose scores are kept (top 20: about 1 KB a token in Python objects)


class PromptScoreCache:
    """Scores of full prompt blocks, keyed by (content hash, top count)."""

    def __init__(self, block_size: int, salt: bytes, capacity_blocks: int) -> None:
        if block_size < 1 or capacity_blocks < 1:
            raise ValueError(f"block size and capacity must be >= 1, got {block_size} and {capacity_blocks}")
        self.block_size = block_size
        self.salt = salt  # the KV cache's: what else makes a row (model, dtype)
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[tuple[bytes, int], tuple[TokenLogprob, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def lookup(self, tokens: Sequence[int], top: int, limit: int) -> list[TokenLogprob]:
        """The scores of the longest run of kept full blocks that ``tokens[:limit]`` starts with: those of tokens
        ``1 .. R - 1`` for a run of ``R`` tokens (empty on a miss)."""
        scores: list[TokenLogprob] = []
        for content in block_chain(tokens[:limit], self.block_size, self.salt):
            kept = self._blocks.get((content, top))
            if kept is None:
                break
            self._blocks.move_to_end((content, top))
            scores += kept
        return scores

    def store(self, tokens: Sequence[int], top: int, scores: Sequence[TokenLogprob]) -> None:
        """Keep the scores of each full block of ``tokens`` they cover: ``scores[i]`` is token ``i + 1``'s."""
        bs = self.block_size
        for j, content in enumerate(block_chain(tokens[:len(scores) + 1], bs, self.salt)):
            key = (content, top)
            if key in self._blocks:
                self._blocks.move_to_end(key)
                continue
            self._blocks[key] = tuple(scores[max(0, j * bs - 1):(j + 1) * bs - 1])
            if len(self._blocks) > self.capacity_blocks:
                self._blocks.popitem(last=False)
