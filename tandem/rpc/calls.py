"""Batcher calls that every worker role understands."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class ReleaseCall:
    """Forget a sequence and free its KV. Runs on the model thread like any call; costs no tokens.

    Its result is ``True`` when the worker held the sequence. Within one batch, a
    release applies in queue order relative to a computing call of the same
    sequence: after it when it was queued after it, before it otherwise.
    """

    seq_id: str
