"""Deciding which draft tokens the target keeps (Leviathan et al. 2023; Chen et al. 2023).

For one sequence the target scored ``k+1`` positions: the last committed
token followed by the k draft tokens ``d_1..d_k``. Row ``i`` of its output is
the target's distribution p_i for the token after position i.

- **accepted** tokens: the longest prefix of the draft the rule keeps.
  Greedy: d_i is kept while it equals argmax p_{i-1}. Sampling: d_i is kept
  with probability min(1, p(d_i) / q(d_i)), q being the exact distribution
  the draft sampled d_i from (a point mass when the draft was deterministic).
- **recovered** token: at the first rejection, a token drawn from
  normalize(max(0, p − q)) (greedy: the argmax), replacing the rejected one.
- **bonus** token: when all k are accepted, one more drawn from p_k.

So every round yields ``accepted + 1`` tokens, and the output follows the
target's distribution exactly, whatever the draft proposed.

Trees (``verify_tree``): several candidates per position, each node scored in
the same pass (row 0 the root, row i + 1 node i). Greedy follows the children
that equal the target's argmax. Sampling uses SpecInfer's multi-step
speculative sampling (Miao et al. 2024, "SpecInfer", Algorithm 2; the same
recursive rule as Yang et al.'s multi-candidate speculative decoding): at a
node with residual r (first the target's p there), try its children in order;
a child c drawn from q_c is kept with probability min(1, r(c) / q_c(c)); when
rejected, r <- normalize(max(0, r - q_c)). A kept child becomes the node (r =
p at its row); when every child is rejected, the next token is drawn from r.
Lossless when each child was drawn from its q_c independently of the others'
draws given the path (a deterministic child: q_c = a point mass on it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tandem.sampling import SamplingParams, probabilities, sample


@dataclass(slots=True)
class Verdict:
    num_accepted: int  # draft tokens kept, 0..k
    next_token: int  # the recovered token (after a rejection) or the bonus token (all kept)
    path: list[int] | None = None  # a tree's kept nodes, root to leaf (None: a chain's first num_accepted)

    @property
    def accepted_nodes(self) -> list[int]:
        return list(range(self.num_accepted)) if self.path is None else self.path


def verify_greedy(target_logits: torch.Tensor, draft_tokens: list[int]) -> Verdict:
    """``target_logits`` ``[k+1, vocab]``: keep draft tokens while they equal the target's argmax."""
    choices = target_logits.argmax(-1).tolist()  # [k+1]; one host copy per sequence per round
    accepted = 0
    while accepted < len(draft_tokens) and draft_tokens[accepted] == choices[accepted]:
        accepted += 1
    return Verdict(accepted, choices[accepted])


def verify_sampled(
    target_logits: torch.Tensor,  # [k+1, vocab]
    draft_tokens: list[int],  # [k]
    draft_probs: torch.Tensor | None,  # [k, vocab], or None for a deterministic draft
    params: SamplingParams,
    generator: torch.Generator,
) -> Verdict:
    """Standard speculative rejection sampling over one sequence's k draft tokens."""
    k = len(draft_tokens)
    p = probabilities(target_logits, params)  # [k+1, vocab]
    if k == 0:
        return Verdict(0, int(sample(p, generator)[0]))
    drafted = torch.tensor(draft_tokens, dtype=torch.int64)  # [k]
    rows = torch.arange(k)
    if draft_probs is None:
        q = torch.zeros(k, p.shape[-1]).index_put_((rows, drafted), torch.tensor(1.0))  # point masses
    else:
        q = draft_probs
    p_draft = p[rows, drafted]  # [k]
    q_draft = q[rows, drafted]  # [k]; > 0, since each d_i was drawn from q_i
    uniforms = torch.rand(k, generator=generator)  # one draw per draft token, always k: seeded runs repeat
    keep = uniforms * q_draft < p_draft  # u < p/q without dividing by q
    rejected = (~keep).nonzero()
    if rejected.numel() == 0:
        return Verdict(k, int(sample(p[k : k + 1], generator)[0]))
    first = int(rejected[0, 0])
    residual = torch.clamp(p[first] - q[first], min=0.0)  # [vocab]
    total = residual.sum()
    # residual sums to 0 only when p == q on the support, where rejection has probability 0;
    # guard anyway against float round-off.
    residual = residual / total if total > 0 else p[first]
    return Verdict(first, int(sample(residual[None], generator)[0]))


def verify(
    target_logits: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    """Greedy fast path (no softmax at all) or rejection sampling."""
    if params.is_greedy:
        return verify_greedy(target_logits, draft_tokens)
    assert generator is not None, "sampling needs the request's generator"
    return verify_sampled(target_logits, draft_tokens, draft_probs, params, generator)


def verify_tree(
    target_logits: torch.Tensor,  # [N+1, vocab]: row 0 the root (last committed token), row i+1 node i
    tokens: list[int],  # [N] node tokens
    children: dict[int, list[int]],  # parent node (-1: the root) -> its children in the order to try
    draft_probs: torch.Tensor | None,  # [N, vocab], each node's q (a point mass for a deterministic one), or None
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    """The path a token tree keeps and the target's token after it (see the module doc)."""
    if params.is_greedy:
        return _greedy_tree(target_logits, tokens, children)
    assert generator is not None, "sampling needs the request's generator"
    p = probabilities(target_logits, params)  # [N+1, vocab]
    path: list[int] = []
    node = -1
    residual = p[0]
    while True:
        for child in children.get(node, ()):
            token = tokens[child]
            q = None if draft_probs is None else draft_probs[child]  # [vocab]
            q_token = 1.0 if q is None else float(q[token])
            if float(torch.rand(1, generator=generator)) * q_token < float(residual[token]):
                path.append(child)
                node, residual = child, p[child + 1]
                break
            residual = _without(residual, token, q)
        else:
            return Verdict(len(path), int(sample(residual[None], generator)[0]), path)


def _without(residual: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    """normalize(max(0, r - q)) after a rejected candidate (q None: a point mass on ``token``)."""
    if q is None:
        out = residual.clone()
        out[token] = 0.0
    else:
        out = torch.clamp(residual - q, min=0.0)
    total = out.sum()
    # 0 only when r <= q everywhere, i.e. r == q, where rejection has probability 0: round-off guard.
    return out / total if total > 0 else residual


def _greedy_tree(target_logits: torch.Tensor, tokens: Sequence[int], children: dict[int, list[int]]) -> Verdict:
    choices = target_logits.argmax(-1).tolist()  # [N+1], one host copy
    path: list[int] = []
    node = -1
    while True:
        want = choices[node + 1]
        node = next((c for c in children.get(node, ()) if tokens[c] == want), None)
        if node is None:
            return Verdict(len(path), want, path)
        path.append(node)
