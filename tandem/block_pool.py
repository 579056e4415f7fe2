"""Who holds each KV block, and which blocks hold a known prefix (the prefix cache's index).

A block is in exactly one of three states:

- free: nobody holds it and its content means nothing;
- held: one or more sequences hold it (``refcount`` > 0). A block several sequences hold is a
  shared prefix block; none of them writes into it (``PagedKVCache`` copies it on write);
- evictable: nobody holds it, but it is registered in the content index, so a later prompt
  that starts the same way can take it back instead of recomputing it.

A block is registered under the hash of its content (``block_hash``: its parent block's hash
and its own tokens) only by ``PagedKVCache.commit``, that is when every token in it is
committed. Allocation takes a free block first, then evicts the least recently released
evictable one (its index entry goes with it), the same policy as vLLM's free-block queue.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from tandem.errors import KVCacheExhaustedError


def block_hash(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The content hash of a full block: its parent's hash (the root's: the cache's salt) and its tokens.

    A chain: a block's hash names its whole prefix, so equal hashes mean equal KV (same model,
    same dtype, same positions). 128-bit BLAKE2b: collisions are not a practical concern.
    """
    return hashlib.blake2b(parent + array("q", tokens).tobytes(), digest_size=16).digest()


def block_chain(tokens: Sequence[int], block_size: int, salt: bytes = b"") -> Iterator[bytes]:
    """The content hash of each full block of ``tokens``, in order, the chain rooted at ``salt`` (lazily: a caller
    that stops at its first miss hashes no further)."""
    parent = salt
    for i in range(len(tokens) // block_size):
        parent = block_hash(parent, tokens[i * block_size:(i + 1) * block_size])
        yield parent


def prefix_limit(prompt_len: int) -> int:
    """Most prompt tokens a sequence may take from the prefix cache: at least its last token is computed
    (its logits give the first generated token). Prompt rows are bitwise the same after a cached prefix
    of any length (prompt attention is fixed by position: tandem/attention/sdpa.py)."""
    return max(0, prompt_len - 1)


@dataclass(slots=True)
class PrefixCacheStats:
    """Cumulative since the pool was made, plus the index's size now (``WorkerInfo.prefix_cache``)."""

    enabled: bool
    prompt_tokens: int = 0  # tokens looked up (prompts)
    reused_tokens: int = 0  # of those, tokens whose KV was taken from the index
    cached_blocks: int = 0
    evictable_blocks: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


class BlockPool:
    """Free list, reference counts and the content index of one KV pool's ``num_blocks`` blocks."""

    def __init__(self, num_blocks: int, prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.prefix_caching = prefix_caching
        # Lowest ids handed out first so that a fresh pool's layout is predictable in tests.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refcount = [0] * num_blocks
        self._hash_of: dict[int, bytes] = {}  # registered block -> its content hash
        self._block_of: dict[bytes, int] = {}  # content hash -> the registered block holding it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # registered, unheld; oldest release first
        self.stats = PrefixCacheStats(enabled=prefix_caching)

    # ----- counts ----------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Blocks an allocation can take: free ones and evictable ones."""
        return len(self._free) + len(self._evictable)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    def is_registered(self, block: int) -> bool:
        return block in self._hash_of

    def snapshot(self) -> PrefixCacheStats:
        """A copy with the index's size now (read by Info and metrics scrapes off the model thread:
        it changes nothing, and a count a batch later is as good)."""
        s = self.stats
        return PrefixCacheStats(s.enabled, s.prompt_tokens, s.reused_tokens, len(self._hash_of),
                                len(self._evictable), s.evictions)

    # ----- holding -----------------------------------------------------------------------
    def allocate(self) -> int:
        """A block for new content, held once: a free one, else the least recently released cached one."""
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._unindex(block)
            self.stats.evictions += 1
        else:
            raise KVCacheExhaustedError(f"KV cache exhausted: all {self.num_blocks} blocks are held")
        self._refcount[block] = 1
        return block

    def hold(self, block: int) -> None:
        """One more sequence holds ``block`` (a cached prefix block taken back, or shared)."""
        if self._refcount[block] == 0:
            self._evictable.pop(block, None)
        self._refcount[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer; an unheld block stays cached when registered, else it is free."""
        if self._refcount[block] <= 0:
            raise RuntimeError(f"block {block} released more often than held")
        self._refcount[block] -= 1
        if self._refcount[block] == 0:
            if block in self._hash_of:
                self._evictable[block] = None  # most recently released: evicted last
            else:
                self._free.append(block)

    # ----- the content index -------------------------------------------------------------
    def lookup(self, content: bytes) -> int | None:
        return self._block_of.get(content) if self.prefix_caching else None

    def register(self, block: int, content: bytes) -> bool:
        """Index a held block of committed tokens under ``content``; False when another block holds it
        already (two prompts computed the same prefix at once: the first one stays the cached one)."""
        if not self.prefix_caching or content in self._block_of or block in self._hash_of:
            return False
        self._block_of[content] = block
        self._hash_of[block] = content
        return True

    def unregister(self, block: int) -> None:
        """Take a block out of the index (its holder is about to overwrite part of it)."""
        if self._refcount[block] != 1:
            raise RuntimeError(f"block {block} is held {self._refcount[block]} times: only a lone holder "
                               "may take it out of the index")
        self._unindex(block)

    def _unindex(self, block: int) -> None:
        content = self._hash_of.pop(block)
        del self._block_of[content]

    def reset_stats(self) -> None:
        self.stats = PrefixCacheStats(enabled=self.prefix_caching)

    def count_lookup(self, prompt_tokens: int, reused_tokens: int) -> None:
        self.stats.prompt_tokens += prompt_tokens
        self.stats.reused_tokens += reused_tokens
