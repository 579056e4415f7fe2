"""Decoder-only transformer for the Llama and Qwen2 families, over a ragged batch.

Qwen2 is Llama with biases on the q/k/v projections (and, in the GGUF
checkpoints here, an untied lm_head); both come from ``ModelConfig``. The
model knows nothing about sequences or batching: it takes a flat stream of
new tokens with their positions, writes their K/V into the paged cache at
``meta.slot_mapping``, and lets the attention backend read the cache.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.attention.base import AttentionBackend, AttentionMetadata
from tandem.attention.sdpa import ROWWISE_MAX_QUERY
from tandem.config import ModelConfig
from tandem.kv_cache import PagedKVCache
from tandem.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, RowBlocks, RowStableLinear, apply_rotary


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        # q, k and v fused into one matmul: one pass over the activations instead of three.
        self.qkv_proj = RowStableLinear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = RowStableLinear(self.q_size, cfg.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        backend_state: Any,
        blocks: RowBlocks,
    ) -> torch.Tensor:  # [T, hidden]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x, blocks).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)  # [T, H, D]
        k = apply_rotary(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        kv_cache.write(self.layer_index, meta.slot_mapping, k, v)
        out = backend.forward(
            q, kv_cache.key[self.layer_index], kv_cache.value[self.layer_index], meta, backend_state, self.scale
        )  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size), blocks)


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
        kv_cache: PagedKVCache,
        meta: AttentionMetadata,
        backend: AttentionBackend,
        backend_state: Any,
        blocks: RowBlocks,
    ) -> torch.Tensor:  # [T, hidden]
        attn = self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta, backend, backend_state, blocks)
        x = x + attn
        return x + self.mlp(self.post_attention_layernorm(x), blocks)


class CausalLM(nn.Module):
    """Embedding, decoder layers, final norm and lm_head; logits only for the rows asked for."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
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
    ) -> torch.Tensor:  # [T, hidden], after the final norm
        """Run the first ``num_layers`` layers (all by default; fewer for early-exit drafting)."""
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary(positions, x.dtype)
        state = backend.prepare(meta)
        # Prompt chunks longer than attention's row-wise limit get matmul calls of their own.
        blocks = RowBlocks.from_query_lens(meta.query_lens, ROWWISE_MAX_QUERY)
        for layer in self.layers[: num_layers or len(self.layers)]:
            x = layer(x, cos, sin, kv_cache, meta, backend, state, blocks)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [R, hidden] -> [R, vocab] float32
        logits = self.lm_head(hidden).float()  # [R, V'], V' < vocab for a drafter with a cut vocabulary
        missing = self.config.vocab_size - logits.shape[-1]
        # Ids a cut head does not score can never be drawn: logit -inf, probability 0.
        return nn.functional.pad(logits, (0, missing), value=float("-inf")) if missing else logits
