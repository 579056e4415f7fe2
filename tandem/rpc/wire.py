"""Conversion between protobuf messages and plain Python types, for every role (the coordinator included).

Torch-free on purpose: the coordinator imports it and must not load torch.
Distributions (tensors) are converted in ``tandem.rpc.distributions``, by the
workers only.
"""

from __future__ import annotations

from tandem.sampling_params import SamplingParams
from tandem.v1 import common_pb2


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
