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

On the device: every tensor is made on the logits' device and nothing is read
back while deciding. Each node gets its own uniform (``N`` draws from the
request's generator, always, then one draw of the next token: seeded runs
repeat), every candidate is tested against the residual it would meet (the
residual after its earlier siblings' rejection, computed for all parents at
once, sibling rank by rank), and the kept path follows from two small matrix
products (a node is kept when it is its parent's first accepted child and so
are all its ancestors). The verifiers return a ``PendingVerdict``; ``fetch``
reads a whole batch's verdicts with one device-to-host copy.

Seeded sampling (``params.exact_seed``: a seed, and no ``rejection_rule``; the position of the
first scored token given): every row's token is drawn as plain decoding draws it,
``seeded_race``: the exponential race (the Gumbel-max trick) against noise hashed from (seed,
that token's position), and a node is kept when it equals the draw at its parent's row
(``_coupled``). Each position's token is then the one plain seeded decoding makes, whatever was
proposed, in how many rounds and from which cache: the output of a seeded request repeats
exactly and equals its plain output. Lossless by construction
(every token is a draw from the target's own p); a deterministic proposal is kept with
probability p(x), as under the rule above. A sampled draft proposal is kept when the draft
drew the same token: the draft worker races its q against the same noise (``draw_coupled``:
the noise is a hash of key and token id, the same on every device), so a draft with q = p is
always kept, and one with q near p nearly always (see ``draft_worker.engine``).

Penalties and logit bias (``tandem.penalties``): the caller passes the rows adjusted, each for its own
context, as ``target_logits``, and the raw ones as ``raw`` for the log-probabilities.

Log-probabilities (``params.logprobs`` set): the target's own, the log-softmax of
its logits (before penalties, bias, temperature, top-k and top-p), at the rows that decided the
emitted tokens: each kept node's token at its parent's row, the next token at
the last kept row, and the most likely tokens of those rows. They are computed
beside the verdict for every node (which are kept is not known yet) and read
with one more copy, of the requests that asked only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from tandem.sampling import SamplingParams, pick_tokens, probabilities, sample, seeded_race
from tandem.spec.transport import TokenLogprob


@dataclass(slots=True)
class Verdict:
    num_accepted: int  # draft tokens kept, 0..k
    next_token: int  # the recovered token (after a rejection) or the bonus token (all kept)
    path: list[int] | None = None  # a tree's kept nodes, root to leaf (None: a chain's first num_accepted)
    logprobs: list[TokenLogprob] | None = None  # asked (``params.logprobs``): one per emitted token, in order
    forced: list[int] = field(default_factory=list)  # a grammar's forced tokens after next_token (the worker's)

    @property
    def accepted_nodes(self) -> list[int]:
        return list(range(self.num_accepted)) if self.path is None else self.path


class PendingVerdict:
    """A verdict decided on the device and not read yet: ``fetch`` reads a whole batch's with one copy.

    ``packed`` ``[N + 1]`` int64 on the device: per draft node 1 if it is kept (kept nodes form a
    root-to-node path, so their indices in increasing order are the path), then the next token.
    Reading a field (or comparing) fetches this verdict alone: one host sync.
    ``scores`` (asked for log-probabilities, ``_scores``): float32 on the device, read with a copy of its own.
    """

    __slots__ = ("packed", "num_nodes", "tree", "scores", "top", "_verdict")

    def __init__(self, packed: torch.Tensor, num_nodes: int, tree: bool, scores: torch.Tensor | None = None,
                 top: int = 0) -> None:
        self.packed = packed
        self.num_nodes = num_nodes
        self.tree = tree
        self.scores = scores
        self.top = top
        self._verdict: Verdict | None = None

    def resolve(self, values: Sequence[int], scores: Sequence[float] = ()) -> Verdict:
        """The verdict from ``packed`` (and ``scores``, when asked) as read on the host."""
        path = [node for node in range(self.num_nodes) if values[node]]
        self._verdict = Verdict(len(path), int(values[self.num_nodes]), path if self.tree else None)
        if self.scores is not None:
            self._verdict.logprobs = self._logprobs(path, scores)
        return self._verdict

    def _logprobs(self, path: list[int], scores: Sequence[float]) -> list[TokenLogprob]:
        """Per emitted token (the kept nodes, then the next token), from ``_scores``'s layout."""
        n, top = self.num_nodes, self.top
        values, ids = n + 1, n + 1 + (n + 1) * top  # where the rows' top values and their ids start
        rows = [0, *(node + 1 for node in path)]  # the row that scored each emitted token
        emitted = [scores[node] for node in path] + [scores[n]]
        return [TokenLogprob(lp, [int(i) for i in scores[ids + row * top: ids + (row + 1) * top]],
                             list(scores[values + row * top: values + (row + 1) * top]))
                for lp, row in zip(emitted, rows)]

    def result(self) -> Verdict:
        return self._verdict if self._verdict is not None else fetch([self])[0]

    @property
    def num_accepted(self) -> int:
        return self.result().num_accepted

    @property
    def next_token(self) -> int:
        return self.result().next_token

    @property
    def path(self) -> list[int] | None:
        return self.result().path

    @property
    def accepted_nodes(self) -> list[int]:
        return self.result().accepted_nodes

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PendingVerdict):
            other = other.result()
        return isinstance(other, Verdict) and self.result() == other

    __hash__ = None  # type: ignore[assignment]  # mutable until read, like Verdict

    def __repr__(self) -> str:
        return f"PendingVerdict({self._verdict if self._verdict is not None else 'not read'})"


def fetch(verdicts: Sequence[Verdict | PendingVerdict]) -> list[Verdict]:
    """Every verdict read on the host, with ONE device-to-host copy for all those still pending.

    The host sync a batch cannot avoid: what it keeps decides the KV and the reply.
    """
    pending = [v for v in verdicts if isinstance(v, PendingVerdict) and v._verdict is None]
    if pending:
        by_device: dict[torch.device, list[PendingVerdict]] = {}
        for v in pending:
            by_device.setdefault(v.packed.device, []).append(v)
        for group in by_device.values():
            values = torch.cat([v.packed for v in group]).tolist()  # the one copy (per device)
            asked = [v.scores for v in group if v.scores is not None]
            scores = torch.cat(asked).tolist() if asked else []  # log-probabilities: only when asked
            start = at = 0
            for v in group:
                size = 0 if v.scores is None else v.scores.numel()
                v.resolve(values[start : start + v.num_nodes + 1], scores[at : at + size])
                start += v.num_nodes + 1
                at += size
    return [v if isinstance(v, Verdict) else v.result() for v in verdicts]


def first_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None,
                position: int | None = None, raw: torch.Tensor | None = None) -> PendingVerdict:
    """A prefill's first token from its ``[1, vocab]`` logits (and its log-probabilities when asked);
    ``position``: the token's (the prompt's length), where a seeded request draws as ``verify`` does;
    ``raw``: the logits before penalties and bias, which log-probabilities report (None: ``logits``)."""
    if params.exact_seed and position is not None:
        key = torch.tensor([params.noise_key(position)], device=logits.device)
        token = seeded_race(probabilities(logits, params), key)  # [1]
    else:
        token = pick_tokens(logits, params, generator)  # [1]
    root = torch.zeros(1, dtype=torch.int64, device=logits.device)  # the one row
    return PendingVerdict(token, 0, tree=False, **_asked(_or(raw, logits), params, _Shape.chain(0, logits.device),
                                                         None, token, root))


def verify_greedy(target_logits: torch.Tensor, draft_tokens: list[int],
                  params: SamplingParams | None = None, raw: torch.Tensor | None = None) -> PendingVerdict:
    """``target_logits`` ``[k+1, vocab]``: keep draft tokens while they equal the target's argmax."""
    return _greedy(target_logits, draft_tokens, _Shape.chain(len(draft_tokens), target_logits.device), params, raw)


def verify_sampled(
    target_logits: torch.Tensor,  # [k+1, vocab]
    draft_tokens: list[int],  # [k]
    draft_probs: torch.Tensor | None,  # [k, vocab] on the logits' device, or None for a deterministic draft
    params: SamplingParams,
    generator: torch.Generator,  # on the logits' device
    raw: torch.Tensor | None = None,  # [k+1, vocab] before penalties and bias, for log-probabilities
) -> PendingVerdict:
    """Standard speculative rejection sampling over one sequence's k draft tokens."""
    shape = _Shape.chain(len(draft_tokens), target_logits.device)
    return _sampled(target_logits, draft_tokens, shape, draft_probs, params, generator, raw)


def verify(
    target_logits: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator | None,
    position: int | None = None,
    raw: torch.Tensor | None = None,
) -> PendingVerdict:
    """Greedy fast path (no softmax at all), seeded draws per position, or rejection sampling.

    ``position``: that of the token row 0 decides (the sequence's committed length); with it a
    seeded request is verified by its seeded draws (the module doc). ``target_logits``: adjusted
    for penalties and bias when the request has them (``tandem.penalties``); ``raw``: the logits
    before, which log-probabilities report (None: ``target_logits``).
    """
    if params.is_greedy:
        return verify_greedy(target_logits, draft_tokens, params, raw)
    assert generator is not None, "sampling needs the request's generator"
    if params.exact_seed and position is not None:
        shape = _Shape.chain(len(draft_tokens), target_logits.device)
        return _coupled(target_logits, draft_tokens, shape, list(range(len(draft_tokens) + 1)), params, position,
                        raw)
    return verify_sampled(target_logits, draft_tokens, draft_probs, params, generator, raw)


def verify_tree(
    target_logits: torch.Tensor,  # [N+1, vocab]: row 0 the root (last committed token), row i+1 node i
    tokens: list[int],  # [N] node tokens
    children: dict[int, list[int]],  # parent node (-1: the root) -> its children in the order to try
    draft_probs: torch.Tensor | None,  # [N, vocab], each node's q (a point mass for a deterministic one), or None
    params: SamplingParams,
    generator: torch.Generator | None,
    position: int | None = None,
    raw: torch.Tensor | None = None,
) -> PendingVerdict:
    """The path a token tree keeps and the target's token after it (see the module doc; ``position``
    and ``raw`` as in ``verify``)."""
    shape = _Shape.tree(children, len(tokens), target_logits.device)
    if params.is_greedy:
        return _greedy(target_logits, tokens, shape, params, raw)
    assert generator is not None, "sampling needs the request's generator"
    if params.exact_seed and position is not None:
        return _coupled(target_logits, tokens, shape, _row_depths(children, len(tokens)), params, position, raw)
    return _sampled(target_logits, tokens, shape, draft_probs, params, generator, raw)


def _row_depths(children: dict[int, list[int]], n: int) -> list[int]:
    """``[N+1]`` each row's depth: row 0 (the root) 0, row i + 1 (node i) one more than its parent's row."""
    depths = [0] * (n + 1)
    pending = [-1]
    while pending:
        parent = pending.pop()
        for child in children.get(parent, []):
            depths[child + 1] = depths[parent + 1] + 1
            pending.append(child)
    return depths


@dataclass(slots=True)
class _Shape:
    """A tree's structure as index tensors on the device (one host-to-device copy, none for a chain).

    Parents are ordered by their number of children, most first, so the parents that have a
    child of sibling rank j are a prefix of those that have one of rank j - 1.
    """

    num_nodes: int
    parent_row_of: torch.Tensor  # [N] each node's parent's row
    parent_rows: torch.Tensor  # [P] the rows of the parents (row 0 the root, row i + 1 node i), ordered
    ranks: list[tuple[torch.Tensor, int]]  # per sibling rank j: the children of rank j [P_j], and P_j
    ancestors: torch.Tensor | None  # [N, N] 1 where column a is row i's ancestor or itself; None: a chain
    earlier: torch.Tensor | None  # [N, N] 1 where column s is an earlier sibling of row i; None: a chain
    position: torch.Tensor | None = None  # [N+1] each row's index in ``parent_rows`` (-1: no children); trees

    @classmethod
    def chain(cls, n: int, device: torch.device) -> _Shape:
        nodes = torch.arange(n, device=device)
        return cls(n, nodes, nodes, [(nodes, n)] if n else [], None, None)

    @classmethod
    def tree(cls, children: dict[int, list[int]], n: int, device: torch.device) -> _Shape:
        order = sorted(children, key=lambda v: -len(children[v]))  # stable: ties stay in the given order
        width = len(children[order[0]]) if order else 0
        kids = [[children[v][j] for v in order if len(children[v]) > j] for j in range(width)]
        parent_of = {c: v for v, cs in children.items() for c in cs}
        ancestors = [[0] * n for _ in range(n)]
        earlier = [[0] * n for _ in range(n)]
        for i in range(n):
            a = i
            while a >= 0:
                ancestors[i][a] = 1
                a = parent_of.get(a, -1)
        for cs in children.values():
            for j, c in enumerate(cs):
                for s in cs[:j]:
                    earlier[c][s] = 1
        flat = [parent_of[i] + 1 for i in range(n)] + [v + 1 for v in order] + [c for row in kids for c in row]
        flat += [x for row in ancestors for x in row] + [x for row in earlier for x in row]
        where = {v + 1: i for i, v in enumerate(order) if children[v]}
        flat += [where.get(row, -1) for row in range(n + 1)]
        # One copy; non_blocking: from pageable memory it stages at once and waits for no kernel.
        dev = torch.tensor(flat, dtype=torch.int64, device="cpu").to(device, non_blocking=True)
        parent_row_of, parent_rows, *rank_nodes, anc, ear, position = dev.split(
            [n, len(order), *map(len, kids), n * n, n * n, n + 1])
        return cls(n, parent_row_of, parent_rows, [(nodes, len(nodes)) for nodes in rank_nodes],
                   anc.view(n, n).float(), ear.view(n, n).float(), position)

    def kept(self, ok: torch.Tensor) -> torch.Tensor:
        """``[N]`` bool, each node accepted against its residual -> ``[N]`` bool, on the kept path."""
        if self.ancestors is None:  # a chain: the accepted prefix
            return ok.cumprod(0).bool()
        assert self.earlier is not None
        first = ok & ((self.earlier @ ok.float()) == 0)  # its parent's first accepted child
        return (self.ancestors @ (~first).float()) == 0  # ... and so are all its ancestors

    def last_row(self, kept: torch.Tensor) -> torch.Tensor:
        """``[1]``: the row of the deepest kept node (0, the root, when none): a parent comes first."""
        rows = torch.arange(1, self.num_nodes + 1, device=kept.device)
        return (rows * kept).amax().view(1) if self.num_nodes else torch.zeros(1, dtype=torch.int64,
                                                                                device=kept.device)


def _node_tokens(tokens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(tokens, dtype=torch.int64, device="cpu").to(device, non_blocking=True)


def _asked(logits: torch.Tensor, params: SamplingParams | None, shape: _Shape, drafted: torch.Tensor | None,
           next_token: torch.Tensor, last_row: torch.Tensor) -> dict:
    """``PendingVerdict``'s scores when the request asked for log-probabilities (else nothing)."""
    if params is None or params.logprobs is None:
        return {}
    return {"scores": _scores(logits, shape, drafted, next_token, last_row, params.logprobs), "top": params.logprobs}


def _scores(logits: torch.Tensor, shape: _Shape, drafted: torch.Tensor | None, next_token: torch.Tensor,
            last_row: torch.Tensor, top: int) -> torch.Tensor:
    """The target's log-probabilities, packed: ``[N]`` each node's token at its parent's row, ``[1]`` the next
    token at ``last_row``, then every row's ``top`` most likely: ``[(N+1) * top]`` values, ``[(N+1) * top]`` ids
    (as float32: exact below 2**24, far above any vocabulary)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N+1, vocab]: raw, before temperature, top-k, top-p
    parts = [logp[shape.parent_row_of, drafted]] if drafted is not None and shape.num_nodes else []
    parts.append(logp[last_row, next_token])  # [1]
    if top:
        values, ids = logp.topk(top, dim=-1)  # [N+1, top]
        parts += [values.flatten(), ids.flatten().float()]
    return torch.cat(parts)


def _or(raw: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor:
    """The logits log-probabilities are read from: the raw ones when the decision used adjusted ones."""
    return logits if raw is None else raw


def _greedy(target_logits: torch.Tensor, tokens: list[int], shape: _Shape,
            params: SamplingParams | None = None, raw: torch.Tensor | None = None) -> PendingVerdict:
    return _matching(_or(raw, target_logits), target_logits.argmax(-1), tokens, shape, params)


def _coupled(
    target_logits: torch.Tensor,  # [N+1, vocab]
    tokens: list[int],  # [N]
    shape: _Shape,
    depths: list[int],  # [N+1] each row's depth (``_row_depths``)
    params: SamplingParams,
    position: int,
    raw: torch.Tensor | None = None,
) -> PendingVerdict:
    """Seeded: each row's token drawn as plain decoding draws the token at its position; drafts kept
    while they equal those draws (the module doc). One race for all rows, no host sync."""
    p = probabilities(target_logits, params)  # [N+1, vocab]
    keys = torch.tensor([params.noise_key(position + depth) for depth in depths], device=p.device)  # [N+1]
    return _matching(_or(raw, target_logits), seeded_race(p, keys), tokens, shape, params)


def _matching(scored: torch.Tensor, choices: torch.Tensor, tokens: list[int], shape: _Shape,
              params: SamplingParams | None) -> PendingVerdict:
    """Nodes kept while they equal the target's choice at their parent's row (``choices`` ``[N+1]``);
    ``scored``: the logits log-probabilities are read from."""
    drafted = _node_tokens(tokens, choices.device)  # [N]
    ok = drafted == choices[shape.parent_row_of]  # [N]
    kept = shape.kept(ok)
    last = shape.last_row(kept)  # [1]
    next_token = choices[last]
    return PendingVerdict(torch.cat([kept.long(), next_token]), shape.num_nodes, shape.ancestors is not None,
                          **_asked(scored, params, shape, drafted, next_token, last))


def _sampled(
    target_logits: torch.Tensor,
    tokens: list[int],
    shape: _Shape,
    draft_probs: torch.Tensor | None,
    params: SamplingParams,
    generator: torch.Generator,
    raw: torch.Tensor | None = None,
) -> PendingVerdict:
    p = probabilities(target_logits, params)  # [N+1, vocab]
    scored = _or(raw, target_logits)
    n, device = shape.num_nodes, p.device
    if n == 0:
        token = sample(p, generator)  # [1]
        root = torch.zeros(1, dtype=torch.int64, device=device)
        return PendingVerdict(token, 0, shape.ancestors is not None,
                              **_asked(scored, params, shape, None, token, root))
    drafted = _node_tokens(tokens, device)  # [N]
    nodes = torch.arange(n, device=device)
    uniforms = torch.rand(n, generator=generator, device=device)  # one per node, always N: seeded runs repeat
    q_drafted = torch.ones(n, device=device) if draft_probs is None else draft_probs[nodes, drafted]  # [N], > 0
    if shape.ancestors is None:  # a chain: only the first rejection's residual is ever needed
        kept = shape.kept(uniforms * q_drafted < p[nodes, drafted])  # u < p/q without dividing by q
        first = kept.sum().view(1)  # [1]: the first rejected node, or n when all are kept (its row: the bonus)
        at = first.clamp(max=n - 1)
        row = p.index_select(0, first)  # [1, vocab]: the row of the rejected node's parent, or the bonus row
        residual = _without(row, drafted[at], None if draft_probs is None else draft_probs.index_select(0, at))
        final = torch.where(first[:, None] < n, residual, row)
        token = sample(final, generator)  # [1]
        return PendingVerdict(torch.cat([kept.long(), token]), n, tree=False,
                              **_asked(scored, params, shape, drafted, token, first))
    ok = torch.zeros(n, dtype=torch.bool, device=device)
    residual = p[shape.parent_rows]  # [P, vocab]: each parent's residual before its first child
    ends = torch.empty_like(residual)  # each parent's residual once all its children are rejected
    for j, (children, count) in enumerate(shape.ranks):
        residual = residual[:count]  # the parents with a child of rank j
        token = drafted[children]
        ok[children] = uniforms[children] * q_drafted[children] < residual.gather(1, token[:, None]).squeeze(1)
        residual = _without(residual, token, None if draft_probs is None else draft_probs[children])
        done = shape.ranks[j + 1][1] if j + 1 < len(shape.ranks) else 0
        ends[done:count] = residual[done:]  # the parents whose last child has rank j
    kept = shape.kept(ok)
    last = shape.last_row(kept)  # [1]
    at = shape.position[last]  # [1]: where the last row is among the parents (-1: a leaf)
    final = torch.where(at[:, None] >= 0, ends.index_select(0, at.clamp(min=0)), p.index_select(0, last))
    token = sample(final, generator)  # [1]
    return PendingVerdict(torch.cat([kept.long(), token]), n, tree=True,
                          **_asked(scored, params, shape, drafted, token, last))


def _without(residual: torch.Tensor, token: torch.Tensor, q: torch.Tensor | None) -> torch.Tensor:
    """normalize(max(0, r - q)) per row after a rejected candidate (q None: point masses on ``token``).

    ``residual`` ``[M, vocab]``, ``token`` ``[M]``, ``q`` ``[M, vocab]``.
    """
    if q is None:
        out = residual.scatter(1, token[:, None], 0.0)
    else:
        out = torch.clamp(residual - q, min=0.0)
    total = out.sum(-1, keepdim=True)
    # 0 only when r <= q everywhere, i.e. r == q, where rejection has probability 0: round-off guard.
    return torch.where(total > 0, out / total, residual)
