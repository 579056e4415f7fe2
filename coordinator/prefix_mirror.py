"""What one draft replica's prefix cache should hold, as far as this coordinator has seen.

A lone request does not make its draft read a long prompt until the answer can repay the read
(``SpeculationLoop._draft_waits``). A prompt whose blocks the draft already holds (one system prompt
before every question) costs only its new tail to read, so the loop asks the draft channel how much of
the prompt is cached. In process the channel looks at the draft's block index itself; over gRPC a
question per request would cost a round trip before the first round, so the coordinator keeps this
mirror instead: the chain hashes of the full prompt blocks it has seen a replica read (a draft offers
exactly those to its cache once it has drafted after them), least recently used first out, no more
than the replica's KV pool holds.

It is a hint, and it can be wrong both ways:

- too low: another coordinator's requests filled the cache, or a block was cached before this
  coordinator started. The request then waits as if nothing were cached, which is the rule's own
  worst case (it never pays more than about one read for waiting).
- too high: the replica evicted blocks to make room, or restarted at the same address. The draft
  then reads what it lacks at once, as every request did before the wait rule: one read, priced
  as if cached. A replica that stops answering is forgotten (``clear``), since it may come back empty.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from tandem.block_pool import block_chain


class PrefixMirror:
    """Chain hashes of the full blocks one replica should hold, least recently used first.

    A prompt's blocks are used head last, so that a trimmed mirror loses a prompt's tail before its head,
    as a worker's pool does (it frees a sequence's blocks tail first): a chain is only of use from its
    first block, and a lost head would make the blocks after it unreachable.
    """

    def __init__(self) -> None:
        self._blocks: OrderedDict[bytes, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def record(self, tokens: Sequence[int], block_size: int, capacity: int) -> None:
        """The replica read ``tokens`` (a prompt) and cached its full blocks; keep at most ``capacity`` blocks."""
        # Unsalted chain hashes: these names never leave the coordinator, and a worker's own salt is its secret.
        self._use(list(block_chain(tokens, block_size)))
        while len(self._blocks) > max(0, capacity):
            self._blocks.popitem(last=False)

    def match(self, tokens: Sequence[int], block_size: int) -> int:
        """How many leading tokens of ``tokens`` the replica should find cached (whole blocks); the ones
        found count as used, as a hit does on the replica."""
        found: list[bytes] = []
        for content in block_chain(tokens, block_size):
            if content not in self._blocks:
                break
            found.append(content)
        self._use(found)
        return len(found) * block_size

    def clear(self) -> None:
        self._blocks.clear()

    def _use(self, chain: list[bytes]) -> None:
        for content in reversed(chain):  # head last: the most recently used
            self._blocks[content] = None
            self._blocks.move_to_end(content)

