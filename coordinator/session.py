"""One request's life in the coordinator: its full token history, stop conditions, text and stats.

The history (prompt + every committed token) is what lets any worker's state
be rebuilt elsewhere. Tokens are committed one by one so that EOS, stop
token ids, stop strings and max_new_tokens all cut exactly where they occur,
even in the middle of a run of accepted drafts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tandem.sampling import SamplingParams
from tandem.spec.adaptive import AcceptanceTracker


@dataclass(slots=True)
class StopConditions:
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    stop_strings: tuple[str, ...] = ()


@dataclass(slots=True)
class SessionStats:
    drafted: int = 0
    accepted: int = 0
    rounds: int = 0
    spec_rounds: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    prefill_wait_s: float = 0.0  # outside every round
    draft_wait_s: float = 0.0  # inside rounds, like the two below: overhead = round wall - waits
    verify_wait_s: float = 0.0
    round_wall_s: float = 0.0
    chosen_k: list[int] = field(default_factory=list)


class Session:
    def __init__(self, request_id: str, prompt_ids: list[int], sampling: SamplingParams, stop: StopConditions,
                 tokenizer: Any, method: str, k_max: int, adaptive_k: bool, pipelined: bool) -> None:
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.history = list(prompt_ids)
        self.sampling = sampling
        self.stop = stop
        self.tokenizer = tokenizer
        self.method = method
        self.k_max = k_max
        self.adaptive_k = adaptive_k
        self.pipelined = pipelined
        self.tracker = AcceptanceTracker()
        self.stats = SessionStats()
        self.started_at = time.perf_counter()
        self.finish_reason: str | None = None
        self._stop_text: str | None = None  # the text cut before a stop string, once one is hit
        self._emitted_text = 0  # characters already streamed
        self._emitted_tokens = 0

    @property
    def generated(self) -> list[int]:
        return self.history[len(self.prompt_ids):]

    @property
    def remaining(self) -> int:
        return self.stop.max_new_tokens - len(self.generated)

    def commit(self, tokens: list[int]) -> None:
        now = time.perf_counter()
        for token in tokens:
            if self.finish_reason:
                return
            self.history.append(token)
            if self.stats.first_token_at is None:
                self.stats.first_token_at = now
            self.stats.last_token_at = now
            if token in self.stop.stop_token_ids:
                self.finish_reason = "stop"
            elif self.stop.stop_strings and self._hits_stop_string():
                self.finish_reason = "stop"
            elif self.remaining <= 0:
                self.finish_reason = "length"

    def _hits_stop_string(self) -> bool:
        text = self.decode_generated()
        cut = min((i for s in self.stop.stop_strings if (i := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            self._stop_text = text[:cut]
            return True
        return False

    def decode_generated(self) -> str:
        ids = [t for t in self.generated if t not in self.stop.stop_token_ids]
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def final_text(self) -> str:
        return self._stop_text if self._stop_text is not None else self.decode_generated()

    def take_delta(self) -> tuple[str, list[int]]:
        """New text and tokens since the last call; text that may still become a stop string is held back."""
        tokens = self.generated[self._emitted_tokens:]
        self._emitted_tokens = len(self.generated)
        text = self.final_text() if self.finish_reason else self.decode_generated()
        if not self.finish_reason:
            # Hold back an incomplete UTF-8 character, and any tail that could start a stop string.
            safe = len(text.rstrip("\ufffd"))
            for s in self.stop.stop_strings:
                for n in range(min(len(s) - 1, safe), 0, -1):
                    if text[:safe].endswith(s[:n]):
                        safe -= n
                        break
            text = text[:safe]
        delta = text[self._emitted_text:]
        self._emitted_text = max(self._emitted_text, len(text))
        return delta, tokens
