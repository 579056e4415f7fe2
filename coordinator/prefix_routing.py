"""Prefix-aware placement: send a prompt to the replica most likely to hold its prefix's KV.

Every worker keeps the KV of full blocks it has computed (prompts and
generated tokens), indexed by their content (its prefix cache); a prompt that
starts like an earlier one reuses them, but only on the replica that computed
them. So the coordinator gives each prompt a routing key, a hash chain over
its first full routing blocks of token ids (``routing_key``: up to
``KEY_BLOCKS`` blocks of ``ROUTING_BLOCK`` tokens), and sends equal keys to
the same replica:

- **Rendezvous (highest random weight) hashing.** Each replica's weight for a
  key is a hash of (key, replica address); the key goes to the heaviest.
  Every coordinator computes the same weights, with no shared state, and a
  replica that joins or leaves moves only the keys it gains or held (a ring
  would need virtual nodes for an even spread over a handful of replicas).
- **Bounded load** (consistent hashing with bounded loads, Mirrokni, Thorup
  and Zadimoghaddam 2018). A replica is skipped, for the next in the key's
  order, while its active requests reach ``ceil(c * (total + 1) / n)`` for the
  ``n`` candidates holding ``total`` active requests, ``c = LOAD_FACTOR``: no
  replica carries more than ``c`` times the mean, so a hot prefix (one system
  prompt before every question, one prompt sampled many times) fills its
  favoured replica up to the bound and overflows to the key's next choices,
  which then cache it too. The least loaded replica is always under the bound,
  so some replica always qualifies. The load is this coordinator's own count
  (``WorkerClient.active``, exact and immediate; the workers' counts arrive
  once a second): with several coordinators each keeps its own share bounded,
  and so the sum.

A prompt shorter than one routing block has no key: nothing of it is worth
routing for, so the pool's load score decides (``WorkerPool.pick``). A client
may name the key itself (``GenerateRequest.cache_key``, OpenAI's
``prompt_cache_key``: ``client_key``): requests that share a long prefix only
after their first tokens differ, or a conversation from its first short turn,
then meet on one replica. The key
stops at ``KEY_BLOCKS`` blocks (64 tokens) because every request that shares
those shares a prefix worth caching: a chat's turns (each re-sends the
conversation, answers included), the samples of one prompt, questions after
one long system prompt all keep their key as they grow, while a chat
template's fixed opening (about 25 tokens) is too short to make unrelated
prompts collide. A conversation whose first prompt has fewer full routing
blocks than that gets a shallower key for it, and may change replica once, at
its second turn. Routing blocks are 16 tokens whatever the workers' KV block
size: they were the targets' blocks at first, and with the chart's 256-token
blocks a conversation's key then changed at every turn until its prompt held
1,024 tokens, each change free to move it off the replica that held its
prompts and answers.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from typing import Protocol, TypeVar

KEY_BLOCKS = 4  # routing blocks of a prompt in its routing key (see the module docstring)
ROUTING_BLOCK = 16  # tokens per routing block, whatever the workers' KV block size
LOAD_FACTOR = 1.25  # c: no replica takes a new keyed request while it holds c times the mean or more
_DIGEST_BYTES = 16


class Replica(Protocol):
    address: str  # what names it in the rendezvous weight: stable while it lives
    active: int  # this coordinator's requests on it now


R = TypeVar("R", bound=Replica)


def routing_key(token_ids: Sequence[int], block_size: int = ROUTING_BLOCK,
                max_blocks: int = KEY_BLOCKS) -> bytes | None:
    """The hash chain over the prompt's first full routing blocks (at most ``max_blocks``); None when it has none.

    Block i's hash covers block i-1's hash and block i's token ids, so that a key names the whole
    run of tokens before it. blake2b, not ``hash()``: every coordinator process must compute the same key.
    """
    if block_size < 1 or max_blocks < 1:
        raise ValueError(f"block size and key blocks must be positive, got {block_size} and {max_blocks}")
    blocks = min(max_blocks, len(token_ids) // block_size)
    if blocks == 0:
        return None
    digest = b""
    for b in range(blocks):
        tokens = token_ids[b * block_size:(b + 1) * block_size]
        digest = hashlib.blake2b(digest + struct.pack(f"<{block_size}I", *tokens), digest_size=_DIGEST_BYTES).digest()
    return digest


def client_key(name: str) -> bytes:
    """The routing key of a client's cache key (``GenerateRequest.cache_key``, OpenAI's ``prompt_cache_key``): the
    same name, the same replica, whatever the prompt; never equal to a prompt's key (its own domain)."""
    return hashlib.blake2b(name.encode("utf-8"), digest_size=_DIGEST_BYTES, person=b"tandem-cachekey").digest()


def weight(key: bytes, address: str) -> int:
    """A replica's rendezvous weight for a key: higher wins."""
    return int.from_bytes(hashlib.blake2b(key + address.encode(), digest_size=8).digest(), "little")


def preference(key: bytes, replicas: Sequence[R]) -> list[R]:
    """The replicas in the key's order of preference (heaviest first)."""
    return sorted(replicas, key=lambda r: weight(key, r.address), reverse=True)


def load_bound(total_active: int, replicas: int, factor: float = LOAD_FACTOR) -> int:
    """Most active requests a replica may hold and still take a keyed request: ``ceil(c * (total + 1) / n)``."""
    return math.ceil(factor * (total_active + 1) / replicas)


def choose(key: bytes, replicas: Sequence[R], factor: float = LOAD_FACTOR) -> R:
    """The first replica in the key's order whose load is under the bound (one always is, for ``factor >= 1``)."""
    if not replicas:
        raise ValueError("no replicas to choose from")
    if factor < 1:
        raise ValueError(f"the load factor must be at least 1, got {factor}")
    bound = load_bound(sum(r.active for r in replicas), len(replicas), factor)
    ordered = preference(key, replicas)
    return next((r for r in ordered if r.active < bound), ordered[0])
