"""The draft worker's state and its batched Propose step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine import ModelEngine
from tandem.errors import InvalidRequestError, StaleSequenceError, UnknownSequenceError
from tandem.rpc.wire import wire_roundtrip
from tandem.sampling import SamplingParams
from tandem.spec.draft_model import DraftModelProposer
from tandem.spec.proposal import Proposal, ProposeRequest

# The draft's sampling stream must be independent of the target's (same seed otherwise).
DRAFT_SEED_OFFSET = 0x5EED


@dataclass(slots=True)
class ProposeCall:
    seq_id: str
    committed_len: int
    new_tokens: list[int]
    k: int
    sampling: SamplingParams


class DraftEngine:
    """Per-sequence committed histories plus a batched ``DraftModelProposer``."""

    def __init__(self, engine: ModelEngine) -> None:
        self.engine = engine
        # Sampled drafts travel as compressed q; the draft samples from that same compressed q.
        self.proposer = DraftModelProposer(engine, q_transform=wire_roundtrip)
        self.histories: dict[str, list[int]] = {}
        self.generators: dict[str, torch.Generator] = {}

    @property
    def vocab_size(self) -> int:
        return self.engine.config.vocab_size

    def call_cost(self, call: ProposeCall) -> int:
        return len(call.new_tokens) + call.k

    def run_batch(self, calls: list[ProposeCall]) -> list[Proposal | BaseException]:
        results: list[Proposal | BaseException | None] = [None] * len(calls)
        requests: list[ProposeRequest] = []
        indices: list[int] = []
        seen: set[str] = set()
        for i, call in enumerate(calls):
            try:
                if call.seq_id in seen:
                    raise InvalidRequestError(f"sequence {call.seq_id!r} has two Propose calls in flight")
                requests.append(self._prepare(call))
                indices.append(i)
                seen.add(call.seq_id)
            except Exception as exc:  # noqa: BLE001 - one bad call fails alone
                results[i] = exc
        if requests:
            for i, proposal in zip(indices, self.proposer.propose(requests)):
                results[i] = proposal
        return results  # type: ignore[return-value]

    def _prepare(self, call: ProposeCall) -> ProposeRequest:
        history = self.histories.get(call.seq_id)
        if history is None:
            if call.committed_len:
                raise UnknownSequenceError(f"draft holds no sequence {call.seq_id!r}")
            history = self.histories[call.seq_id] = []
        if call.committed_len > len(history):
            raise StaleSequenceError(
                f"sequence {call.seq_id!r}: committed_len {call.committed_len} > the {len(history)} tokens held"
            )
        del history[call.committed_len:]
        history.extend(call.new_tokens)
        if not history:
            raise InvalidRequestError(f"sequence {call.seq_id!r} has no tokens to draft from")
        if call.k < 0:
            raise InvalidRequestError(f"k must be >= 0, got {call.k}")
        generator = None
        if not call.sampling.is_greedy:
            generator = self.generators.get(call.seq_id)
            if generator is None:
                seed = None if call.sampling.seed is None else call.sampling.seed + DRAFT_SEED_OFFSET
                generator = SamplingParams(1.0, seed=seed).make_generator()
                self.generators[call.seq_id] = generator
        return ProposeRequest(call.seq_id, history, call.k, call.sampling, generator)

    @property
    def num_sequences(self) -> int:
        return len(self.histories)

    def release(self, seq_id: str) -> bool:
        held = self.histories.pop(seq_id, None) is not None
        self.generators.pop(seq_id, None)
        self.proposer.release(seq_id)
        return held

    def warmup(self) -> None:
        self.engine.warmup()
        self.run_batch([ProposeCall("__warmup__", 0, [1, 2, 3, 4], 4, SamplingParams())])
        self.release("__warmup__")
