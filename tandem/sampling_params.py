"""A request's sampling parameters: plain data, torch-free (the coordinator validates them too)."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.errors import InvalidRequestError

MAX_LOGPROBS = 20  # most alternatives per position a request may ask the target's log-probabilities of
MAX_PENALTY = 2.0  # frequency and presence penalties lie in [-MAX_PENALTY, MAX_PENALTY], as OpenAI's
MAX_LOGIT_BIAS = 100.0  # a logit bias lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS], as OpenAI's
MAX_LOGIT_BIAS_TOKENS = 300  # most token ids one request may bias (OpenAI refuses more)

if TYPE_CHECKING:
    import torch


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request picks its tokens. ``temperature == 0`` means greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    # The target's log-probabilities of the emitted tokens, with this many top alternatives each; None: none.
    # Reported only: it changes no token.
    logprobs: int | None = None
    # The target's log-probability of every prompt token after the first, with this many top alternatives each;
    # None: none. Reported only; such a prompt is computed whole (its rows' logits are not in the prefix cache).
    prompt_logprobs: int | None = None
    # The first ``min_tokens`` generated tokens are never one of ``min_tokens_stop_ids`` (their logits -inf on
    # every row predicting an earlier position: ``tandem.penalties``); the coordinator sets both (vLLM's min_tokens).
    min_tokens: int = 0
    min_tokens_stop_ids: tuple[int, ...] = ()
    # A seeded request is verified by the target's own seeded draw per position (tandem.spec.rejection,
    # "Seeded sampling"); True: by the rejection rule, as an unseeded one (its statistical tests ask this).
    rejection_rule: bool = False
    # Logit processing before temperature (``tandem.penalties``), as vLLM and OpenAI define it: each row's logits
    # get the bias, then the repetition penalty (Keskar et al. 2019, transformers' rule) for every token the row's
    # context holds, prompt included, then minus frequency_penalty times each token's count in the generated text
    # so far and presence_penalty for each token present there. Every row is adjusted for its own context, a
    # drafted token's row for the drafts before it: the output is still the target alone's.
    repetition_penalty: float = 1.0  # > 0; 1: none
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, ids ascending and distinct
    # Structured output (``tandem.structured_output``): the text must be a JSON object (json_object), or a JSON
    # value valid under this JSON schema (json_schema, the schema's JSON text). The target masks every scored
    # row to the tokens the grammar allows after that row's context, drafts included.
    json_object: bool = False
    json_schema: str = ""
    # Or any grammar in llguidance's Lark dialect (tool calls that must be made are one, tandem.tool_calls).
    grammar: str = ""
    # min-p (Nguyen et al. 2024; vLLM's, SGLang's, llama.cpp's), applied after temperature and before top-k: a
    # token less likely than min_p times the most likely one is dropped. 0: none. (Last, so that positional
    # SamplingParams(temperature, top_p, top_k, seed) calls keep their meaning.)
    min_p: float = 0.0
    # vLLM's allowed_token_ids: every other token's logit is -inf on every row (after the bias and penalties
    # change nothing of these), so the text holds only these ids. Distinct, ascending; () allows every id.
    allowed_token_ids: tuple[int, ...] = ()
    # vLLM's bad_words, as token ids (the coordinator tokenizes the words): a one-token word's token is -inf on
    # every row; a longer word's last token on each row whose generated text ends with the word's other tokens.
    bad_word_ids: tuple[tuple[int, ...], ...] = ()

    @property
    def structured(self) -> bool:
        """Whether a grammar constrains this request's text."""
        return self.json_object or bool(self.json_schema) or bool(self.grammar)

    @property
    def adjusts_logits(self) -> bool:
        """Whether a penalty or a bias changes this request's logits (else they go to temperature untouched)."""
        return (self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0
                or bool(self.logit_bias) or (self.min_tokens > 0 and bool(self.min_tokens_stop_ids))
                or bool(self.allowed_token_ids) or bool(self.bad_word_ids))

    @property
    def exact_seed(self) -> bool:
        """Whether verification keeps the target's own seeded draw at each position (sampled and seeded)."""
        return self.seed is not None and not self.rejection_rule and not self.is_greedy

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # also rejects NaN; inf would divide logits into NaN
            raise InvalidRequestError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 <= self.min_p <= 1:  # also rejects NaN
            raise InvalidRequestError(f"min_p must be in [0, 1] (0 disables it), got {self.min_p}")
        if self.seed is not None:
            if not -(2**63) <= self.seed < 2**64:
                raise InvalidRequestError(f"seed must be a 64-bit integer (signed or not), got {self.seed}")
            # One seed, one stream, on every path: the wire carries a uint64, so a negative seed (OpenAI's are
            # int64) is the same seed as its wrap, in process too.
            object.__setattr__(self, "seed", self.seed % 2**64)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"logprobs must be in 0..{MAX_LOGPROBS} alternatives, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(
                f"prompt_logprobs must be in 0..{MAX_LOGPROBS} alternatives, got {self.prompt_logprobs}")
        if self.min_tokens < 0:
            raise InvalidRequestError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if any(t < 0 for t in self.min_tokens_stop_ids):
            raise InvalidRequestError("min_tokens_stop_ids: token ids must be >= 0")
        if not 0 < self.repetition_penalty < math.inf:
            raise InvalidRequestError(
                f"repetition_penalty must be > 0 and finite (1: none), got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidRequestError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        self._check_logit_bias()
        if self.json_object and self.json_schema:
            raise InvalidRequestError("response_format: give json_object or json_schema, not both")
        if any(b <= a for a, b in zip(self.allowed_token_ids, self.allowed_token_ids[1:])) or (
                self.allowed_token_ids and self.allowed_token_ids[0] < 0):
            raise InvalidRequestError("allowed_token_ids: token ids must be >= 0, distinct and ascending")
        if self.allowed_token_ids and (self.json_object or self.json_schema or self.grammar):
            raise InvalidRequestError("allowed_token_ids: not with a response format, grammar or required tool call "
                                      "(the two could leave no token): give one")
        if self.allowed_token_ids and self.min_tokens and set(self.allowed_token_ids) <= set(
                self.min_tokens_stop_ids):
            raise InvalidRequestError("allowed_token_ids: only stop tokens, which min_tokens holds back: no token "
                                      "would be left")
        if any(not word or min(word) < 0 for word in self.bad_word_ids):
            raise InvalidRequestError("bad_words: each word needs at least one token id, every id >= 0")
        if self.grammar and (self.json_object or self.json_schema):
            raise InvalidRequestError("grammar: give a grammar or a response format, not both")
        if self.json_schema:
            try:
                schema = json.loads(self.json_schema)
            except ValueError as exc:
                raise InvalidRequestError(f"response_format: json_schema is not JSON ({exc})") from None
            if not isinstance(schema, dict):
                raise InvalidRequestError("response_format: json_schema must be a JSON object (a schema)")

    def _check_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_TOKENS:
            raise InvalidRequestError(f"logit_bias holds {len(self.logit_bias)} token ids, at most "
                                      f"{MAX_LOGIT_BIAS_TOKENS} are taken")
        last = -1
        for token, bias in self.logit_bias:
            if token < 0:
                raise InvalidRequestError(f"logit_bias: token id {token} is negative")
            if token <= last:
                raise InvalidRequestError(f"logit_bias: token ids must be distinct and ascending, {token} after {last}")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:  # also NaN
                raise InvalidRequestError(f"logit_bias of token {token} must be in [-{MAX_LOGIT_BIAS:g}, "
                                          f"{MAX_LOGIT_BIAS:g}], got {bias}")
            last = token

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    def make_generator(self, device: torch.device | str = "cpu") -> torch.Generator:
        """A generator of this request's own: seeded runs repeat exactly, whatever else is batched."""
        import torch  # only the model side samples; the coordinator never calls this

        seed = self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        return torch.Generator(device=device).manual_seed(seed)

    def noise_key(self, position: int, stream: int = 0) -> int:
        """A seeded request's key of the noise its token at ``position`` races (``tandem.sampling.seeded_race``):
        (seed, stream, position) hashed to a signed 64-bit integer, so every replica and device draws alike."""
        digest = hashlib.blake2b(f"{self.seed}:{stream}:{position}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "little", signed=True)

    def seed_at(self, generator: torch.Generator, position: int, stream: int = 0) -> None:
        """Seeded requests draw the randomness of each position from (seed, stream, position) alone.

        A request rebuilt on another replica after a fault then goes on with the very draws it
        would have made where it was, so a seeded stream survives a move (given the same rounds).
        ``stream`` keeps the draft's draws apart from the target's. Unseeded requests keep one
        stream from ``make_generator``.
        """
        if self.seed is not None:
            digest = hashlib.blake2b(f"{self.seed}:{stream}:{position}".encode(), digest_size=8).digest()
            generator.manual_seed(int.from_bytes(digest, "little") >> 1)


def logit_bias_pairs(bias: dict[int, float]) -> tuple[tuple[int, float], ...]:
    """A token id -> bias mapping as ``SamplingParams.logit_bias`` holds it (ids ascending)."""
    return tuple(sorted((int(token), float(value)) for token, value in bias.items()))
