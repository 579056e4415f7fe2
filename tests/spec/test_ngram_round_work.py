"""A round's work on the coordinator does not grow with the request's history (issue 23, defect 8).

The loop runs on the coordinator's one event-loop thread for every request; a round that
re-reads the whole history (a scan for prompt lookup, packing it all for the continuation
cache) makes a long generation quadratic. Counted here, not timed: the history is a list
that counts every token read from it (by index, slice, iteration or numpy conversion), and a
round may read only a bounded number, however long the history has grown.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest

from tandem.sampling_params import SamplingParams
from tandem.spec.adaptive import CostModel
from tandem.spec.continuations import LocalContinuations
from tandem.spec.loop import SpeculationLoop
from tandem.spec.ngram import NgramIndex
from tandem.spec.options import SpecOptions
from tandem.spec.request import RequestState, StopConditions
from tandem.spec.shared_cache import SharedContinuations
from tests.spec.test_loop import FakeTarget, target_only

# Reads a round may make, whatever the history's length: the index's new tokens x n-gram sizes,
# the suffix probes, the continuations, and the cache's tail (its context, the runs completed).
ROUND_READS_BOUND = 400


class CountingHistory(list):
    """A list that counts the tokens read from it (numpy's conversion included)."""

    reads = 0

    def __getitem__(self, i: Any) -> Any:
        got = list.__getitem__(self, i)
        self.reads += len(got) if isinstance(i, slice) else 1
        return got

    def __iter__(self):
        for token in list.__iter__(self):
            self.reads += 1
            yield token

    def __array__(self, dtype=None, copy=None):
        self.reads += len(self)
        return np.array(list(list.__iter__(self)), dtype=dtype)


def reads_per_round(options: SpecOptions, prompt: list[int], n: int, with_cache: bool) -> list[tuple[int, int]]:
    """(history length, tokens read) for every round of one greedy request of ``n`` tokens."""
    state = RequestState(prompt, SamplingParams(), StopConditions(n))
    history = CountingHistory(state.history)
    state.history = history

    async def go() -> list[tuple[int, int]]:
        cache = SharedContinuations("fake-tokenizer", None) if with_cache else None
        loop = SpeculationLoop(state, "s", options, FakeTarget(), None, CostModel(), 100_000, cache=cache)
        rounds = []
        async for _ in loop.run():
            rounds.append((len(history), history.reads))
            history.reads = 0
        return rounds

    rounds = asyncio.run(go())
    assert state.generated == target_only(prompt, n)  # still the target's own output
    return rounds


@pytest.mark.parametrize("tree", ["off", "on"])
def test_a_rounds_reads_of_the_history_stay_bounded_as_it_grows(tree):
    prompt = [3, 1, 4, 1, 5] * 60  # 300 prompt tokens, then 1,500 generated
    rounds = reads_per_round(SpecOptions("ngram", 4, adaptive_k=False, tree=tree), prompt, 1500, with_cache=True)
    late = [reads for length, reads in rounds[1:] if length > 1200]  # (the prefill round indexes the prompt once)
    assert len(late) > 50
    assert max(late) <= ROUND_READS_BOUND, f"a round read {max(late)} tokens of a history of over 1,200"


def test_learn_reads_the_new_tokens_and_the_context_they_need_not_the_whole_sequence():
    tokens = list(range(1000, 4000))
    for cache in (LocalContinuations("ns"), SharedContinuations("ns", None)):  # max_n 8, runs of 16
        learned = 0
        for end in range(100, 3001, 100):
            history = CountingHistory(tokens[:end])
            cache.learn(history, learned)
            assert history.reads <= 100 + 16 + 8, f"learning 100 new tokens of {end} read {history.reads}"
            learned = end


def test_the_index_reads_each_new_token_a_bounded_number_of_times():
    history = CountingHistory([7, 8, 9])
    index = NgramIndex()
    index.lookup_match(history, 4, 1, 4)
    for _ in range(2000):
        list.extend(history, [len(history) % 11, len(history) % 5])
        history.reads = 0
        index.lookup_match(history, 4, 1, 4)
        index.lookup_continuations(history, 4, 1, 4, 3)
        # ~70: per new token itself, its four n-grams and their previous followers; per lookup the
        # last indexed token, the four suffixes and the continuations read
        assert history.reads <= 100, f"{history.reads} tokens read at {len(history)} tokens of history"
