"""The model engine: one model, one paged KV pool, forward passes over ragged batches.

A caller (the in-process generator, a draft worker, a target worker's
scheduler) describes a batch as ``ForwardItem``s: for each sequence, the new
tokens to append and how many trailing positions need logits (1 to decode or
prefill, k+1 to verify k draft tokens). ``forward`` appends them to the KV
cache, runs the model once over all of them, and returns logits per item.
Rollback and release are cache operations exposed here so callers hold one
object.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.attention import AttentionBackend, AttentionMetadata, make_backend
from tandem.config import EngineConfig, ModelConfig
from tandem.cost_fit import ForwardCostFit
from tandem.kv_cache import PagedKVCache, SeqId
from tandem.models import CausalLM, load_model
from tandem.models.quantize import shrink_for_drafting
from tandem.models.tensor_parallel import local_kv_heads


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


@dataclass(slots=True)
class ForwardItem:
    """One sequence's part of a batch."""

    seq_id: SeqId
    token_ids: Sequence[int]  # new tokens, appended after the sequence's cached ones
    num_logits: int = 1  # how many of the last new positions to compute logits for

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError(f"sequence {self.seq_id!r}: a forward item needs at least one new token")
        if not 0 <= self.num_logits <= len(self.token_ids):
            raise ValueError(
                f"sequence {self.seq_id!r}: num_logits {self.num_logits} outside 0..{len(self.token_ids)}"
            )


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

    @classmethod
    def load(cls, cfg: EngineConfig) -> ModelEngine:
        model_cfg = ModelConfig.from_dir(cfg.model_dir)
        device = torch.device(cfg.device)
        model = load_model(cfg.model_dir, model_cfg, cfg.resolved_dtype, device)
        shrink_for_drafting(model, cfg.quantization, cfg.vocab_limit)  # a no-op unless the config asks for it
        return cls.with_new_cache(model, cfg.num_blocks, cfg.block_size, cfg.attention_backend)

    @classmethod
    def with_new_cache(
        cls,
        model: CausalLM,
        num_blocks: int,
        block_size: int,
        attention_backend: str = "auto",
        num_layers: int | None = None,
    ) -> ModelEngine:
        """An engine over ``model`` with a fresh KV pool (several engines may share one model)."""
        cfg = model.config
        weight = model.embed_tokens.weight
        cache = PagedKVCache(  # a tensor-parallel rank holds the KV of its own heads only
            num_layers or cfg.num_layers, num_blocks, block_size, local_kv_heads(model), cfg.head_dim,
            weight.dtype, weight.device,
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
        scratch = "__warmup__"
        for tokens in ([1] * 32, [1], [1], [1] * 8, [1]):
            self.forward([ForwardItem(scratch, tokens)])
        self.release(scratch)

    # ----- sequences ---------------------------------------------------
    def seq_len(self, seq_id: SeqId) -> int:
        """Tokens of ``seq_id`` held in the KV cache (0 for a sequence not seen yet)."""
        return self.kv_cache.length(seq_id) if self.kv_cache.has_sequence(seq_id) else 0

    def rollback(self, seq_id: SeqId, length: int) -> None:
        self.kv_cache.rollback(seq_id, length)

    def release(self, seq_id: SeqId) -> None:
        self.kv_cache.release(seq_id)

    # ----- the forward pass ---------------------------------------------
    @torch.inference_mode()
    def forward(self, items: Sequence[ForwardItem]) -> list[torch.Tensor]:
        """Append each item's tokens to its sequence and return ``[num_logits, vocab]`` float32 per item.

        All or nothing: if the KV pool cannot hold the batch, or the forward
        fails, every sequence is left exactly as it was.
        """
        seq_ids = [it.seq_id for it in items]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError("a batch may hold each sequence at most once")
        context_lens = [self.seq_len(s) for s in seq_ids]
        existed = [self.kv_cache.has_sequence(s) for s in seq_ids]
        slots = self.kv_cache.append_slots({it.seq_id: len(it.token_ids) for it in items})
        started = time.perf_counter()
        try:
            logits = self._run(items, context_lens, slots)
            self.cost_fit.observe(sum(len(it.token_ids) for it in items), time.perf_counter() - started)
            return logits
        except BaseException:
            for seq_id, length, had in zip(seq_ids, context_lens, existed):
                if had:
                    self.kv_cache.rollback(seq_id, length)
                else:
                    self.kv_cache.release(seq_id)
            raise

    def _run(
        self, items: Sequence[ForwardItem], context_lens: list[int], slots: dict[SeqId, torch.Tensor]
    ) -> list[torch.Tensor]:
        query_lens = [len(it.token_ids) for it in items]
        # Only the rows whose logits are wanted go through lm_head (the largest matmul at small batch).
        rows: list[int] = []
        end = 0
        for it, qlen in zip(items, query_lens):
            end += qlen
            rows.extend(range(end - it.num_logits, end))
        batch = ForwardBatch(
            input_ids=torch.tensor([t for it in items for t in it.token_ids], dtype=torch.int64),
            positions=torch.cat([torch.arange(c, c + q, dtype=torch.int64) for c, q in zip(context_lens, query_lens)]),
            slot_mapping=torch.cat([slots[it.seq_id] for it in items]),
            block_tables=self.kv_cache.block_table([it.seq_id for it in items]),
            query_lens=query_lens,
            context_lens=list(context_lens),
            logit_rows=torch.tensor(rows, dtype=torch.int64),
        )
        logits = self.compute(batch)  # [R, vocab]
        return list(logits.split([it.num_logits for it in items]))  # each [num_logits, vocab]

    @torch.inference_mode()
    def compute(self, batch: ForwardBatch) -> torch.Tensor:  # -> [R, vocab] float32
        """The model over one batch whose KV slots are already allocated; no bookkeeping."""
        meta = AttentionMetadata.build(
            batch.query_lens, batch.context_lens, batch.slot_mapping, batch.block_tables,
            self.kv_cache.block_size, self.device,
        )
        hidden = self.model.hidden_states(
            batch.input_ids.to(self.device), batch.positions.to(self.device), self.kv_cache, meta, self.backend,
            self.num_layers,
        )  # [T, hidden]
        return self.model.logits(hidden[batch.logit_rows.to(self.device)])
