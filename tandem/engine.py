"""The model engine: one model, one paged KV pool, forward passes over ragged batches.

A caller (the in-process generator, a draft worker, a target worker's
scheduler) describes a batch as ``ForwardItem``s: for each sequence, the new
tokens to append and how many trailing positions need logits (1 to decode or
prefill, k+1 to verify k draft tokens). ``forward`` appends them to the KV
cache, runs the model once over all of them, and returns logits per item.
Rollback and release are cache operations exposed here so callers hold one
object.

An item's new tokens may form a speculation tree (``ForwardItem.parents``, see
``tandem.tree_rows``): the target verifies every branch in one pass, and
``keep_path`` then leaves the KV exactly as if only the accepted path had been fed.

Speculation heads read the target's hidden states: ``forward_with_features``
returns, besides the logits, the features of the items that ask
(``ForwardItem.features``), taken from the residual streams a ``FeatureSpec``
names. A forward that asks for none keeps and copies nothing extra.
"""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tandem.attention import AttentionBackend, AttentionMetadata, make_backend
from tandem.attention.sdpa import ROWWISE_MAX_QUERY
from tandem.compute_thread import HomeThread
from tandem.config import EngineConfig, ModelConfig
from tandem.cost_fit import ForwardCostFit, PromptTokenCost
from tandem.kv_cache import PagedKVCache, SeqId
from tandem.kv_sizing import DeviceMemory, KvBudget, cuda_memory, kv_budget
from tandem.models import CausalLM, load_model
from tandem.models.layers import RowStableLinear
from tandem.models.packed import pack_linear_weights
from tandem.models.quantize import Int8Linear, shrink_for_drafting
from tandem.models.row_padding import PaddingTuner
from tandem.models.tensor_parallel import local_kv_heads
from tandem.models.transformer import HiddenStates
from tandem.step_clock import StepClock
from tandem.step_graphs import CudaGraphRecorder, GraphRecorder, StepGraphs
from tandem.tree_rows import chain_parents, depths, is_chain, parents_problem

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ForwardBatch:
    """Everything one forward pass reads, as plain tensors (what tensor-parallel rank 0 broadcasts).

    The KV bookkeeping (which blocks a sequence holds, how long it is) is already resolved
    into ``slot_mapping`` and ``block_tables``: a process that only holds KV tensors can run it.
    """

    input_ids: torch.Tensor  # [T] int64, the new tokens of every sequence, in order
    positions: torch.Tensor  # [T] int64, each token's absolute position in its sequence
    slot_mapping: torch.Tensor  # [T] int64, the flat KV slot each new token is written to
    block_tables: torch.Tensor  # [B, M] int32, each sequence's KV blocks, padded with 0
    query_lens: list[int]  # [B] new tokens per sequence
    context_lens: list[int]  # [B] tokens cached per sequence before this pass
    logit_rows: torch.Tensor  # [R] int64, the rows of the T whose logits are wanted
    parents: torch.Tensor  # [T] int64, each token's parent row within its sequence's new tokens (-1: the context)
    prompt_runs: list[bool]  # [B] whether each sequence's new tokens are prompt tokens (``ForwardItem.prompt``)


# The warm-up's prompt pass, which prices a prompt token (``ModelEngine.warmup``): long enough that a pass's
# fixed part weighs on the price about as on the long prompts it is used for.
WARMUP_PROMPT_TOKENS = 128
FINAL = -1  # in a FeatureSpec: the last layer's output after the final norm (what lm_head reads)


@dataclass(frozen=True, slots=True)
class FeatureSpec:
    """Which hidden states make a row's feature, concatenated in this order.

    Each entry is a layer index ``i`` (the residual stream entering layer ``i``; ``num_layers``:
    leaving the last layer, before the norm) or ``FINAL``. Medusa reads ``(FINAL,)``; EAGLE-3
    reads a low, a middle and a high layer.
    """

    streams: tuple[int, ...]

    def __post_init__(self) -> None:
        if not self.streams:
            raise ValueError("a feature needs at least one hidden state")

    def check(self, num_layers: int) -> None:
        bad = [i for i in self.streams if i != FINAL and not 0 <= i <= num_layers]
        if bad:
            raise ValueError(f"feature layers {bad} outside 0..{num_layers} (or {FINAL}: the final normed state)")

    def take(self, hidden: HiddenStates, rows: torch.Tensor) -> torch.Tensor:  # rows [F] -> [F, len * hidden]
        parts = [hidden.final if i == FINAL else hidden.streams[i] for i in self.streams]
        return torch.cat([part[rows] for part in parts], dim=-1)

    @property
    def layers(self) -> tuple[int, ...]:
        """The residual streams the model must keep (``FINAL`` needs none)."""
        return tuple(i for i in self.streams if i != FINAL)


@dataclass(slots=True)
class ForwardItem:
    """One sequence's part of a batch.

    ``parents``: None for a chain (each new token follows the one before), else per new token
    the index in ``token_ids`` of its parent, or -1 for a token that follows the cached context
    directly. Token ``i`` is written at KV position ``context + i`` whatever its depth; it sits
    at position ``context + depth`` and sees the context, its ancestors and itself only.
    """

    seq_id: SeqId
    token_ids: Sequence[int]  # new tokens, appended after the sequence's cached ones
    num_logits: int = 1  # how many of the last new positions to compute logits for
    parents: Sequence[int] | None = None  # a speculation tree over token_ids; None: a chain
    features: bool = False  # return the features of every new token (``forward_with_features``)
    # Prompt tokens (a prefill, a chunk of one, what the prefix cache left of one): their attention is fixed by
    # position (tandem/attention/sdpa.py), so a prompt's rows are bitwise the same however it is cut into runs.
    prompt: bool = False

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"sequence {self.seq_id!r}: a forward item needs at least one new token")
        if self.prompt and self.parents is not None and not is_chain(self.parents):
            raise ValueError(f"sequence {self.seq_id!r}: prompt tokens are a chain, not a speculation tree")
        if not 0 <= self.num_logits <= len(self.token_ids):
            raise ValueError(
                f"sequence {self.seq_id!r}: num_logits {self.num_logits} outside 0..{len(self.token_ids)}"
            )
        if self.parents is None:
            return
        if (problem := parents_problem(self.parents, len(self.token_ids))) is not None:
            raise ValueError(f"sequence {self.seq_id!r}: {problem}")
        if len(self.token_ids) > ROWWISE_MAX_QUERY and not is_chain(self.parents):
            # Trees go through attention row by row, which is what makes each path batch-invariant.
            raise ValueError(
                f"sequence {self.seq_id!r}: a tree of {len(self.token_ids)} tokens, at most {ROWWISE_MAX_QUERY}"
            )

    @property
    def is_tree(self) -> bool:
        return self.parents is not None and not is_chain(self.parents)

    def row_parents(self) -> list[int]:
        """Each new token's parent row, chains included (``[-1, 0, 1, ...]``)."""
        return list(self.parents) if self.parents is not None else chain_parents(len(self.token_ids))

    def positions(self, context_len: int) -> torch.Tensor:  # [q] int64
        """Each new token's absolute position: ``context_len + depth``."""
        if not self.is_tree:
            return torch.arange(context_len, context_len + len(self.token_ids), dtype=torch.int64)
        return torch.tensor(depths(self.parents), dtype=torch.int64) + context_len


def _rows_fixed_by_position(model: CausalLM, backend: AttentionBackend) -> bool:
    """Whether a token's KV and logits are bitwise the same however its row was computed: in a prompt run of any
    length, decoded, verified or on a tree's path. SDPA computes every row by position (tandem/attention/sdpa.py);
    the linear layers are row-invariant when every one is packed for oneDNN (tandem/models/packed.py). Elsewhere
    (flash-attn on CUDA, dense or int8 weights) a decoded row rounds otherwise than a prompt's."""
    linears = [m for m in model.modules() if isinstance(m, (nn.Linear, Int8Linear))]
    return backend.name == "sdpa" and all(isinstance(m, RowStableLinear) and m.packed_weight is not None
                                          for m in linears)


class ModelEngine:
    """A loaded model with its KV pool and attention backend."""

    def __init__(
        self,
        model: CausalLM,
        kv_cache: PagedKVCache,
        backend: AttentionBackend,
        num_layers: int | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.num_layers = num_layers  # None: all layers; fewer for an early-exit drafter
        self.device = model.embed_tokens.weight.device
        self.dtype = model.embed_tokens.weight.dtype
        # Forward seconds against tokens, fitted as the engine runs: what adaptive k plans with.
        self.cost_fit = ForwardCostFit()
        self.prompt_cost = PromptTokenCost()  # what a prompt chunk's tokens cost (tandem.rpc.prefill_chunks)
        self.clock = StepClock(self.device)  # each forward's seconds on the device, for the two above
        # Tokens of the forward running now (0 between forwards). A worker's Info reads it from another thread: a
        # coordinator prices the worker's running step by it (a lone prompt chunk is more than its call's cost).
        self.rows_in_forward = 0
        # On a CPU, a second thread computing beside the one that loaded the model slows every pass: warn once.
        self.home_thread = HomeThread(f"the {model.config.model_type} engine") if self.device.type == "cpu" else None
        self.rows_fixed_by_position = _rows_fixed_by_position(model, backend)
        self.graphs: StepGraphs | None = None  # decode and verify steps as CUDA graphs (``use_step_graphs``)
        self.kv_budget: KvBudget | None = None  # how ``load`` sized the pool from the device's memory, if it did

    @classmethod
    def load(cls, cfg: EngineConfig, memory: DeviceMemory | None = None) -> ModelEngine:
        """The model of ``cfg`` on its device with a fresh KV pool; ``memory``: how the device's memory is read
        when the pool is sized from it (``cfg.gpu_memory_utilization``; None: the CUDA device's own)."""
        model_cfg = ModelConfig.from_dir(cfg.model_dir)
        device = torch.device(cfg.device)
        model = load_model(cfg.model_dir, model_cfg, cfg.resolved_dtype, device)
        shrink_for_drafting(model, cfg.quantization, cfg.vocab_limit)  # a no-op unless the config asks for it
        if cfg.pack_weights:  # after shrinking: int8 layers are not packed, a cut head is packed as cut
            pack_linear_weights(model, PaddingTuner())  # small calls: the row count measured cheapest
        num_blocks, budget = cfg.num_blocks, None
        if cfg.gpu_memory_utilization is not None:  # after the weights: what they take is in use
            budget = kv_budget(model, cfg, memory or cuda_memory(device))
            log.info("%s", budget.describe())
            num_blocks = budget.tokens // cfg.block_size
        engine = cls.with_new_cache(model, num_blocks, cfg.block_size, cfg.attention_backend,
                                    prefix_caching=cfg.prefix_caching, salt=cfg.cache_salt)
        engine.kv_budget = budget
        if cfg.use_cuda_graphs:
            engine.use_step_graphs(CudaGraphRecorder(device))
        return engine

    def use_step_graphs(self, recorder: GraphRecorder) -> StepGraphs:
        """From now on, decode and verify steps of small batches run as graphs ``recorder`` captures
        (``tandem.step_graphs``); every other batch eagerly, as before."""
        if self.graphs is not None:  # replaced: its scratch block goes back to the pool
            self.kv_cache.pool.release(self.graphs.scratch_block)
        self.graphs = StepGraphs(self, recorder)
        return self.graphs

    @classmethod
    def with_new_cache(
        cls,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        attention_backend: str = "auto",
        num_layers: int | None = None,
        prefix_caching: bool = False,
        salt: bytes = b"",
    ) -> ModelEngine:
        """An engine over ``model`` with a fresh KV pool (several engines may share one model)."""
        cfg = model.config
        weight = model.embed_tokens.weight
        cache = PagedKVCache(  # a tensor-parallel rank holds the KV of its own heads only
            num_layers or cfg.num_layers, num_blocks, block_size, local_kv_heads(model), cfg.head_dim,
            weight.dtype, weight.device, prefix_caching, salt,
        )
        backend = make_backend(attention_backend, weight.dtype, weight.device, block_size)
        return cls(model, cache, backend, num_layers)

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    def close(self) -> None:
        """Stop what the engine started, on the model thread (nothing, in one process; see tandem/parallel)."""

    def warmup(self) -> None:
        """A few real forwards on a scratch sequence: kernels warmed, and the cost fit seeded.

        The fit needs batches of different sizes before it can tell the cost of reading the
        weights from the cost per token; without decode-sized samples, the first prompt's
        prefill would pass for the price of a decode step and adaptive k would never draft.
        """
        if self.graphs is not None:  # first: the passes below then time replays, and requests never wait on these
            self.graphs.capture_ahead()
        scratch = "__warmup__"
        for tokens in ([1] * 32, [1], [1], [1] * 8, [1]):
            self.forward([ForwardItem(scratch, tokens)])
        self.release(scratch)
        # Then a prompt's pass prices a prompt token (``prompt_cost``) against the cost the ones before fitted,
        # twice: the first writes KV pages for the first time (page faults: measured 11 ms a token on a lean
        # draft, against 2 warm) and is forgotten. Long, as the pool allows: a pass has a fixed part (a lean
        # draft dequantizes its weights per call, ~80 ms on a 2-core CPU) that a short one would spread over
        # too few tokens, and a loop weighs a draft's read of a long prompt with this price.
        room = self.kv_cache.num_free_blocks * self.kv_cache.block_size
        prompt = [1] * max(1, min(WARMUP_PROMPT_TOKENS, room))
        for keep in (False, True):
            self.forward([ForwardItem(scratch, prompt, prompt=True)])
            self.release(scratch)
            self.clock.settle()  # (on CUDA the passes' times arrive once they have run)
            if not keep:
                self.prompt_cost.reset()

    def _observe_cost(self, tokens: int, prompt: int, seconds: float) -> None:
        """A forward of ``tokens`` rows, ``prompt`` of them a prompt's, took ``seconds``."""
        if prompt:  # priced apart: a prompt token's cost is not a decode row's (tandem.cost_fit)
            self.prompt_cost.observe(prompt, seconds - self.cost_fit.seconds(tokens - prompt))
        else:
            self.cost_fit.observe(tokens, seconds)

    # ----- sequences ---------------------------------------------------
    def seq_len(self, seq_id: SeqId) -> int:
        """Tokens of ``seq_id`` held in the KV cache (0 for a sequence not seen yet)."""
        return self.kv_cache.length(seq_id) if self.kv_cache.has_sequence(seq_id) else 0

    def rollback(self, seq_id: SeqId, length: int) -> None:
        self.kv_cache.rollback(seq_id, length, move=self.move_kv)  # a copy on write reaches every rank

    def reuse_prefix(self, seq_id: SeqId, tokens: Sequence[int], limit: int) -> int:
        """Start ``seq_id`` on the cached blocks ``tokens`` begins with (at most ``limit`` tokens); how many."""
        return self.kv_cache.reuse_prefix(seq_id, tokens, limit)

    def commit(self, seq_id: SeqId, tokens: Sequence[int], upto: int) -> None:
        """``tokens[:upto]`` are verified and in the KV: their full blocks may be reused by later prompts."""
        self.kv_cache.commit(seq_id, tokens, upto)

    def release(self, seq_id: SeqId) -> None:
        self.kv_cache.release(seq_id)

    def keep_path(self, seq_id: SeqId, base_len: int, rows: Sequence[int]) -> None:
        """After a tree forward, keep the KV of one root-to-node path only, as if it alone had been fed.

        The sequence held ``base_len`` tokens before the tree; its new token ``row`` was written
        at position ``base_len + row``. ``rows`` is the accepted path in depth order (each row's
        parent before it, e.g. ``[0, 2, 5]``; empty when nothing was accepted). The K/V of the
        path's row at depth ``d`` is copied, in every layer, to position ``base_len + d`` (rows
        already there stay), then the sequence is rolled back to ``base_len + len(rows)``:
        bitwise the KV of a chain forward of the path, since a tree row computes exactly what
        that chain's row does.
        """
        length = self.kv_cache.length(seq_id)  # unknown sequences raise here
        if not 0 <= base_len <= length:
            raise ValueError(f"sequence {seq_id!r} holds {length} tokens: base_len {base_len} is outside 0..{length}")
        rows = list(rows)
        num_new = length - base_len
        if any(not 0 <= r < num_new for r in rows):
            raise ValueError(f"sequence {seq_id!r}: path rows {rows} outside the {num_new} tokens after {base_len}")
        if any(a >= b for a, b in zip(rows, rows[1:])):
            # A parent comes before its children, so a root-to-node path has increasing rows.
            raise ValueError(f"sequence {seq_id!r}: path rows {rows} are not increasing (a root-to-node path is)")
        moves = [(base_len + row, base_len + depth) for depth, row in enumerate(rows) if row != depth]
        if moves:
            self.move_kv(
                self.kv_cache.slots(seq_id, [src for src, _ in moves]),
                self.kv_cache.slots(seq_id, [dst for _, dst in moves]),
            )
        self.rollback(seq_id, base_len + len(rows))

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the K/V of flat slots ``src`` ``[n]`` to ``dst`` ``[n]`` in every layer (on every rank, in TP)."""
        self.kv_cache.move(src, dst)

    # ----- the forward pass ---------------------------------------------
    def forward(self, items: Sequence[ForwardItem]) -> list[torch.Tensor]:
        """Append each item's tokens to its sequence and return ``[num_logits, vocab]`` float32 per item.

        All or nothing: if the KV pool cannot hold the batch, or the forward
        fails, every sequence is left exactly as it was.
        """
        return self.forward_with_features(items, None)[0]

    @torch.inference_mode()
    def forward_with_features(
        self, items: Sequence[ForwardItem], spec: FeatureSpec | None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """``forward``, plus per item that asks (``features``) its new tokens' features ``[q, F]``
        in the model's dtype, on its device (None for the others, and for all when ``spec`` is None)."""
        seq_ids = [it.seq_id for it in items]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a batch may hold each sequence at most once")
        context_lens = [self.seq_len(s) for s in seq_ids]
        existed = [self.kv_cache.has_sequence(s) for s in seq_ids]
        slots = self.kv_cache.append_slots({it.seq_id: len(it.token_ids) for it in items})
        tokens = sum(len(it.token_ids) for it in items)
        self.rows_in_forward = tokens
        captured = self.graphs.captured if self.graphs is not None else 0
        mark = self.clock.start()
        try:
            out = self._run(items, context_lens, slots, spec)
            if self.graphs is not None and self.graphs.captured != captured:
                return out  # this pass captured a graph: its time prices the capture, not the step
            prompt = sum(len(it.token_ids) for it in items if it.prompt)
            self.clock.stop(mark, functools.partial(self._observe_cost, tokens, prompt))
            return out
        except BaseException:
            for seq_id, length, had in zip(seq_ids, context_lens, existed):
                if had:
                    self.kv_cache.rollback(seq_id, length, move=self.move_kv)
                else:
                    self.kv_cache.release(seq_id)
            raise
        finally:
            self.rows_in_forward = 0

    def _run(
        self, items: Sequence[ForwardItem], context_lens: list[int], slots: dict[SeqId, torch.Tensor],
        spec: FeatureSpec | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        query_lens = [len(it.token_ids) for it in items]
        # Only the rows whose logits are wanted go through lm_head (the largest matmul at small batch).
        rows: list[int] = []
        end = 0
        for it, qlen in zip(items, query_lens):
            end += qlen
            rows.extend(range(end - it.num_logits, end))
        batch = ForwardBatch(
            input_ids=torch.tensor([t for it in items for t in it.token_ids], dtype=torch.int64),
            positions=torch.cat([it.positions(c) for it, c in zip(items, context_lens)]),
            slot_mapping=torch.cat([slots[it.seq_id] for it in items]),
            block_tables=self.kv_cache.block_table([it.seq_id for it in items]),
            query_lens=query_lens,
            context_lens=list(context_lens),
            logit_rows=torch.tensor(rows, dtype=torch.int64),
            parents=torch.tensor([p for it in items for p in it.row_parents()], dtype=torch.int64),
            prompt_runs=[it.prompt for it in items],
        )
        wanted = [it.features and spec is not None for it in items]
        request = None
        if any(wanted):
            starts = [0, *itertools.accumulate(query_lens)]
            feature_rows = [r for it, w, s in zip(items, wanted, starts) if w for r in range(s, s + len(it.token_ids))]
            request = FeatureRequest(spec, torch.tensor(feature_rows, dtype=torch.int64))  # type: ignore[arg-type]
        logits, features = self.compute(batch, request)  # [R, vocab], [F, feature] or None
        per_item = list(logits.split([it.num_logits for it in items]))  # each [num_logits, vocab]
        if features is None:
            return per_item, [None] * len(items)
        pieces = iter(features.split([len(it.token_ids) for it, w in zip(items, wanted) if w]))
        return per_item, [next(pieces) if w else None for w in wanted]

    @torch.inference_mode()
    def compute(
        self, batch: ForwardBatch, features: FeatureRequest | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # -> [R, vocab] float32, [F, feature] or None
        """The model over one batch whose KV slots are already allocated; no bookkeeping."""
        if self.home_thread is not None:
            self.home_thread.check()
        shape = self.graphs.shape_for(batch) if self.graphs is not None and features is None else None
        final = self.graphs.run(batch, shape) if shape is not None else None  # type: ignore[union-attr]
        if final is not None:  # [T, hidden]
            return self.model.logits(final[batch.logit_rows.to(self.device)]), None
        meta = AttentionMetadata.build(
            batch.query_lens, batch.context_lens, batch.slot_mapping, batch.block_tables,
            self.kv_cache.block_size, self.device, tree_parents_of(batch.parents, batch.query_lens),
            batch.prompt_runs,
        )
        hidden = self.model.hidden_states(
            batch.input_ids.to(self.device), batch.positions.to(self.device), self.kv_cache, meta, self.backend,
            self.num_layers, features.spec.layers if features is not None else (),
        )
        logits = self.model.logits(hidden.final[batch.logit_rows.to(self.device)])
        if features is None:
            return logits, None
        return logits, features.spec.take(hidden, features.rows.to(self.device))


@dataclass(frozen=True, slots=True)
class FeatureRequest:
    """The features one forward returns: which hidden states, for which of its rows."""

    spec: FeatureSpec
    rows: torch.Tensor  # [F] int64, rows of the batch's T


def tree_parents_of(parents: torch.Tensor, query_lens: list[int]) -> list[list[int] | None]:
    """Per sequence, None for a chain, else its new tokens' parents (from ``ForwardBatch.parents`` ``[T]``)."""
    starts = torch.tensor([0, *query_lens[:-1]], dtype=torch.int64).cumsum(0)  # [B]
    offsets = torch.repeat_interleave(starts, torch.tensor(query_lens))  # [T], each token's sequence start
    off_chain = parents != torch.arange(parents.numel()) - offsets - 1  # [T], True where a chain would differ
    if not off_chain.any():  # the common case: one vectorized check, nothing per sequence
        return [None] * len(query_lens)
    return [
        rows.tolist() if tree.any() else None
        for rows, tree in zip(parents.split(query_lens), off_chain.split(query_lens))
    ]
