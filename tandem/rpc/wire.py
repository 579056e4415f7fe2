"""Conversion between protobuf messages and plain Python types, for every role (the coordinator included).

Torch-free on purpose: the coordinator imports it and must not load torch.
Distributions (tensors) are converted in ``tandem.rpc.distributions``, by the
workers only.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.errors import InternalError
from tandem.sampling_params import SamplingParams, logit_bias_pairs
from tandem.spec.transport import TokenLogprob, TreeProposal
from tandem.v1 import common_pb2, target_pb2


def sampling_from_proto(msg: common_pb2.SamplingOptions) -> SamplingParams:
    """Validated SamplingParams; top_p 0 on the wire means unset (1.0)."""
    return SamplingParams(
        temperature=msg.temperature,
        top_p=msg.top_p if msg.top_p != 0 else 1.0,
        top_k=msg.top_k,
        min_p=msg.min_p,
        allowed_token_ids=tuple(sorted(set(msg.allowed_token_ids))),
        bad_word_ids=tuple(tuple(word.ids) for word in msg.bad_word_ids),
        seed=msg.seed if msg.HasField("seed") else None,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        rejection_rule=msg.rejection_rule,
        repetition_penalty=msg.repetition_penalty if msg.repetition_penalty != 0 else 1.0,
        frequency_penalty=msg.frequency_penalty,
        presence_penalty=msg.presence_penalty,
        logit_bias=logit_bias_pairs(dict(msg.logit_bias)),
        json_object=msg.json_object,
        json_schema=msg.json_schema,
        grammar=msg.grammar,
        min_tokens=msg.min_tokens,
        min_tokens_stop_ids=tuple(msg.min_tokens_stop_ids),
    )


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingOptions:
    msg = common_pb2.SamplingOptions(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
                                     min_p=params.min_p, allowed_token_ids=params.allowed_token_ids,
                                     bad_word_ids=[common_pb2.TokenSequence(ids=w) for w in params.bad_word_ids],
                                     rejection_rule=params.rejection_rule,
                                     repetition_penalty=params.repetition_penalty,
                                     frequency_penalty=params.frequency_penalty,
                                     presence_penalty=params.presence_penalty, logit_bias=dict(params.logit_bias),
                                     json_object=params.json_object, json_schema=params.json_schema,
                                     grammar=params.grammar, min_tokens=params.min_tokens,
                                     min_tokens_stop_ids=params.min_tokens_stop_ids)
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    return msg


def logprobs_to_proto(scores: Sequence[TokenLogprob] | None) -> list[common_pb2.TokenLogprobs]:
    return [common_pb2.TokenLogprobs(logprob=s.logprob, top_ids=s.top_ids, top_logprobs=s.top_logprobs, rank=s.rank)
            for s in scores or ()]


def logprobs_from_proto(msgs: Sequence[common_pb2.TokenLogprobs]) -> list[TokenLogprob]:
    return [TokenLogprob(m.logprob, list(m.top_ids), list(m.top_logprobs), m.rank) for m in msgs]


def proposal_to_proto(tokens: Sequence[int], parents: Sequence[int]) -> target_pb2.TokenTree:
    return target_pb2.TokenTree(tokens=tokens, parents=parents)


def proposal_from_proto(tree: target_pb2.TokenTree) -> TreeProposal:
    """A worker's proposal, checked: a well-formed tree (a bad one would fail the next Verify instead)."""
    tokens, parents = list(tree.tokens), list(tree.parents)
    if len(tokens) != len(parents) or any(not -1 <= p < i for i, p in enumerate(parents)):
        raise InternalError("a target worker answered a malformed proposal tree")
    return TreeProposal(tokens, parents)
