"""The target worker's state and its batched step.

Per sequence it keeps the committed token history (the worker's own output
is authoritative), the sampling parameters and the request's generator. KV
invariant, as in process: the cache holds every committed token but the
last one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Union

import torch

from tandem.engine import ForwardItem, ModelEngine
from tandem.errors import InvalidRequestError, KVCacheExhaustedError, StaleSequenceError, UnknownSequenceError
from tandem.sampling import SamplingParams, pick_tokens
from tandem.spec.rejection import Verdict, verify


@dataclass(slots=True)
class PrefillCall:
    seq_id: str
    token_ids: list[int]
    sampling: SamplingParams


@dataclass(slots=True)
class VerifyCall:
    seq_id: str
    committed_len: int
    draft_tokens: list[int]
    draft_probs: torch.Tensor | None  # [k, vocab] or None for a deterministic draft


Call = Union[PrefillCall, VerifyCall]


@dataclass(slots=True)
class TargetSequence:
    history: list[int]
    sampling: SamplingParams
    generator: torch.Generator | None = field(default=None)


class TargetEngine:
    """Runs batches of Prefill and Verify calls through one ``ModelEngine``."""

    def __init__(self, engine: ModelEngine) -> None:
        self.engine = engine
        self.sequences: dict[str, TargetSequence] = {}

    @property
    def vocab_size(self) -> int:
        return self.engine.config.vocab_size

    @property
    def max_context(self) -> int:
        return self.engine.config.max_position_embeddings

    def call_cost(self, call: Call) -> int:
        """Tokens a call adds to the forward pass (the scheduler's budget unit)."""
        return len(call.token_ids) if isinstance(call, PrefillCall) else len(call.draft_tokens) + 1

    # ----- one batch -----------------------------------------------------
    def run_batch(self, calls: list[Call]) -> list[int | Verdict | BaseException]:
        results: list[int | Verdict | BaseException | None] = [None] * len(calls)
        items: list[ForwardItem] = []
        admitted: list[int] = []
        appends: dict[str, int] = {}
        for i, call in enumerate(calls):
            try:
                item = self._prepare(call)
            except Exception as exc:  # noqa: BLE001 - one bad call fails alone
                results[i] = exc
                continue
            if item.seq_id in appends:
                results[i] = InvalidRequestError(f"sequence {item.seq_id!r} has two calls in flight")
                continue
            # Admit while the pool has room; the rest are told to retry (RESOURCE_EXHAUSTED).
            trial = {**appends, item.seq_id: len(item.token_ids)}
            if not self.engine.kv_cache.can_append(trial):
                results[i] = KVCacheExhaustedError(
                    f"KV cache full ({self.engine.kv_cache.num_free_blocks} blocks free); retry later"
                )
                if isinstance(call, PrefillCall):
                    self.sequences.pop(call.seq_id, None)
                continue
            appends = trial
            items.append(item)
            admitted.append(i)
        if items:
            logits = self.engine.forward(items)
            for i, row in zip(admitted, logits):
                try:
                    results[i] = self._finish(calls[i], row)
                except Exception as exc:  # noqa: BLE001
                    results[i] = exc
        return results  # type: ignore[return-value]

    def _prepare(self, call: Call) -> ForwardItem:
        if isinstance(call, PrefillCall):
            if call.seq_id in self.sequences:
                self.release(call.seq_id)  # a re-prefill (rebuild) replaces the old state
            generator = None if call.sampling.is_greedy else call.sampling.make_generator()
            self.sequences[call.seq_id] = TargetSequence(list(call.token_ids), call.sampling, generator)
            return ForwardItem(call.seq_id, call.token_ids, num_logits=1)
        seq = self.sequences.get(call.seq_id)
        if seq is None:
            raise UnknownSequenceError(f"target holds no sequence {call.seq_id!r}")
        if not 1 <= call.committed_len <= len(seq.history):
            raise StaleSequenceError(
                f"sequence {call.seq_id!r}: committed_len {call.committed_len} outside 1..{len(seq.history)}"
            )
        if call.committed_len + len(call.draft_tokens) >= self.max_context:
            raise InvalidRequestError(f"sequence {call.seq_id!r} would exceed the context of {self.max_context}")
        if call.draft_probs is not None and call.draft_probs.shape[0] != len(call.draft_tokens):
            raise InvalidRequestError("draft_probs must have one distribution per draft token")
        del seq.history[call.committed_len:]
        self.engine.rollback(call.seq_id, call.committed_len - 1)
        return ForwardItem(call.seq_id, [seq.history[-1], *call.draft_tokens], num_logits=len(call.draft_tokens) + 1)

    def _finish(self, call: Call, logits: torch.Tensor) -> int | Verdict:
        seq = self.sequences[call.seq_id]
        if isinstance(call, PrefillCall):
            token = int(pick_tokens(logits, seq.sampling, seq.generator)[0])
            seq.history.append(token)
            return token
        verdict = verify(logits, call.draft_tokens, call.draft_probs, seq.sampling, seq.generator)
        self.engine.rollback(call.seq_id, call.committed_len + verdict.num_accepted)
        seq.history.extend([*call.draft_tokens[: verdict.num_accepted], verdict.next_token])
        return verdict

    # ----- bookkeeping ---------------------------------------------------
    @property
    def num_sequences(self) -> int:
        return len(self.sequences)

    def release(self, seq_id: str) -> bool:
        held = self.sequences.pop(seq_id, None) is not None
        if self.engine.kv_cache.has_sequence(seq_id):
            self.engine.release(seq_id)
        return held

    def warmup(self) -> None:
        """The engine's own warm-up (kernels, cost fit), then the Prefill and 5-token Verify paths once."""
        self.engine.warmup()
        self.run_batch([PrefillCall("__warmup__", [1, 2, 3, 4], SamplingParams())])
        self.run_batch([VerifyCall("__warmup__", 5, [1, 2, 3, 4], None)])
        self.release("__warmup__")
