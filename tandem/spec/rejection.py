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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.sampling import SamplingParams, probabilities, sample


@dataclass(slots=True)
class Verdict:
    num_accepted: int  # draft tokens kept, 0..k
    next_token: int  # the recovered token (after a rejection) or the bonus token (all kept)


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
