"""Conversion between protobuf messages and our Python/tensor types: the only place that does it.

Distributions travel as fp16 probabilities on a sparse support. The draft
samples from exactly the distribution that comes out of
``decode_distribution(encode_distribution(q))``, so the target's acceptance
test uses the very q each draft token was drawn from, as losslessness needs.
"""

from __future__ import annotations

import numpy as np
import torch

from tandem.sampling import SamplingParams
from tandem.v1 import common_pb2

# Tokens whose probability rounds below this are dropped from the wire (and so from the
# draft's own sampling distribution): q changes a little, the rule stays exact.
MIN_WIRE_PROB = 1e-6


def sampling_from_proto(msg: common_pb2.SamplingOptions) -> SamplingParams:
    """Validated SamplingParams; top_p 0 on the wire means unset (1.0)."""
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p != 0 else 1.0,
        top_k=msg.top_k,
        seed=msg.seed if msg.HasField("seed") else None,
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingOptions:
    msg = common_pb2.SamplingOptions(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
    if params.seed is not None:
        msg.seed = params.seed
    return msg


def encode_distribution(q: torch.Tensor) -> common_pb2.SparseDistribution:
    """``q`` ``[vocab]`` -> sparse fp16 message (tokens with probability >= MIN_WIRE_PROB)."""
    ids = torch.nonzero(q >= MIN_WIRE_PROB).squeeze(-1)  # [support]
    values = q[ids].to(torch.float16).numpy().astype("<f2")
    return common_pb2.SparseDistribution(token_ids=ids.tolist(), probs_fp16=values.tobytes())


def decode_distribution(msg: common_pb2.SparseDistribution, vocab_size: int) -> torch.Tensor:
    """Sparse message -> dense ``[vocab]`` float32 distribution, renormalised (deterministically)."""
    values = np.frombuffer(msg.probs_fp16, dtype="<f2").astype(np.float64)
    if len(values) != len(msg.token_ids):
        raise ValueError(f"distribution has {len(msg.token_ids)} token ids but {len(values)} probabilities")
    ids = np.asarray(msg.token_ids, dtype=np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"distribution token ids must be in 0..{vocab_size - 1}")
    total = values.sum()
    if not total > 0:
        raise ValueError("distribution has no probability mass")
    dense = np.zeros(vocab_size, dtype=np.float64)
    dense[ids] = values / total
    return torch.from_numpy(dense).float()


def wire_roundtrip(q: torch.Tensor) -> torch.Tensor:
    """``[R, vocab]`` -> the distributions the target will see; the draft samples from these."""
    return torch.stack([decode_distribution(encode_distribution(row), q.shape[-1]) for row in q])
