"""Decoder-only transformer for the Llama and Qwen2 families, over a ragged batch.

Qwen2 is Llama with biases on the q/k/v projections (and, in the GGUF
checkpoints here, an untied lm_head); both come from ``ModelConfig``. The
model knows nothing about sequences or batching: it takes a flat stream of
new tokens with their positions, writes their K/V into the paged cache at
``meta.slot_mapping``, and lets the attention backend read the cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tandem.attention.base import AttentionBackend, AttentionMetadata
from tandem.attention.sdpa import ROWWISE_MAX_QUERY
from tandem.config import ModelConfig
from tandem.kv_cache import PagedKVCache
from tandem.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, RowBlocks, RowStableLinear, apply_rotary


@dataclass(slots=True)
class ForwardContext:
    """What every layer of one forward pass reads besides its input: built once per forward."""

    kv_cache: PagedKVCache
    meta: AttentionMetadata
    backend: AttentionBackend
    backend_state: Any  # what ``backend.prepare(meta)`` derived, shared by every layer
    blocks: RowBlocks  # how the flat rows split for the linear layers


@dataclass(slots=True)
class HiddenStates:
    """A forward's hidden states: the final (normed) ones, and the residual streams asked for."""

    final: torch.Tensor  # [T, hidden], after the final norm: what lm_head reads
    # layer index i -> [T, hidden], the residual stream entering layer i (i = num_layers: leaving the last
    # layer, before the norm); only the indices the caller named (speculation heads read them)
    streams: dict[int, torch.Tensor] = field(default_factory=dict)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int, input_size: int | None = None) -> None:
        """``input_size``: the width q, k and v are projected from (an EAGLE-3 layer reads two
        hidden states side by side); the model's hidden size by default."""
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # q, k and v fused into one matmul: one pass over the activations instead of three.
        self.qkv_proj = RowStableLinear(
            input_size or cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias
        )
        self.o_proj = RowStableLinear(self.q_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x, ctx.blocks).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)  # [T, H, D]
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        cache = ctx.kv_cache
        cache.write(self.layer_index, ctx.meta.slot_mapping, k, v)
        out = ctx.backend.forward(
            q, cache.key[self.layer_index], cache.value[self.layer_index], ctx.meta, ctx.backend_state, self.scale
        )  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size), ctx.blocks)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, hidden]
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x), ctx.blocks)


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and lm_head; logits only for the rows asked for."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        # Built as a meta skeleton only (tandem/models/weights.py), which the checkpoint fills: an empty weight,
        # which nn.Embedding then does not initialise (see ``building_on_meta``).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = RowStableLinear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, absolute position of each token in its sequence
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        num_layers: int | None = None,
        streams: Sequence[int] = (),
    ) -> HiddenStates:
        """Run the first ``num_layers`` layers (all by default; fewer for early-exit drafting).

        ``streams``: layer indices whose incoming residual stream to keep (see ``HiddenStates``);
        none by default, and then nothing is kept or copied.
        """
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary(positions, x.dtype)
        # Prompt chunks longer than attention's row-wise limit get matmul calls of their own.
        blocks = RowBlocks.from_query_lens(meta.query_lens, ROWWISE_MAX_QUERY, meta.prompt_runs)
        ctx = ForwardContext(kv_cache, meta, backend, backend.prepare(meta), blocks)
        kept: dict[int, torch.Tensor] = {}
        layers = self.layers[: num_layers or len(self.layers)]
        for index, layer in enumerate(layers):
            if index in streams:
                kept[index] = x
            x = layer(x, cos, sin, ctx)
        if len(layers) in streams:
            kept[len(layers)] = x
        return HiddenStates(self.norm(x), kept)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] float32
        logits = self.lm_head(hidden).float()  # [R, V'], V' < vocab for a drafter with a cut vocabulary
        missing = self.config.vocab_size - logits.shape[-1]
        # Ids a cut head does not score can never be drawn: logit -inf, probability 0.
        return nn.functional.pad(logits, (0, missing), value=float("-inf")) if missing else logits
