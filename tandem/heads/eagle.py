"""An EAGLE-3 head: one decoder layer of its own over (the target's feature, the next token's embedding).

Per position ``t`` it reads a pair: the target's feature at ``t`` (the concatenated
residual streams of ``HeadsConfig.feature_streams``, projected to the hidden size by
``fc``) and the embedding of the token at ``t + 1`` (the target's own embedding
table: no copy). Its output (before the final norm) is the predicted feature at
``t + 1``; ``logits`` scores the token at ``t + 2`` from it. Drafting further feeds
that output back as the next pair's hidden state, with the drafted token (no ``fc``:
it is already of hidden size). This is vLLM's and the speculators library's EAGLE-3
layer: the attention reads ``[input_layernorm(embedding), hidden_norm(hidden)]`` side
by side (2 x hidden wide), the residual stream starts from the hidden state.

The layer keeps a paged KV cache of its own, one pair per target KV position, rolled
back and released with the target's (``tandem.heads.drafters``).
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.heads.config import HeadsConfig
from tandem.models.layers import GatedMLP, RMSNorm, RotaryEmbedding, RowBlocks, RowStableLinear
from tandem.models.transformer import Attention, ForwardContext


class EagleLayer(nn.Module):
    def __init__(self, cfg: HeadsConfig) -> None:
        super().__init__()
        layer = cfg.layer_config()
        hidden = cfg.hidden_size
        self.input_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)  # on the token embedding
        self.hidden_norm = RMSNorm(hidden, cfg.rms_norm_eps)  # on the hidden state
        self.self_attn = Attention(layer, 0, input_size=2 * hidden)
        self.post_attention_layernorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.mlp = GatedMLP(hidden, cfg.intermediate_size)

    def attention_input(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:  # -> [T, 2 * H]
        return torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H], the embedding of each pair's token
        hidden: torch.Tensor,  # [T, H], each pair's hidden state (fc of a target feature, or a drafted output)
        cos: torch.Tensor,  # [T, 1, D]
        sin: torch.Tensor,  # [T, 1, D]
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, H], before the final norm: the next pair's hidden state
        x = hidden + self.self_attn(self.attention_input(embeds, hidden), cos, sin, ctx)
        return x + self.mlp(self.post_attention_layernorm(x), ctx.blocks)


class EagleHead(nn.Module):
    def __init__(self, cfg: HeadsConfig) -> None:
        super().__init__()
        if cfg.kind != "eagle":
            raise ValueError(f"EagleHead needs an eagle config, got {cfg.kind!r}")
        self.config = cfg
        # Row-stable as the layer's own linears: a row's KV is then the same whether its feature came with a
        # prompt or with one verified token (the head's prefix cache keeps rows of both).
        self.fc = RowStableLinear(cfg.feature_size, cfg.hidden_size, bias=False)
        self.layer = EagleLayer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Row-stable too: a node's scores do not depend on what else the batch step drafts.
        self.lm_head = RowStableLinear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        # draft id -> target id ([draft_vocab] int64); the identity when the draft vocabulary is the target's
        self.register_buffer("d2t", torch.arange(cfg.draft_vocab_size, dtype=torch.int64))

    def project(self, features: torch.Tensor, blocks: RowBlocks | None = None) -> torch.Tensor:
        """A target feature as the layer's hidden input: ``[T, feature_size]`` -> ``[T, H]`` (``blocks``: how the
        rows split into runs, ``RowStableLinear``'s)."""
        return self.fc(features, blocks)

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H]
        hidden: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T] int64
        ctx: ForwardContext,
    ) -> torch.Tensor:  # [T, H] before the norm
        cos, sin = self.rotary(positions, hidden.dtype)
        return self.layer(embeds, hidden, cos, sin, ctx)

    def logits(self, out: torch.Tensor) -> torch.Tensor:  # [R, H] -> [R, draft_vocab] float32
        return self.lm_head(self.norm(out)).float()
