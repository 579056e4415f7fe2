"""Structured output: a request's JSON object or JSON schema enforced on the target's rows, with llguidance.

The schema becomes a grammar (llguidance's JSON compiler), the grammar a matcher over the tokenizer's
vocabulary, and the matcher, at each state, a bitmask of the tokens it allows next. The target worker
keeps one matcher per sequence, advanced by every token the sequence commits.

A Verify scores several rows at once, and row i predicts the token after the committed text AND the
drafts on the path to it. So each row is masked for its own context: the matcher is advanced through
that row's drafts, its mask taken, and rolled back (``Matcher.masks``). A row whose path the grammar
refuses is left unmasked: its path holds a token that the row before masked out (probability 0), so
no verdict can reach it. Masked rows are then the target's distribution under the constraint, and
verification keeps its guarantees: greedy output equals constrained target-only decoding, and
sampling is lossless (tests/draft_worker/test_structured_lossless.py).

The grammar ends in the model's stop tokens: once the JSON value is complete, only they are allowed.
Drafts are not constrained (a draft model or an n-gram proposes freely; the target turns down what the
grammar refuses). Torch is imported where masks are made only: the coordinator checks schemas with
``check_response_format`` and must not load torch.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.errors import InvalidRequestError
from tandem.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from tandem.config import ModelConfig

log = logging.getLogger(__name__)


def cannot_enforce(params: SamplingParams, error: str) -> InvalidRequestError:
    """The error for a constraint llguidance refuses, naming the request field that set it."""
    if params.grammar:
        return InvalidRequestError(f"grammar: the grammar cannot be enforced: {error}")
    return InvalidRequestError(f"response_format: the JSON schema cannot be enforced: {error}")


def grammar_of(params: SamplingParams) -> str:
    """The request's llguidance grammar (any JSON object for ``json_object``)."""
    import llguidance

    if params.grammar:
        return params.grammar
    schema = params.json_schema or '{"type": "object"}'
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema)
    except ValueError as exc:
        raise InvalidRequestError(f"response_format: {exc}") from None


def choice_grammar(choices: Sequence[str]) -> str:
    """A grammar (llguidance's Lark) whose only texts are ``choices``, each exactly (vLLM's ``choice``)."""
    if not choices or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError("choice: a non-empty list of non-empty strings")
    return "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def regex_grammar(pattern: str) -> str:
    """A grammar whose texts are the matches of ``pattern`` (Rust's regex syntax, as llguidance reads it), whole."""
    import llguidance

    if not pattern:
        raise InvalidRequestError("regex: an empty pattern")
    return llguidance.LLMatcher.grammar_from_regex(pattern)


def check_response_format(params: SamplingParams) -> None:
    """The schema or grammar compiles (without a tokenizer: what the coordinator can check), else a named error."""
    if not params.structured:
        return
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar_of(params))
    if error:
        raise cannot_enforce(params, error)


class StructuredOutput:
    """A worker's matcher factory: the tokenizer read for llguidance once, on the first constrained request."""

    def __init__(self, model_dir: Path, config: ModelConfig) -> None:
        self.model_dir = Path(model_dir)
        self.config = config
        self.vocab_size = config.vocab_size  # the model's rows (Qwen pads its vocabulary past the tokenizer's)
        self._tokenizer: Any = None
        self.stop_ids: list[int] = []  # the model's stop tokens, known with the tokenizer

    def tokenizer(self) -> Any:
        """llguidance's view of the tokenizer; its end tokens are the model's stop tokens (the grammar's end)."""
        if self._tokenizer is None:
            import llguidance.hf

            from tandem.tokenizer import load_tokenizer, stop_token_ids

            tokenizer = load_tokenizer(self.model_dir)
            stops = sorted(stop_token_ids(self.model_dir, tokenizer, self.config))
            try:
                self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size,
                                                               eos_token=stops or None)
            except ValueError as exc:  # a tokenizer whose pieces llguidance cannot read as bytes
                raise InvalidRequestError(f"response_format: structured output cannot read this model's tokenizer "
                                          f"({exc})") from None
            self.stop_ids = stops
        return self._tokenizer

    def prepare(self) -> None:
        """Read the tokenizer now (a worker's start). One llguidance cannot read is logged, not raised: the worker
        serves everything else, and a request with a response format gets the error by name."""
        try:
            self.tokenizer()
        except InvalidRequestError as exc:
            log.warning("%s: requests with a response format will be refused", exc)

    def matcher(self, params: SamplingParams, generated: Sequence[int] = ()) -> Matcher:
        """A matcher for the request, advanced through its ``generated`` tokens (a rebuild's)."""
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer(), grammar_of(params), log_level=0)
        if matcher.is_error():
            raise cannot_enforce(params, matcher.get_error())
        out = Matcher(matcher, self.vocab_size, self.stop_ids)
        out.commit(generated)
        return out


class Matcher:
    """One sequence's grammar state: as many generated tokens consumed as the sequence has committed."""

    def __init__(self, matcher: Any, vocab_size: int, stop_ids: Sequence[int] = ()) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.stop_ids = [t for t in stop_ids if t < vocab_size]
        self.consumed = 0  # generated tokens the matcher has taken (all of them, while the text follows the grammar)
        self.ended = False  # a token it refused (past the end of the value, when a stop token ended the text)

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance through tokens the sequence committed. A verdict only keeps allowed tokens, but a stop token
        may be followed by more (the coordinator cuts the text there): past that, the matcher stops following."""
        if self.ended or not tokens:
            return
        taken = self.matcher.try_consume_tokens(list(tokens))
        self.consumed += taken
        self.ended = taken < len(tokens)

    def rollback_to(self, generated: int) -> None:
        """Back to ``generated`` committed tokens (a Verify that cuts the history). llguidance keeps the whole
        history, so this holds for any depth (206 tokens measured); past what it consumed it would err for good."""
        generated = max(0, generated)
        if generated < self.consumed:
            if not self.matcher.rollback(self.consumed - generated):
                raise InvalidRequestError(f"response_format: the grammar cannot roll back {self.consumed - generated}"
                                          " tokens")
            self.consumed = generated
            self.ended = False

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens the grammar forces after the committed text: the only text it allows next, in the
        tokenizer's own spelling (a row's mask also allows other spellings of it); none once the matcher stopped
        following."""
        if self.ended or limit <= 0:
            return []
        return [t for t in self.matcher.compute_ff_tokens()[:limit] if t < self.vocab_size]

    def masks(self, row_paths: Sequence[Sequence[int]]) -> torch.Tensor:
        """``[R, ceil(vocab / 32)]`` int32 on the host: row r's allowed tokens after its path (all for a row
        the grammar cannot reach, or once the matcher stopped following; the stop tokens alone where the
        grammar allows nothing, as an unsatisfiable schema does)."""
        import numpy as np
        import torch

        # All allowed to start with. (Not llguidance.torch: importing it sets up torch.compile.)
        bitmask = torch.full((len(row_paths), (self.vocab_size + 31) // 32), -1, dtype=torch.int32, device="cpu")
        if self.ended:
            return bitmask
        for r, path in enumerate(row_paths):
            taken = self.matcher.try_consume_tokens(list(path)) if path else 0
            if taken == len(path):
                row = bitmask[r]  # contiguous: llguidance writes the row's words in place
                self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
                if not bitmask[r].any():  # nothing allowed: end the text (a row of -inf would be no distribution)
                    words = bitmask.numpy().view(np.uint32)  # the same memory: bit 31 without int32's sign
                    for t in self.stop_ids:
                        words[r, t >> 5] |= np.uint32(1 << (t & 31))
                    if not self.stop_ids:
                        bitmask[r] = -1
            if taken:
                self.matcher.rollback(taken)
        return bitmask


def apply_masks(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[R, vocab]`` with every token a row's mask refuses at -inf (a new tensor; one copy of the
    mask to the logits' device, nothing read back)."""
    import torch

    rows, vocab = logits.shape
    mask = bitmask.to(logits.device, non_blocking=True)  # [R, W] int32
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
    allowed = ((mask[:, :, None] >> bits) & 1).reshape(rows, -1)[:, :vocab].bool()  # [R, W * 32] -> [R, vocab]
    return logits.masked_fill(~allowed, float("-inf"))
