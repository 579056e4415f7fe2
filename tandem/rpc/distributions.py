"""Distributions on the wire: rows of q <-> ``SparseDistribution`` messages. The only module that converts them.

Format (per row): the token ids whose probability is at least
``MIN_WIRE_PROB``, in increasing order, and their probabilities as
little-endian float16. Decoding renormalises and returns float32.

Losslessness needs the target's acceptance test to use the very q each draft
token was drawn from. So the draft encodes q ONCE (``encode_for_sampling``),
samples from what decoding those messages gives, and sends those very
messages; the target decodes them with ``decode_distributions``. Both sides
run the same host code on the same ids and float16 values, and the result is
bit-for-bit the same wherever it runs: the float64 sum of float16
probabilities (each a multiple of 2^-24, each <= 1) is exact whatever the
summation order, and the division and the float32 rounding are correctly
rounded.

Encoding a batch ``[R, vocab]`` touches the device once: the mask, the
compact support and its float16 values are computed where q lives (CPU or
GPU), packed into one int32 tensor, and copied to the host in one transfer
(on a GPU, ``nonzero`` also waits for the support's size); the host then
only slices that buffer into messages.

Decoding stays on the host (``decode_sparse``: parsing and checks need no
device); ``DecodedRows.dense`` then puts a batch's rows on the device from
their sparse form.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.errors import InvalidRequestError
from tandem.v1 import common_pb2

# Tokens whose probability is below this are dropped from the wire (and so from the draft's
# own sampling distribution): q changes a little, the acceptance rule stays exact.
MIN_WIRE_PROB = 1e-6


def wire_values(values: torch.Tensor) -> torch.Tensor:
    """Probabilities ``[N]`` -> the float16 values that travel (on q's device). One place to change the format."""
    return values.to(torch.float16)


def pack(q: torch.Tensor) -> torch.Tensor:
    """``[R, vocab]`` q -> one integer tensor on q's device: ``[R row ends | N flat indices | N float16 bits]``.

    The support is found on the flattened q (``nonzero`` returns it in order,
    row after row), so row r's flat indices are its token ids plus
    ``r * vocab``; ``searchsorted`` finds where each row ends without reading
    anything back. int32 unless q has 2^31 elements or more.
    """
    if q.dim() != 2:
        raise ValueError(f"q must be [rows, vocab], got shape {tuple(q.shape)}")
    num_rows, vocab = q.shape
    flat = (q >= MIN_WIRE_PROB).reshape(-1).nonzero().squeeze(-1)  # [N] increasing
    ends = torch.searchsorted(flat, torch.arange(1, num_rows + 1, device=q.device) * vocab)  # [R]
    bits = wire_values(torch.take(q, flat)).view(torch.int16)  # [N]
    dtype = torch.int32 if q.numel() < 2**31 else torch.int64
    return torch.cat([ends.to(dtype), flat.to(dtype), bits.to(dtype)])


@dataclass(slots=True)
class HostRows:
    """A packed batch on the host: per row, its token ids and float16 wire values (numpy)."""

    token_ids: list[np.ndarray]
    values: list[np.ndarray]
    vocab_size: int


def to_host(q: torch.Tensor) -> HostRows:
    """``[R, vocab]`` on any device -> ``HostRows``, with ONE device-to-host copy."""
    num_rows, vocab = q.shape
    packed = pack(q.detach()).cpu().numpy()  # the one copy; the rest only slices it
    ends = packed[:num_rows].astype(np.int64)
    total = int(ends[-1]) if num_rows else 0
    flat = packed[num_rows : num_rows + total]
    values = packed[num_rows + total :].astype(np.int16).view(np.float16)
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    spans = list(zip(starts, ends))
    return HostRows([flat[a:b] - r * vocab for r, (a, b) in enumerate(spans)], [values[a:b] for a, b in spans], vocab)


def messages(rows: HostRows) -> list[common_pb2.SparseDistribution]:
    """One ``SparseDistribution`` per row."""
    return [
        common_pb2.SparseDistribution(token_ids=ids.tolist(), probs_fp16=values.astype("<f2", copy=False).tobytes())
        for ids, values in zip(rows.token_ids, rows.values)
    ]


def encode_distributions(q: torch.Tensor) -> list[common_pb2.SparseDistribution]:
    """``[R, vocab]`` probabilities (any device) -> one message per row."""
    return messages(to_host(q))


@dataclass(slots=True)
class WireRows:
    """q encoded once: the messages to send and, per row, exactly what they decode to.

    ``probs[r]`` holds ``decode_distributions(messages)[r]`` at ``token_ids[r]``
    (bit for bit; the row is 0 everywhere else), so drawing an index from
    ``probs[r]`` is drawing a token from the decoded q (on the support only:
    ~10x cheaper than ``torch.multinomial`` over the whole vocabulary).
    """

    messages: list[common_pb2.SparseDistribution]
    token_ids: list[np.ndarray]  # [N_r] integers, increasing
    probs: list[torch.Tensor]  # [N_r] float32, > 0
    vocab_size: int

    def dense(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[R, vocab]`` float32 on ``device``: equal to ``decode_distributions(self.messages, vocab_size)``."""
        return _scatter_rows(self.token_ids, [p.numpy() for p in self.probs], self.vocab_size, device)


def encode_for_sampling(q: torch.Tensor) -> WireRows:
    """Encode q once: the messages the draft sends and what they decode to, which it samples from.

    The decoded rows come from the very ids and values that went into the
    messages, through the code ``decode_distributions`` runs after parsing
    them, so they are equal bit for bit (tests check it) without parsing the
    messages back.
    """
    rows = to_host(q)
    return WireRows(messages(rows), rows.token_ids, [_normalised(v) for v in rows.values], rows.vocab_size)


def _normalised(values: np.ndarray) -> torch.Tensor:
    """float16 wire values -> float32 probabilities summing to 1 (the float64 sum is exact: see the module doc)."""
    v64 = values.astype(np.float64)
    return torch.from_numpy((v64 / v64.sum()).astype(np.float32))


def parse(msg: common_pb2.SparseDistribution, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """A received message -> (token ids, float16 values), validated."""
    if len(msg.probs_fp16) != 2 * len(msg.token_ids):
        raise InvalidRequestError(
            f"distribution has {len(msg.token_ids)} token ids but {len(msg.probs_fp16) / 2:g} probabilities"
        )
    values = np.frombuffer(msg.probs_fp16, dtype="<f2")
    ids = np.asarray(msg.token_ids, dtype=np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise InvalidRequestError(f"distribution token ids must be in 0..{vocab_size - 1}")
    if len(ids) > 1 and not (np.diff(ids) > 0).all():
        raise InvalidRequestError("distribution token ids must be strictly increasing")
    if not (np.isfinite(values).all() and (values >= 0).all()):
        raise InvalidRequestError("distribution probabilities must be finite and >= 0")
    if not values.astype(np.float64).sum() > 0:
        raise InvalidRequestError("distribution has no probability mass")
    return ids, values


@dataclass(slots=True)
class DecodedRows:
    """Received distributions decoded on the host, sparse: per row its token ids and float32 probabilities.

    What the target checks (``prob_of``) without touching the device; ``dense`` then builds
    ``[R, vocab]`` on the device from one host-to-device copy of the sparse rows, never a
    dense host matrix (``R * vocab`` floats would cross the bus for a few hundred values).
    """

    token_ids: list[np.ndarray]  # [N_r] int64, increasing
    probs: list[np.ndarray]  # [N_r] float32, summing to 1
    vocab_size: int

    def prob_of(self, tokens: list[int]) -> list[float]:
        """Row r's probability of ``tokens[r]`` (0 when it is not in the row's support)."""
        out = []
        for ids, probs, token in zip(self.token_ids, self.probs, tokens):
            at = int(np.searchsorted(ids, token))
            out.append(float(probs[at]) if at < len(ids) and ids[at] == token else 0.0)
        return out

    def dense(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """``[R, vocab]`` float32 on ``device``, 0 outside each row's support."""
        return _scatter_rows(self.token_ids, self.probs, self.vocab_size, device)


def _scatter_rows(token_ids: list[np.ndarray], probs: list[np.ndarray], vocab: int,
                  device: torch.device | str) -> torch.Tensor:
    """Sparse rows -> dense ``[R, vocab]`` on ``device``: flat indices and values cross in one copy each."""
    offsets = (ids.astype(np.int64) + r * vocab for r, ids in enumerate(token_ids))
    flat = np.concatenate([np.zeros(0, np.int64), *offsets])
    values = np.concatenate([np.zeros(0, np.float32), *(np.asarray(p, np.float32) for p in probs)])
    dense = torch.zeros(len(token_ids) * vocab, dtype=torch.float32, device=device)
    # non_blocking: from pageable memory the copy stages at once and waits for no kernel.
    index = torch.from_numpy(flat).to(device, non_blocking=True)
    dense.index_put_((index,), torch.from_numpy(values).to(device, non_blocking=True))
    return dense.view(len(token_ids), vocab)


def decode_sparse(msgs: list[common_pb2.SparseDistribution], vocab_size: int,
                  drafted: list[int] | None = None) -> DecodedRows:
    """Messages -> ``DecodedRows`` on the host, each row renormalised.

    ``drafted``: the token of each row; an empty message then stands for a point mass on it (a
    deterministic node in a sampled tree, ``tandem.spec.tree.POINT_MASS``). Raises
    ``InvalidRequestError`` (a ``ValueError``) on a malformed message.
    """
    ids_out, probs_out = [], []
    for row, msg in enumerate(msgs):
        if drafted is not None and not msg.token_ids and not msg.probs_fp16:
            ids_out.append(np.array([drafted[row]], dtype=np.int64))
            probs_out.append(np.ones(1, dtype=np.float32))
            continue
        ids, values = parse(msg, vocab_size)
        ids_out.append(ids)
        probs_out.append(_normalised(values).numpy())
    return DecodedRows(ids_out, probs_out, vocab_size)


def decode_distributions(msgs: list[common_pb2.SparseDistribution], vocab_size: int,
                         drafted: list[int] | None = None, device: torch.device | str = "cpu") -> torch.Tensor:
    """Messages -> dense ``[len(msgs), vocab]`` float32 on ``device``, each row renormalised (see ``decode_sparse``)."""
    return decode_sparse(msgs, vocab_size, drafted).dense(device)
