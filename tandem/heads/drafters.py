"""Heads at work on a target worker: after verification, in the same batch step, the next round's proposal.

The target engine hands over, per sequence that drafts with heads, a ``HeadStep``:
the features of the rows it has just committed to its KV (the prompt's rows after
a Prefill; the verified root and the kept drafts after a Verify) and the token that
follows each of them (the kept drafts, then the target's own next token ``b``).
The drafter returns a token tree rooted after ``b`` for each step that asks for one.

- ``MedusaDrafter`` reads only the last row (the one whose logits gave ``b``) and is
  stateless.
- ``EagleDrafter`` keeps its layer's KV in a paged cache of its own, one pair per
  target KV position, so that its length always equals the target's: it is extended
  with every committed row, rolled back and released with the target's, and the
  tree it drafts is rolled back before it returns. Where the target caches prefixes,
  so does the head: a row's KV is made of the target's feature at its position and
  the token after it, so its blocks are keyed by the chain of (token, next token)
  pairs (``NextTokenPairs``), and a prompt starts on as many blocks as both caches
  hold (``cached_prefix_len``, ``start``); only committed rows are offered (``commit``).

Everything for a batch runs as batched forwards on the device; each drafting depth
reads its top candidates back with one copy (the tree's shape is decided on the host).
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import torch
from torch import nn

from tandem.attention import AttentionMetadata, make_backend
from tandem.attention.sdpa import ROWWISE_MAX_QUERY
from tandem.block_pool import PrefixCacheStats
from tandem.engine import FeatureSpec, ForwardItem, tree_parents_of
from tandem.heads.eagle import EagleHead
from tandem.heads.medusa import MedusaHeads
from tandem.heads.proposal import HeadProposal, best_nodes, medusa_tree
from tandem.kv_cache import PagedKVCache
from tandem.models.layers import RowBlocks
from tandem.models.transformer import ForwardContext

log = logging.getLogger(__name__)

MAX_PROPOSAL = ROWWISE_MAX_QUERY - 1  # a Verify tree holds the root plus at most this many nodes


@dataclass(slots=True)
class HeadStep:
    seq_id: str
    start: int  # target KV position of the first new row (the drafter's state before it stays)
    features: torch.Tensor  # [n, feature] the new rows' features, on the device
    next_tokens: list[int]  # [n] the token after each new row: the kept drafts, then b
    budget: int  # nodes to propose; 0: only keep up (EAGLE's KV), no proposal


class TimedDrafter:
    """``step`` timed: ``seconds`` is the wall time drafting has cost the target worker so far."""

    seconds: float

    def step(self, steps: Sequence[HeadStep]) -> list[HeadProposal]:
        """One batch step: each ``HeadStep``'s rows in, its proposal out (empty where it asks for none)."""
        started = time.perf_counter()
        try:
            return self._step(steps)
        finally:
            self.seconds += time.perf_counter() - started

    def _step(self, steps: Sequence[HeadStep]) -> list[HeadProposal]:
        raise NotImplementedError


class MedusaDrafter(TimedDrafter):
    """K heads on the last new row; the tree is the best paths through each head's top ``width`` tokens."""

    kind = "medusa"

    def __init__(self, heads: MedusaHeads, width: int = 4) -> None:
        self.heads = heads
        self.width = width
        self.spec = FeatureSpec(heads.config.feature_streams)
        self.seconds = 0.0  # wall time spent in ``step`` (what drafting costs a target worker)

    @torch.inference_mode()
    def _step(self, steps: Sequence[HeadStep]) -> list[HeadProposal]:
        asking = [i for i, s in enumerate(steps) if s.budget > 0]
        out = [HeadProposal() for _ in steps]
        if not asking:
            return out
        last = torch.stack([steps[i].features[-1] for i in asking])  # [B, H]
        probs = self.heads(last).softmax(dim=-1)  # [B, K, Vd]
        top = probs.topk(self.width, dim=-1)  # [B, K, w]
        ids = self.heads.d2t[top.indices].tolist()  # the batch's one copy back (with the probabilities)
        values = top.values.tolist()
        for row, i in enumerate(asking):
            candidates = [list(zip(ids[row][k], values[row][k])) for k in range(self.heads.num_heads)]
            out[i] = medusa_tree(candidates, min(steps[i].budget, MAX_PROPOSAL))
        return out

    def cached_prefix_len(self, tokens: Sequence[int]) -> int:
        """Any cached prefix will do: only the last fed row's features make a proposal."""
        return len(tokens)

    def start(self, seq_id: str, tokens: Sequence[int], length: int) -> None:
        """Nothing to hold: the target's first ``length`` rows were cached, Medusa never reads them."""

    def commit(self, seq_id: str, tokens: Sequence[int], upto: int) -> None:
        """Nothing to cache."""

    def prefix_stats(self) -> PrefixCacheStats | None:
        """No cache of its own."""
        return None

    def rollback(self, seq_id: str, length: int) -> None:
        """Nothing to roll back: Medusa keeps no state between rounds."""

    def release(self, seq_id: str) -> None:
        """Nothing to free."""


@dataclass(slots=True)
class _Node:
    token: int  # target id
    parent: int  # index among the drafted nodes; -1: the root
    score: float  # path probability
    hidden: torch.Tensor  # [H] the pair's hidden input: the parent's output (the root's for depth 1)


class EagleDrafter(TimedDrafter):
    """EAGLE-3 drafting with EAGLE-2's dynamic tree: expand the ``width`` best nodes for ``depth`` steps."""

    kind = "eagle"

    def __init__(self, head: EagleHead, embed: nn.Embedding, num_blocks: int, block_size: int,
                 attention_backend: str = "auto", depth: int = 5, width: int = 4, prefix_caching: bool = False,
                 salt: bytes = b"") -> None:
        cfg = head.config
        weight = head.norm.weight  # (a packed linear's dense weight is gone)
        self.head = head
        self.embed = embed  # the target's own table (EAGLE reads the target's token embeddings)
        self.depth, self.width = depth, width
        self.spec = FeatureSpec(cfg.feature_streams)
        self.device, self.dtype = weight.device, weight.dtype
        # prefix_caching: as the target's (salt: its own, so that no chain is ever the target's)
        self.cache = PagedKVCache(1, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, weight.dtype,
                                  weight.device, prefix_caching, salt + b"|eagle pairs")
        self.backend = make_backend(attention_backend, weight.dtype, weight.device, block_size)
        self.seconds = 0.0  # wall time spent in ``step`` (what drafting costs a target worker)

    # ----- state kept beside the target's KV -------------------------------------
    def length(self, seq_id: str) -> int:
        return self.cache.length(seq_id) if self.cache.has_sequence(seq_id) else 0

    def rollback(self, seq_id: str, length: int) -> None:
        if self.cache.has_sequence(seq_id) and self.cache.length(seq_id) > length:
            self.cache.rollback(seq_id, length)

    def release(self, seq_id: str) -> None:
        if self.cache.has_sequence(seq_id):
            self.cache.release(seq_id)

    # ----- the head's prefix cache ------------------------------------------------
    def prefix_stats(self) -> PrefixCacheStats | None:
        """Its own cache's counters (Info's ``heads_prefix_cache``); None with prefix caching off."""
        return self.cache.prefix_stats() if self.cache.prefix_caching else None

    def cached_prefix_len(self, tokens: Sequence[int]) -> int:
        """How many leading rows of a sequence of ``tokens`` the head's cache holds now (full blocks), changing
        nothing. Row ``t`` needs ``tokens[t + 1]``, so the prompt's last token never heads a cached row."""
        return self.cache.cached_prefix_len(NextTokenPairs(tokens))

    def start(self, seq_id: str, tokens: Sequence[int], length: int) -> None:
        """A new sequence whose target took its first ``length`` rows from the prefix cache takes the head's rows
        for them too (at most ``cached_prefix_len``, as the target was told, so it gets them all). Should it not
        (nothing else changes the head's cache between the two), the sequence drafts no more: ``_step`` finds
        its length short of the rows fed."""
        self.release(seq_id)
        # (looked up even for 0 rows: the hit rate counts every prompt, as the target's does)
        held = self.cache.reuse_prefix(seq_id, NextTokenPairs(tokens), length) if self.cache.prefix_caching else 0
        if held != length:
            log.warning("EAGLE head: %d of %d cached rows of %r were found; it drafts no more", held, length, seq_id)
            self.release(seq_id)

    def commit(self, seq_id: str, tokens: Sequence[int], upto: int) -> None:
        """The sequence's first ``upto`` rows are committed (``tokens``: its committed tokens, one past them): their
        full blocks go to the head's prefix cache. A drafted tree's rows never do: they are gone by now."""
        if self.cache.has_sequence(seq_id):
            self.cache.commit(seq_id, NextTokenPairs(tokens), upto)

    # ----- one batch step -----------------------------------------------------------
    @torch.inference_mode()
    def _step(self, steps: Sequence[HeadStep]) -> list[HeadProposal]:
        out = [HeadProposal() for _ in steps]
        ready = []
        for i, s in enumerate(steps):
            self.rollback(s.seq_id, s.start)
            if self.length(s.seq_id) != s.start:  # its pairs were lost (a full pool): it drafts no more
                self.release(s.seq_id)
                continue
            ready.append(i)
        if not ready:
            return out
        items = [ForwardItem(steps[i].seq_id, steps[i].next_tokens) for i in ready]
        blocks = RowBlocks.from_query_lens([len(it.token_ids) for it in items], ROWWISE_MAX_QUERY)
        hidden = self.head.project(torch.cat([steps[i].features for i in ready]), blocks)  # [T, H]
        try:
            outputs = self._forward(items, hidden)  # [T, H]
        except Exception:  # noqa: BLE001 - proposals are an optimisation: the round goes on without them
            log.exception("EAGLE head: extending the head's KV failed; these sequences draft no more")
            for i in ready:
                self.release(steps[i].seq_id)
            return out
        ends = torch.tensor([len(it.token_ids) for it in items]).cumsum(0) - 1
        roots = outputs[ends.to(self.device)]  # [B, H] the last pair's output: predicts the token after b
        asking = [(row, i) for row, i in enumerate(ready) if steps[i].budget > 0]
        if asking:
            budgets = [min(steps[i].budget, MAX_PROPOSAL) for _, i in asking]
            try:
                drafted = self._draft([steps[i].seq_id for _, i in asking], roots[[row for row, _ in asking]], budgets)
            except Exception:  # noqa: BLE001 - e.g. the head's pool is full: no proposal this round
                log.exception("EAGLE head: drafting failed; the round goes on without a proposal")
                return out
            for (_, i), nodes, budget in zip(asking, drafted, budgets):
                out[i] = best_nodes([n.parent for n in nodes], [n.score for n in nodes], [n.token for n in nodes],
                                    budget)
        return out

    def _draft(self, seq_ids: list[str], roots: torch.Tensor, budgets: list[int]) -> list[list[_Node]]:
        """Each sequence's drafted nodes (every candidate scored, the best ``width`` expanded per depth), up to
        the depth where no deeper node could still be among its ``budgets[b]`` best (``_promising``)."""
        base = [self.length(s) for s in seq_ids]
        nodes: list[list[_Node]] = [[] for _ in seq_ids]
        frontier = self._children(roots, [[-1] for _ in seq_ids], [[1.0] for _ in seq_ids], nodes, [[r] for r in roots])
        expanded: list[list[int]] = [[] for _ in seq_ids]  # per sequence: nodes fed to the layer, in feed order
        try:
            for _ in range(self.depth - 1):
                frontier = [_promising(nodes[b], front, budgets[b]) for b, front in enumerate(frontier)]
                for b, front in enumerate(frontier):
                    expanded[b].extend(front)
                rows = [b for b, front in enumerate(frontier) if front]
                if not rows:
                    break
                for b, seq_id in enumerate(seq_ids):
                    self.rollback(seq_id, base[b])
                outputs = self._forward_trees([seq_ids[b] for b in rows], [nodes[b] for b in rows],
                                              [expanded[b] for b in rows])  # per row: [len(expanded), H]
                parents_out, parents, scores, hiddens = [], [], [], []
                for b, out in zip(rows, outputs):
                    feed = expanded[b]
                    picked = [feed.index(n) for n in frontier[b]]
                    parents_out.append(out[picked])  # [w, H]
                    parents.append(frontier[b])
                    scores.append([nodes[b][n].score for n in frontier[b]])
                    hiddens.append(list(out[picked]))
                next_frontier = self._children(torch.cat(parents_out), parents, scores,
                                               [nodes[b] for b in rows], hiddens)
                frontier = [[] for _ in seq_ids]
                for b, front in zip(rows, next_frontier):
                    frontier[b] = front
        finally:
            for b, seq_id in enumerate(seq_ids):
                self.rollback(seq_id, base[b])
        return nodes

    def _children(self, outputs: torch.Tensor, parents: list[list[int]], scores: list[list[float]],
                  nodes: list[list[_Node]], hiddens: list[list[torch.Tensor]]) -> list[list[int]]:
        """Score the ``width`` best children of each given node; per group, the ``width`` best new nodes.

        ``outputs`` ``[N, H]``: the layer's output for each parent, groups in order (the root: -1)."""
        logp = self.head.logits(outputs).log_softmax(dim=-1)  # [N, Vd]
        top = logp.topk(self.width, dim=-1)
        ids = self.head.d2t[top.indices].tolist()  # one copy back per depth
        probs = top.values.exp().tolist()
        frontier: list[list[int]] = []
        row = 0
        for group, (ps, ss, hs) in enumerate(zip(parents, scores, hiddens)):
            new = []
            for parent, score, hidden in zip(ps, ss, hs):
                for token, prob in zip(ids[row], probs[row]):
                    nodes[group].append(_Node(token, parent, score * prob, hidden))
                    new.append(len(nodes[group]) - 1)
                row += 1
            new.sort(key=lambda n: -nodes[group][n].score)
            frontier.append(new[: self.width])
        return frontier

    def _forward_trees(self, seq_ids: list[str], nodes: list[list[_Node]],
                       feeds: list[list[int]]) -> list[torch.Tensor]:
        """Feed each sequence's expanded nodes as one tree (each sees the committed pairs and its ancestors)."""
        items, hidden = [], []
        for seq_id, seq_nodes, feed in zip(seq_ids, nodes, feeds):
            where = {n: i for i, n in enumerate(feed)}
            parents = [where.get(seq_nodes[n].parent, -1) for n in feed]
            items.append(ForwardItem(seq_id, [seq_nodes[n].token for n in feed], parents=parents))
            hidden.extend(seq_nodes[n].hidden for n in feed)
        out = self._forward(items, torch.stack(hidden))  # [T, H]
        return list(out.split([len(f) for f in feeds]))

    def _forward(self, items: list[ForwardItem], hidden: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        """Append the items' pairs to the head's KV and run the layer over them (``ModelEngine._run``'s shape)."""
        context_lens = [self.length(it.seq_id) for it in items]
        slots = self.cache.append_slots({it.seq_id: len(it.token_ids) for it in items})
        try:
            query_lens = [len(it.token_ids) for it in items]
            parents = torch.tensor([p for it in items for p in it.row_parents()], dtype=torch.int64)
            meta = AttentionMetadata.build(
                query_lens, context_lens, torch.cat([slots[it.seq_id] for it in items]),
                self.cache.block_table([it.seq_id for it in items]), self.cache.block_size, self.device,
                tree_parents_of(parents, query_lens),
            )
            ctx = ForwardContext(self.cache, meta, self.backend, self.backend.prepare(meta),
                                 RowBlocks.from_query_lens(query_lens, ROWWISE_MAX_QUERY))
            tokens = torch.tensor([t for it in items for t in it.token_ids], dtype=torch.int64, device=self.device)
            positions = torch.cat([it.positions(c) for it, c in zip(items, context_lens)]).to(self.device)
            return self.head(self.embed(tokens).to(self.dtype), hidden.to(self.dtype), positions, ctx)
        except BaseException:
            for it, length in zip(items, context_lens):
                if length:
                    self.cache.rollback(it.seq_id, length)
                else:
                    self.cache.release(it.seq_id)
            raise


class NextTokenPairs(Sequence[int]):
    """A view of ``tokens`` as each position's token and the one after it, one int per pair: what the head's row
    at that position is made of (the target's feature there, which its prefix decides, and the next token's
    embedding). Hash chains of these name a head block's every input; ``len(tokens) - 1`` pairs."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = tokens

    def __len__(self) -> int:
        return max(0, len(self.tokens) - 1)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("NextTokenPairs slices take a step of 1")
            run = self.tokens[start:stop + 1]
            return [a << 32 | b for a, b in zip(run, run[1:])]  # ids < 2**31: one int64 per pair
        if not -len(self) <= index < len(self):
            raise IndexError(f"pair {index} of {len(self)}")
        index %= len(self)
        return self.tokens[index] << 32 | self.tokens[index + 1]


def _promising(nodes: list[_Node], frontier: list[int], budget: int) -> list[int]:
    """The frontier nodes whose children could still be among the ``budget`` best nodes of the finished draft.

    A child scores at most its parent, is numbered after every node drafted so far, and ``best_nodes``
    breaks ties by number; the cut (the ``budget``-th best score so far) only rises as nodes are added.
    So a node scoring at or below the cut has no descendant in the proposal: expanding it would cost a
    layer row and change nothing. With an unsure head, whole depths are skipped."""
    if len(nodes) < budget:
        return frontier
    cut = heapq.nlargest(budget, (n.score for n in nodes))[-1]
    return [n for n in frontier if nodes[n].score > cut]


HeadDrafter = MedusaDrafter | EagleDrafter
