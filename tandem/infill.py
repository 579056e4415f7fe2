"""Fill in the middle: a code model's prompt for the text between a prefix and a suffix.

Code models trained with the fill-in-the-middle objective (Bavarian et al., 2022) read the text before a
gap and the text after it, each behind a marker token, and write what goes between; an editor asks this
for the code at its cursor. The markers are the model's own tokens, so the server builds the prompt (as
Ollama and DeepSeek's API do for OpenAI's ``suffix``) and the client sends plain text. The format is
known from the tokenizer's vocabulary, never from the model's name:

- ``<|fim_prefix|>`` ``<|fim_suffix|>`` ``<|fim_middle|>``: Qwen2.5-Coder, CodeGemma;
- ``<fim_prefix>`` ``<fim_suffix>`` ``<fim_middle>``: StarCoder, StarCoder2, Granite Code;
- ``<｜fim▁begin｜>`` ``<｜fim▁hole｜>`` ``<｜fim▁end｜>``: DeepSeek-Coder.

All three are prefix-suffix-middle: ``[lead] PRE prefix SUF suffix MID``, then the model writes the middle
and ends it with an end token of its format (Qwen's ``<|endoftext|>``, a ``<|file_sep|>`` when it would go
on to another file), which ends the answer as the model's own end tokens do. ``lead`` is what the tokenizer
puts before any text (a BOS, where it has one). The marker ids are placed as ids, and the client's two
texts are tokenized apart, without special-token markers of their own being added, as the marker splits
them anyway. A model whose vocabulary holds no such markers is refused by name: prefix and suffix joined
as plain text would not ask a model for a middle.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# (prefix, suffix, middle markers), then the tokens that end a middle in that format where the vocabulary has them
_FORMATS: tuple[tuple[tuple[str, str, str], tuple[str, ...]], ...] = (
    (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
     ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|file_separator|>")),
    (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<|endoftext|>", "<fim_pad>", "<file_sep>")),
    (("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"), ("<｜end▁of▁sentence｜>", "<|EOT|>")),
)
KNOWN_MARKERS = ", ".join(markers[0] for markers, _ in _FORMATS)


@dataclass(frozen=True, slots=True)
class InfillFormat:
    """A model's fill-in-the-middle prompt: its marker ids, what precedes them, and the ids that end a middle."""

    prefix_id: int
    suffix_id: int
    middle_id: int
    lead: tuple[int, ...]  # what the tokenizer puts before any text (a BOS), or nothing
    stop_ids: frozenset[int]  # the format's end tokens this vocabulary holds
    markers: tuple[str, str, str]  # the marker tokens' text, for messages

    @classmethod
    def of(cls, tokenizer: Any) -> InfillFormat | None:
        """The format ``tokenizer``'s vocabulary holds the markers of, or None (the model does not fill in)."""
        vocab = tokenizer.get_vocab()
        for markers, ends in _FORMATS:
            if all(m in vocab for m in markers):
                prefix, suffix, middle = (int(vocab[m]) for m in markers)
                stops = frozenset(int(vocab[t]) for t in ends if t in vocab)
                return cls(prefix, suffix, middle, _lead(tokenizer), stops, markers)
        return None

    def prompt_ids(self, tokenizer: Any, prefix: str, suffix: str) -> list[int]:
        """The prompt asking for the text between ``prefix`` and ``suffix``."""
        return [*self.lead, self.prefix_id, *_encode(tokenizer, prefix), self.suffix_id, *_encode(tokenizer, suffix),
                self.middle_id]


def _encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def _lead(tokenizer: Any) -> tuple[int, ...]:
    """The ids the tokenizer puts before a text's own (a BOS): those before the bare encoding in the full one."""
    bare = list(tokenizer.encode("x", add_special_tokens=False))
    full = list(tokenizer.encode("x", add_special_tokens=True))
    for start in range(len(full) - len(bare) + 1):
        if full[start:start + len(bare)] == bare:
            return tuple(full[:start])
    return ()


def no_infill_message(field: str) -> str:
    """The refusal of a fill-in-the-middle request to a model without markers, naming ``field``."""
    return (f"{field}: this model's tokenizer has no fill-in-the-middle tokens ({KNOWN_MARKERS} and the like), so "
            f"it cannot write the text between a prefix and a suffix; send the whole prompt without a suffix")
