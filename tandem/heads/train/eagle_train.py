"""What an EAGLE-3 head is asked on a batch, with training-time test (TTT): ``steps`` draft steps at once.

Pair ``t`` is (the target's feature at ``t``, the token ``x_{t+1}``). Step 1 at pair ``t``
reads ``fc(feature_t)`` and guesses ``y_{t+1}`` (the target's label for the token after
``x_{t+1}``). Step ``j >= 2`` at ``t`` reads, as its hidden state, step ``j - 1``'s output
at ``t`` (no ``fc``, as drafting feeds its own output back) and the token ``x_{t+j}``
(teacher forced), and guesses ``y_{t+j}``. Its attention sees the step-1 keys of pairs
``<= t`` and the keys of steps ``2..j`` at ``t`` itself only: exactly what serving's
drafting sees when it drafts ``j`` tokens past a verified position ``t`` (the target's
pairs cached in the head's KV, then its own drafted tokens on that one branch).
Positions follow: step ``j`` at ``t`` sits at position ``t + j - 1`` (rotary is relative,
so the origin does not matter, only that drafting counts the same way).

Serving runs the layer over the paged KV cache (``tandem.models.transformer.ForwardContext``);
training runs ``dense_step`` instead: the same parameters (``self_attn.qkv_proj``, rotary,
``o_proj``, the MLP, the norms) over dense ``[B, P, ...]`` tensors with an explicit mask,
which autograd can go through and a batch of sequences fills. A test holds the two equal.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.heads.eagle import EagleHead
from tandem.heads.train.shards import Batch
from tandem.heads.train.vocab import draft_labels
from tandem.models.layers import apply_rotary

Prediction = tuple[torch.Tensor, torch.Tensor]  # logits [R, draft_vocab] float32, draft labels [R] int64
KeyValue = tuple[torch.Tensor, torch.Tensor]  # [B, P, Hkv, D] each


def ttt_mask(num_pairs: int, step: int, device: torch.device) -> torch.Tensor:  # [P, step * P] bool
    """The keys step ``step`` (1-based) at pair ``t`` sees: step 1's keys ``<= t``, then steps 2.. at ``t`` only."""
    index = torch.arange(num_pairs, device=device)
    causal = index[None, :] <= index[:, None]  # [P, P]
    diagonal = torch.eye(num_pairs, dtype=torch.bool, device=device)  # [P, P]
    return torch.cat([causal, *([diagonal] * (step - 1))], dim=1)


def dense_step(
    head: EagleHead,
    embeds: torch.Tensor,  # [B, P, H], the embedding of each pair's token
    hidden: torch.Tensor,  # [B, P, H], each pair's hidden state (fc of a feature, or the previous step's output)
    first_position: int,  # pair 0's position: step j's pairs sit at t + j - 1
    earlier: list[KeyValue],  # the keys and values of the steps before this one, step 1 first
) -> tuple[torch.Tensor, KeyValue]:  # [B, P, H] before the final norm, this step's (keys, values)
    layer = head.layer
    attn = layer.self_attn
    batch, pairs, _ = hidden.shape
    positions = torch.arange(first_position, first_position + pairs, device=hidden.device)  # [P]
    cos, sin = head.rotary(positions, hidden.dtype)  # [P, 1, D], broadcast over the batch
    qkv = F.linear(layer.attention_input(embeds, hidden), attn.qkv_proj.weight, attn.qkv_proj.bias)  # [B, P, q+2kv]
    q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
    q = apply_rotary(q.reshape(batch, pairs, attn.num_heads, attn.head_dim), cos.to(q.dtype), sin.to(q.dtype))
    k = apply_rotary(k.reshape(batch, pairs, attn.num_kv_heads, attn.head_dim), cos.to(k.dtype), sin.to(k.dtype))
    v = v.reshape(batch, pairs, attn.num_kv_heads, attn.head_dim)
    keys = torch.cat([kv[0] for kv in earlier] + [k], dim=1)  # [B, step * P, Hkv, D]
    values = torch.cat([kv[1] for kv in earlier] + [v], dim=1)
    mask = ttt_mask(pairs, len(earlier) + 1, hidden.device)
    out = F.scaled_dot_product_attention(  # [B, Hq, P, D]
        q.transpose(1, 2), keys.transpose(1, 2).to(q.dtype), values.transpose(1, 2).to(q.dtype),
        attn_mask=mask, scale=attn.scale, enable_gqa=attn.num_heads != attn.num_kv_heads,
    )
    out = F.linear(out.transpose(1, 2).reshape(batch, pairs, attn.q_size), attn.o_proj.weight)  # [B, P, H]
    x = hidden + out
    mlp = layer.mlp
    gate, up = F.linear(layer.post_attention_layernorm(x), mlp.gate_up_proj.weight).chunk(2, dim=-1)
    return x + F.linear(F.silu(gate) * up, mlp.down_proj.weight), (k, v)


class EagleObjective:
    def __init__(self, head: EagleHead, t2d: torch.Tensor, embed_tokens: torch.Tensor, steps: int) -> None:
        self.head = head
        self.t2d = t2d  # [vocab] int64, -1: not in the draft vocabulary
        self.embed_tokens = embed_tokens  # [vocab, H], the target's (frozen, never stored with the head)
        self.steps = steps
        self.names = [f"step {j}" for j in range(1, steps + 1)]

    def predictions(self, batch: Batch) -> list[Prediction]:
        head = self.head
        num_tokens = batch.tokens.shape[1]
        pairs = num_tokens - 1
        dtype = head.fc.weight.dtype
        hidden = head.project(batch.features[:, :pairs].to(dtype))  # [B, P, H]
        index = torch.arange(pairs, device=hidden.device)  # [P]
        earlier: list[KeyValue] = []
        out: list[Prediction] = []
        for step in range(1, self.steps + 1):
            tokens = F.pad(batch.tokens[:, step:], (0, step - 1), value=0)  # [B, P]: x_{t+step}
            labels = F.pad(batch.labels[:, step:], (0, step - 1), value=0)  # [B, P]: y_{t+step}
            # A pair counts where its label exists and is one to learn (not a prompt's: see corpus.learn_from).
            rows = (index[None, :] + step < batch.lengths[:, None]) & (labels >= 0)  # [B, P]
            embeds = self.embed_tokens[tokens].to(dtype)  # [B, P, H]
            hidden, kv = dense_step(head, embeds, hidden, step - 1, earlier)
            earlier.append(kv)
            out.append((head.logits(hidden[rows]), draft_labels(labels[rows], self.t2d)))
        return out
