"""Incremental detokenization with stop strings: bounded work per generated token.

Decoding the whole output again for every token (to find stop strings and to
stream text) costs O(n) per token, O(n²) per request. ``TextStream`` uses the
prefix-offset technique of TGI and vLLM instead: it decodes only a short
window, ``ids[start:]``, and the new text is what that decode adds to the part
of the window's text already accounted for (``prefix``). The window's first
tokens give the decoder its context (a SentencePiece decoder drops the leading
space of the first token it sees), so text is never taken from them alone.

Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM) tokens can end inside a UTF-8
character. The decoder joins all bytes and decodes them lossily, so an
unfinished character shows as a trailing U+FFFD that a later token may turn
into the real character: that one character is held back. Only the last
U+FFFD of a lossy decode can change; earlier ones are final and pass through,
exactly as the full decode has them. For other decoders (SentencePiece byte
fallback, which turns each byte of a bad run into U+FFFD) every trailing
U+FFFD is held back, as TGI and vLLM do.

Once the window is longer than ``WINDOW`` tokens it restarts at one of the last
few token boundaries, ``cut``. Decoding ``ids[cut:]`` alone may differ from the
window's text at its start only: if ``cut`` splits a character, the character's
remaining bytes decode as ``k`` stray U+FFFDs, where ``k = len(decode(ids[start:cut]))
+ len(decode(ids[cut:])) - len(decode(ids[start:]))`` (0 at a character
boundary). After those both decodes agree, and keep agreeing on every later
byte, so the restart is taken when the text not yet accounted for lies in that
agreeing part; it is checked on the strings, so a decoder that is not what
this assumes makes the restart wait rather than corrupt the text. An unfinished
character has at most 3 bytes and every byte-level token at least one, so one
of the last three boundaries always qualifies. Each push thus costs one decode
of at most ``WINDOW + 1`` ids, plus one decode of a single id per restart (the
decode of ``ids[start:cut]`` for ``cut = len - 1`` is the previous push's
window), plus two decodes for each further boundary tried.

Stop strings are looked for in text that can no longer change: the new text
plus the last ``len(longest stop) - 1`` characters before it, so the earliest
occurrence is found as soon as its last character is decoded. ``take()`` holds
back only the longest tail that is a proper prefix of some stop string. The
text ends before the stop string found, or after it with ``include_stop``
(vLLM's ``include_stop_str_in_output``).

Everything here is plain Python: the tokenizer is the Hugging Face object from
``tandem.tokenizer.load_tokenizer``; no torch, no numpy.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode puts where bytes do not form a character


def decoder_skipped_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that ``decode(..., skip_special_tokens=True)`` drops before decoding: the special added tokens.

    ``all_special_ids`` is not that set (Qwen's ``<|fim_prefix|>`` & co. are special to
    the Rust tokenizer without being named there); the added-token table carries the flag.
    """
    table = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return frozenset(int(i) for i, tok in table.items() if getattr(tok, "special", False))


def decodes_bytes_lossily(tokenizer: Any) -> bool:
    """True for a byte-level BPE decoder: all token bytes joined, then one lossy UTF-8 decode."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


class TextStream:
    """The text of one request's generated tokens, built incrementally, with stop strings."""

    WINDOW = 8  # a window longer than this many ids restarts near its end
    RESTART_CANDIDATES = 4  # token boundaries tried for a restart, latest first

    def __init__(self, tokenizer: Any, stop_strings: tuple[str, ...] = (),
                 skip_token_ids: frozenset[int] = frozenset(), include_stop: bool = False) -> None:
        if any(not s for s in stop_strings):
            raise ValueError("a stop string must not be empty")
        self._tokenizer = tokenizer
        self._stops = tuple(dict.fromkeys(stop_strings))
        self._include_stop = include_stop  # the text ends after the stop string found, not before it (vLLM's)
        self._keep = max((len(s) for s in self._stops), default=1) - 1  # tail a stop string may still need
        # Special tokens add no text and do not touch their neighbours' bytes: drop them with the skipped ids.
        self._skip = frozenset(int(i) for i in skip_token_ids) | decoder_skipped_ids(tokenizer)
        self._lossy = decodes_bytes_lossily(tokenizer)
        self._ids: list[int] = []
        self._start = 0  # the window is ids[start:]
        self._window = ""  # decode(ids[start:])
        self._prefix = ""  # the window's text already accounted for (a prefix of it)
        self._parts: list[str] = []  # the text that can no longer change, cut at a stop string
        self._length = 0
        self._tail = ""  # its last self._keep characters, where a stop string may have begun
        self._unsent: list[str] = []  # the part take() has not returned yet
        self._stopped = False
        self._finished = False

    # ----- the interface -------------------------------------------------------
    def push(self, token_id: int) -> bool:
        """Add one generated token; True when the text now contains a stop string (then push no more)."""
        if self._stopped:
            raise RuntimeError("TextStream: push after a stop string; the request has ended")
        if self._finished:
            raise RuntimeError("TextStream: push after finish()")
        token_id = int(token_id)
        if token_id in self._skip:
            return False
        self._ids.append(token_id)
        previous, window = self._window, self._decode(self._start, len(self._ids))
        self._window = window
        if not window.startswith(self._prefix):
            return False  # the decoder rewrote text it had produced (not byte-level BPE); finish() settles it
        new = window[len(self._prefix):]
        if self._lossy:
            stable = len(new) - 1 if new.endswith(REPLACEMENT) else len(new)
        else:
            stable = len(new.rstrip(REPLACEMENT))
        if stable > 0:
            self._prefix = window[:len(self._prefix) + stable]
            self._add(new[:stable])
            if self._stopped:
                return True
        if len(self._ids) - self._start > self.WINDOW:
            self._restart(previous, window)
        return False

    def take(self) -> str:
        """Text safe to emit since the last take(); everything up to the cut once stopped or finished."""
        if not self._unsent:
            return ""
        pending = "".join(self._unsent)
        hold = 0 if (self._stopped or self._finished) else min(self._stop_prefix_length(), len(pending))
        self._unsent = [pending[len(pending) - hold:]] if hold else []
        return pending[:len(pending) - hold]

    def finish(self) -> None:
        """The request ended (length, EOS): release every held-back character to the next take()."""
        if self._finished or self._stopped:
            return
        if self._window.startswith(self._prefix):
            rest = self._window[len(self._prefix):]
        else:  # only a decoder that rewrites its own text gets here; the full decode is the truth
            rest = self._decode(0, len(self._ids))[self._length:]
        self._finished = True
        if rest:
            self._add(rest)  # a stop string containing U+FFFD could still match here

    @property
    def text(self) -> str:
        """All text so far: the full decode of the pushed ids, cut before the first stop string."""
        if len(self._parts) > 1:
            self._parts = ["".join(self._parts)]
        text = self._parts[0] if self._parts else ""
        if self._stopped or self._finished:
            return text
        if self._window.startswith(self._prefix):
            return text + self._window[len(self._prefix):]
        return self._decode(0, len(self._ids))

    @property
    def stopped(self) -> bool:
        return self._stopped

    # ----- the window ----------------------------------------------------------
    def _decode(self, start: int, stop: int) -> str:
        return self._tokenizer.decode(self._ids[start:stop], skip_special_tokens=True)

    def _restart(self, previous: str, window: str) -> None:
        """Move the window's start to a late token boundary where a decode from there agrees with it."""
        n, start = len(self._ids), self._start
        unsettled = len(window) - len(self._prefix)  # characters at the end not accounted for yet
        for cut in range(n - 1, max(start, n - 1 - self.RESTART_CANDIDATES), -1):
            head = previous if cut == n - 1 else self._decode(start, cut)  # previous = decode(ids[start:n-1])
            fresh = self._decode(cut, n)
            split = len(head) + len(fresh) - len(window)  # stray U+FFFDs of a character cut in two
            if split > 0 and not (self._lossy and head.endswith(REPLACEMENT)
                                  and fresh.startswith(REPLACEMENT * split)):
                continue
            if split < 0 and self._lossy:
                continue  # cannot happen with a lossy UTF-8 decode
            agree = max(split, 0)  # fresh[agree:] is window's text from the same byte on
            accounted = len(fresh) - unsettled
            if accounted < agree or not window.endswith(fresh[agree:]):
                continue  # the cut splits the unsettled text
            self._start, self._window, self._prefix = cut, fresh, fresh[:accounted]
            return

    # ----- settled text and stop strings ---------------------------------------
    def _add(self, piece: str) -> None:
        """Append text that can no longer change; cut it at the first stop string."""
        if self._stops:
            recent = self._tail + piece
            # The earliest stop string found; of two starting there, the longer (it holds the shorter).
            found = min(((i, -len(s)) for s in self._stops if (i := recent.find(s)) >= 0), default=None)
            if found is not None:
                cut, stop_length = found[0], -found[1] if self._include_stop else 0
                self._stop_at(self._length - len(self._tail) + cut + stop_length, piece)
                return
            self._tail = recent[-self._keep:] if self._keep else ""
        self._parts.append(piece)
        self._unsent.append(piece)
        self._length += len(piece)

    def _stop_at(self, cut: int, piece: str) -> None:
        text = ("".join(self._parts) + piece)[:cut]
        sent = self._length - sum(len(p) for p in self._unsent)  # <= cut: take() held back any stop's start
        self._parts, self._unsent = [text], [text[sent:]]
        self._length = len(text)
        self._stopped = True

    def _stop_prefix_length(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        tail, longest = self._tail, 0
        for s in self._stops:
            # candidate starts: where s's first character occurs among tail's last len(s) - 1; earliest is longest
            i = tail.find(s[0], max(len(tail) - len(s) + 1, 0))
            while 0 <= i < len(tail) - longest:
                if s.startswith(tail[i:]):
                    longest = len(tail) - i
                    break
                i = tail.find(s[0], i + 1)
        return longest
