"""The loop's choice of k: drafting must repay feeding a draft that was left out."""

from __future__ import annotations

from tandem.sampling_params import SamplingParams
from tandem.spec.adaptive import CostModel
from tandem.spec.loop import SpeculationLoop
from tandem.spec.options import SpecOptions
from tandem.spec.request import RequestState, StopConditions
from tandem.spec.transport import FittedCost


class Worker:
    """Only what k is chosen from: the worker's fitted forward cost and how many streams share it."""

    def __init__(self, base_s: float, per_token_s: float, streams: int) -> None:
        self.cost, self.streams = FittedCost(base_s, per_token_s), streams
        self.cached = 0  # a draft's: leading prompt tokens its prefix cache holds

    def fitted_cost(self) -> FittedCost:
        return self.cost

    def cached_prefix(self, token_ids) -> int:
        return min(self.cached, len(token_ids))

    def sequence_room(self) -> int | None:
        return None


def loop_with(streams: int, prompt_len: int = 300, max_new: int = 100) -> SpeculationLoop:
    state = RequestState(list(range(1, prompt_len + 1)), SamplingParams(), StopConditions(max_new))
    # Costs measured on the benchmark machine: Qwen 1.5B target, int8 Qwen 0.5B draft.
    target, draft = Worker(0.13, 0.006, streams), Worker(0.016, 0.005, streams)
    loop = SpeculationLoop(state, "s", SpecOptions("draft", 4), target, draft, CostModel(), max_context=32768)
    state.tracker.accepted, state.tracker.rejected = 30.0, 3.0  # a request whose drafts mostly land
    return loop


def test_a_lone_stream_drafts_from_its_first_round():
    assert loop_with(streams=1)._choose_k(after_tokens=0) > 0


def test_under_load_a_stream_does_not_start_a_draft_that_cannot_repay_its_prefill():
    busy = loop_with(streams=3, max_new=50)
    assert busy._choose_k(after_tokens=0) == 0  # 300 prompt tokens to feed, charged to 3 streams
    busy.draft.sent = list(busy.state.history)  # the draft already holds the sequence
    assert busy._choose_k(after_tokens=0) > 0


def test_near_its_end_a_stream_under_load_does_not_restart_drafting():
    ending = loop_with(streams=2, max_new=3)
    assert ending._choose_k(after_tokens=0) == 0
    ending.draft.sent = list(ending.state.history)
    assert ending._choose_k(after_tokens=0) > 0


# ----- a lone stream's draft and a long prompt: the ski rental of _draft_waits ---------------------------
# Prices measured on the benchmark machine (AMD EPYC Zen 5, 2 cores, bf16): a Qwen 1.5B target step
# 87 ms, a Qwen 0.5B draft step 19 ms, a draft prompt token 1.6 ms.
TARGET_STEP_S, DRAFT_STEP_S, DRAFT_PROMPT_TOKEN_S = 0.087, 0.019, 0.0016


def lone_loop(prompt_len: int, method: str = "hybrid", pipelined: bool = False,
              prompt_token_s: float = DRAFT_PROMPT_TOKEN_S, max_new: int = 128, waits: bool = True) -> SpeculationLoop:
    state = RequestState(list(range(1, prompt_len + 1)), SamplingParams(), StopConditions(max_new))
    target, draft = Worker(TARGET_STEP_S, 0.0027, 1), Worker(DRAFT_STEP_S, 0.0, 1)
    draft.cost = FittedCost(DRAFT_STEP_S, 0.0, prompt_token_s=prompt_token_s)
    loop = SpeculationLoop(state, "s", SpecOptions(method, 4, pipelined=pipelined, draft_waits=waits), target, draft,
                           CostModel(), max_context=32768)
    state.tracker.accepted, state.tracker.rejected = 30.0, 10.0  # drafts land three times in four
    state.commit([7])  # the target's first token, from its prefill
    return loop


def test_a_lone_stream_reads_a_short_prompt_into_its_draft_at_once():
    assert not lone_loop(prompt_len=150)._draft_waits()


def test_a_lone_stream_waits_with_a_long_prompt_until_its_answer_has_grown_enough_to_repay_it():
    loop = lone_loop(prompt_len=800)  # 1.3 s to read against ~30 ms saved per drafted token
    assert loop._draft_waits()
    waited = 0
    while loop._draft_waits():  # each waiting round commits a token by itself (the worst case: no n-gram help)
        loop.state.commit([7])
        waited += 1
    assert 16 < waited < 128  # a 19-token answer never pays the read; a 128-token one does, before its end
    loop.draft.sent = list(loop.state.history)  # read: the draft holds the sequence now
    assert not loop._draft_waits()


def test_a_waiting_round_proposes_from_the_text_and_never_asks_the_draft():
    loop = lone_loop(prompt_len=800)
    loop._draft_waiting = loop._draft_waits()
    assert loop._drafter is None and loop._round_costs().draft_base_s < 1e-6  # the round is priced as a lookup
    assert loop._choose_k(after_tokens=0) > 0  # n-gram rounds speculate meanwhile


def test_the_draft_is_not_kept_waiting_where_its_read_is_hidden_or_unpriced():
    assert not lone_loop(prompt_len=800, pipelined=True)._draft_waits()  # read during the target's prefill
    assert not lone_loop(prompt_len=800, prompt_token_s=0.0)._draft_waits()  # no prompt measured yet
    assert not lone_loop(prompt_len=800, waits=False)._draft_waits()  # spec_bench's eager methods


def test_a_draft_waits_near_the_end_and_where_only_the_targets_cache_held_the_prompt():
    near_the_end = lone_loop(prompt_len=800, max_new=3)
    assert near_the_end._draft_waits()  # two tokens left can never repay 800 read
    cached = lone_loop(prompt_len=800)
    cached.state.stats.prompt_tokens_reused = 784  # the target's cache held the prompt; the draft's may not
    assert cached._draft_waits()


def test_a_prompt_the_drafts_own_cache_holds_is_read_at_once():
    """One long system prompt before every question: the draft reads only what its cache lacks."""
    loop = lone_loop(prompt_len=800)
    loop.draft.channel.cached = 768  # 48 blocks of the system prompt; 32 prompt tokens and the first token to read
    assert loop.draft.unread(loop.state.history) == 801 - 768
    assert not loop._draft_waits()
    loop.draft.channel.cached = 400  # half of it: still 400 to read, too dear for an answer not yet begun
    assert loop._draft_waits()


def test_the_drafts_cache_counts_only_for_a_sequence_it_does_not_hold_yet():
    """A draft that holds the sequence goes on from its own KV: a catch-up after rounds at k = 0 is priced
    whole, whatever its cache holds (it starts on cached blocks only as a new sequence)."""
    loop = lone_loop(prompt_len=800)
    loop.draft.channel.cached = 784
    loop.draft.sent = list(loop.state.history[:10])  # it read the first 10 tokens, then fell behind
    assert loop.draft.unread(loop.state.history) == 791
    loop.draft.sent = []
    asked: list[int] = []
    loop.draft.channel.cached_prefix = lambda ids: asked.append(len(ids)) or 784
    assert loop.draft.unread(loop.state.history) == 801 - 784
    assert asked == [799]  # the prompt less its last token, which a draft always computes (prefix_limit)


def test_under_load_a_cached_prompt_does_not_hold_a_stream_at_k_zero():
    busy = loop_with(streams=3, max_new=50)
    assert busy._choose_k(after_tokens=0) == 0  # 300 prompt tokens to feed, charged to 3 streams
    busy.draft.channel.cached = 288  # its prefix cache holds all but the last block
    assert busy._choose_k(after_tokens=0) > 0


def test_waiting_rounds_leave_the_rate_the_draft_is_valued_at_alone():
    """While the draft waits, n-gram guesses (often wrong) verify: their misses must not talk the request
    out of its draft (measured before this rule: a HumanEval prompt's rate fell from 0.75 to 0.3 in 20
    waiting rounds, and it never drafted)."""
    from tandem.spec.proposers import NGRAM, Proposal

    loop = lone_loop(prompt_len=800)
    loop._draft_waiting = True
    rate = loop.state.tracker.rate
    for _ in range(20):
        loop._record(4, 4, 0, Proposal(len(loop.state.history), [1, 2, 3, 4], source=NGRAM), 4, 0)
    assert loop.state.tracker.rate == rate and loop.state.stats.rounds == 20
    loop._draft_waiting = False
    loop._record(4, 4, 0, Proposal(len(loop.state.history), [1, 2, 3, 4], source=NGRAM), 4, 0)
    assert loop.state.tracker.rate < rate  # a round that is not waiting counts as before
