"""Heads rounds ask for the next tree only while asking measures faster than not (tandem.spec.heads_payoff).

The policy alone, on given rounds; then the loop against a fake target whose heads are useless or
perfect, on a fake clock that the target advances by what each round costs (drafting included), so
the choice follows the costs and not this machine's timing.
"""

from __future__ import annotations

import asyncio
import types

import pytest

import tandem.spec.loop as loop_module
from tandem.sampling_params import SamplingParams
from tandem.spec.adaptive import CostModel
from tandem.spec.heads_payoff import HEADS, PLAIN, PROBE_ROUNDS, REPROBE_EVERY, WARMUP_ROUNDS, HeadsPayoff
from tandem.spec.loop import SpeculationLoop
from tandem.spec.options import SpecOptions
from tandem.spec.request import RequestState, StopConditions
from tandem.spec.transport import FittedCost, Prefilled, TreeProposal, Verified
from tests.spec.test_loop import FakeDraft, target_next, target_only


def rounds(payoff: HeadsPayoff, n: int, rate: dict[str, float]) -> list[bool]:
    """n rounds, each committing ``rate[way]`` tokens in one second; whether each asked."""
    asked = []
    for _ in range(n):
        asked.append(payoff.ask())
        payoff.observe(int(rate[HEADS if asked[-1] else PLAIN]), 1.0)
    return asked


def test_starts_with_the_heads_probes_without_them_and_keeps_the_faster_way():
    good = HeadsPayoff()
    asked = rounds(good, WARMUP_ROUNDS + 1 + PROBE_ROUNDS + 1 + REPROBE_EVERY, {HEADS: 3, PLAIN: 1})
    assert asked[:WARMUP_ROUNDS] == [True] * WARMUP_ROUNDS
    # the probe: one switching round (counted for neither way), then PROBE_ROUNDS measured ones
    assert asked[WARMUP_ROUNDS:WARMUP_ROUNDS + 1 + PROBE_ROUNDS] == [False] * (1 + PROBE_ROUNDS)
    assert all(asked[WARMUP_ROUNDS + 1 + PROBE_ROUNDS:])  # back to the heads, the faster way
    assert good.measured == {HEADS: WARMUP_ROUNDS + REPROBE_EVERY, PLAIN: PROBE_ROUNDS}

    bad = HeadsPayoff()
    asked = rounds(bad, 200, {HEADS: 1, PLAIN: 2})
    assert not any(asked[WARMUP_ROUNDS:WARMUP_ROUNDS + 1 + PROBE_ROUNDS + REPROBE_EVERY])  # plain after the probe
    assert 0 < sum(asked[WARMUP_ROUNDS:]) <= (200 // REPROBE_EVERY + 1) * (PROBE_ROUNDS + 1)  # only the re-probes
    assert bad.way == PLAIN or bad.probing


def test_a_ways_rate_is_its_tokens_over_its_seconds():
    """Tokens over seconds (decayed sums), not the mean of each round's rate: a round of 1 token in 0.1 s
    (a rate of 10) after one of 4 tokens in 1 s must not read as 5.8 tokens a second."""
    payoff = HeadsPayoff()
    payoff.observe(4, 1.0)
    payoff.observe(1, 0.1)
    assert payoff.rate[HEADS] == pytest.approx((0.7 * 4 + 1) / (0.7 * 1.0 + 0.1))


def test_the_faster_way_follows_a_change_in_the_text():
    payoff = HeadsPayoff()
    rounds(payoff, 50, {HEADS: 1, PLAIN: 2})  # heads that do not pay here...
    assert payoff.rate[PLAIN] > payoff.rate[HEADS]
    asked = rounds(payoff, 3 * REPROBE_EVERY, {HEADS: 5, PLAIN: 2})  # ... and then do: a re-probe finds it
    assert all(asked[-REPROBE_EVERY // 2:])


def test_switching_rounds_and_empty_rounds_are_counted_for_neither_way():
    payoff = HeadsPayoff()
    payoff.observe(2, 0.0)  # no wall time: nothing learned
    assert payoff.measured == {HEADS: 0, PLAIN: 0}
    rounds(payoff, WARMUP_ROUNDS, {HEADS: 2, PLAIN: 1})
    assert not payoff.ask()
    payoff.observe(1, 1.0)  # the first plain round verified the heads' last tree: not plain's
    assert payoff.measured == {HEADS: WARMUP_ROUNDS, PLAIN: 0}
    payoff.observe(3, 9.0, catching_up=True)  # a hybrid round whose draft read the prompt first: not its rate
    assert payoff.measured == {HEADS: WARMUP_ROUNDS, PLAIN: 0} and PLAIN not in payoff.rate
    payoff.observe(3, 1.0)
    assert payoff.rate[PLAIN] == 3.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now


class HeadsTarget:
    """A target with heads: a Verify that asks (``propose`` > 0) also drafts, at ``draft_cost`` more.

    ``good``: the heads propose the target's next four tokens; else tokens it never takes.
    """

    def __init__(self, clock: Clock, good: bool, draft_cost: float) -> None:
        self.clock, self.good, self.draft_cost = clock, good, draft_cost
        self.histories: dict[str, list[int]] = {}
        self.with_heads: dict[str, bool] = {}  # per sequence: its Prefill asked (a worker's rule)
        self.asked: list[bool] = []

    streams = 1

    def fitted_cost(self) -> FittedCost | None:
        return FittedCost(1.0, 0.01)

    def _tree(self, history: list[int], propose: int) -> TreeProposal | None:
        if not propose:
            return None
        self.clock.now += self.draft_cost
        drafted: list[int] = []
        for _ in range(min(propose, 4)):
            drafted.append(target_next(history + drafted) if self.good else 10_000)
        return TreeProposal(drafted, list(range(-1, len(drafted) - 1)))

    async def prefill(self, seq_id, token_ids, sampling, prompt_len=0, propose=0, wait_for_room_s=0.0):
        await asyncio.sleep(0)
        token = target_next(list(token_ids))
        self.histories[seq_id] = [*token_ids, token]
        self.with_heads[seq_id] = propose > 0
        self.clock.now += 1.0
        return Prefilled(token, self._tree(self.histories[seq_id], propose))

    async def verify(self, seq_id, committed_len, draft_tokens, draft_probs, draft_parents=(), propose=0):
        await asyncio.sleep(0)
        history = self.histories[seq_id]
        assert committed_len == len(history)
        assert not propose or self.with_heads[seq_id], "a worker drafts only for sequences whose Prefill asked"
        self.clock.now += 1.0 + 0.01 * len(draft_tokens)  # one step, a little more per node
        kept = []
        parent = -1
        for node, (token, p) in enumerate(zip(draft_tokens, draft_parents or range(-1, len(draft_tokens) - 1))):
            if p == parent and token == target_next(history):
                history.append(token)
                kept.append(node)
                parent = node
        nxt = target_next(history)
        history.append(nxt)
        self.asked.append(propose > 0)
        return Verified(kept, nxt, self._tree(history, propose))

    async def release(self, seq_id):
        self.histories.pop(seq_id, None)


def run_heads(monkeypatch, good: bool, adaptive: bool = True, n: int = 300) -> tuple[RequestState, HeadsTarget]:
    clock = Clock()
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    target = HeadsTarget(clock, good, draft_cost=0.5)
    state = RequestState([3, 1, 4, 1, 5], SamplingParams(), StopConditions(n))
    options = SpecOptions("eagle", 4, adaptive_k=adaptive)
    asyncio.run(SpeculationLoop(state, "s", options, target, None, CostModel(), 10_000).run_to_end())
    return state, target


@pytest.mark.parametrize("good", [True, False])
def test_the_loop_asks_the_heads_while_they_pay_and_output_is_the_targets_either_way(monkeypatch, good):
    state, target = run_heads(monkeypatch, good)
    assert state.generated == target_only([3, 1, 4, 1, 5], 300)
    share = sum(target.asked) / len(target.asked)
    if good:  # 5 tokens for 1.54 units against 1 for 1: asked but for the probes
        assert share > 0.8, share
    else:  # 1 token for 1.54 units against 1 for 1: not asked but for the warm-up and re-probes
        assert share < 0.3, share


def test_a_fixed_k_request_always_asks(monkeypatch):
    state, target = run_heads(monkeypatch, good=False, adaptive=False, n=60)
    assert state.generated == target_only([3, 1, 4, 1, 5], 60)
    assert all(target.asked[:-2])  # (the last two rounds have no room left to ask for)


def run_heads_and_draft(monkeypatch, good_heads: bool, pipelined: bool = False, heads_cost: float = 0.5,
                        n: int = 300) -> tuple[RequestState, HeadsTarget, FakeDraft]:
    """``auto`` with heads and a draft model both there: hybrid rounds while the heads do not pay. The draft
    (right 3 times in 4) costs nothing on the clock, so its rounds commit about 3 tokens a step."""
    clock = Clock()
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    target, draft = HeadsTarget(clock, good_heads, draft_cost=heads_cost), FakeDraft()
    state = RequestState([3, 1, 4, 1, 5], SamplingParams(), StopConditions(n))
    options = SpecOptions("eagle", 4, pipelined=pipelined, heads_fallback="hybrid")
    asyncio.run(SpeculationLoop(state, "s", options, target, draft, CostModel(), 10_000).run_to_end())
    return state, target, draft


@pytest.mark.parametrize("pipelined", [False, True])
def test_heads_that_do_not_pay_give_their_rounds_to_the_draft_model(monkeypatch, pipelined):
    state, target, draft = run_heads_and_draft(monkeypatch, good_heads=False, pipelined=pipelined)
    assert state.generated == target_only([3, 1, 4, 1, 5], 300)
    assert sum(target.asked) / len(target.asked) < 0.3  # the heads: the warm-up and the re-probes
    assert draft.calls > 30 and state.stats.accepted > 150  # the draft's rounds carried the request
    plain, _ = run_heads(monkeypatch, good=False)  # the same heads without a draft: plain decoding between
    assert state.stats.rounds < 0.6 * plain.stats.rounds


def test_heads_that_pay_keep_their_rounds_beside_a_draft_model(monkeypatch):
    state, target, draft = run_heads_and_draft(monkeypatch, good_heads=True, heads_cost=0.1)  # 5 tokens a step
    assert state.generated == target_only([3, 1, 4, 1, 5], 300)
    assert sum(target.asked) / len(target.asked) > 0.8


def test_only_auto_with_both_runs_hybrid_rounds_between_heads_rounds():
    from tandem.errors import InvalidRequestError
    from tandem.spec.options import heads_fallback

    assert heads_fallback("auto", "eagle", has_draft=True) == "hybrid"
    assert heads_fallback("auto", "eagle", has_draft=False) == "plain"
    assert heads_fallback("eagle", "eagle", has_draft=True) == "plain"  # named heads: those heads, nothing else
    assert heads_fallback("auto", "hybrid", has_draft=True) == "plain"
    assert SpecOptions("medusa", 4, heads_fallback="hybrid").uses_draft
    assert not SpecOptions("medusa", 4, adaptive_k=False, heads_fallback="hybrid").uses_draft  # asks every round
    with pytest.raises(InvalidRequestError, match="heads fallback"):
        SpecOptions("draft", 4, heads_fallback="hybrid")


def test_a_request_starts_on_the_way_the_requests_before_it_found_faster(monkeypatch):
    """Heads that lose to the draft on the first request are not asked for the next one's first rounds."""
    from tandem.spec.heads_payoff import HeadsVerdicts

    verdicts = HeadsVerdicts()
    assert verdicts.start("hybrid") == HEADS  # nothing settled yet: the heads first
    clock = Clock()
    monkeypatch.setattr(loop_module, "time", types.SimpleNamespace(perf_counter=clock.perf_counter))
    options = SpecOptions("eagle", 4, heads_fallback="hybrid")
    asked = []
    for _ in range(2):
        target = HeadsTarget(clock, good=False, draft_cost=0.5)
        state = RequestState([3, 1, 4, 1, 5], SamplingParams(), StopConditions(60))
        loop = SpeculationLoop(state, "s", options, target, FakeDraft(), CostModel(), 10_000, heads_verdicts=verdicts)
        asyncio.run(loop.run_to_end())
        assert state.generated == target_only([3, 1, 4, 1, 5], 60)
        asked.append(target.asked)
    assert asked[0][:WARMUP_ROUNDS] == [True] * WARMUP_ROUNDS
    assert verdicts.start("hybrid") == PLAIN and verdicts.start("plain") == HEADS  # per fallback
    assert not any(asked[1][:WARMUP_ROUNDS])  # the second request drafted with the draft model from the start
    assert True in asked[1]  # and still probed its heads


def test_verdicts_follow_the_recent_requests():
    from tandem.spec.heads_payoff import HeadsVerdicts

    verdicts = HeadsVerdicts()
    verdicts.record("plain", PLAIN)
    assert verdicts.start("plain") == PLAIN
    verdicts.record("plain", HEADS)
    assert verdicts.start("plain") == HEADS  # one verdict each way: the newest weighs more
