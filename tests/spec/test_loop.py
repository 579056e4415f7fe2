"""The one speculation loop against fake transports: exact output, stop conditions, pipelining, releases.

The fake target is a deterministic function of the history and keeps its own
history per sequence exactly as a target worker does (it checks every
``committed_len`` it is sent); the fake draft agrees with it most of the time
and holds its history as a draft worker does (keep ``committed_len`` tokens,
append the new ones). So the loop's bookkeeping is checked by both sides on
every call, and greedy output must equal the target's own sequence.
"""

from __future__ import annotations

import asyncio
import random
import sys

import pytest

from tandem.sampling_params import SamplingParams
from tandem.spec.adaptive import EXPLORE_EVERY, AcceptanceTracker, CostModel, MatchRates
from tandem.spec.loop import SpeculationLoop
from tandem.spec.options import SpecOptions
from tandem.spec.proposers import NGRAM, common_prefix_len
from tandem.spec.request import RequestState, StopConditions
from tandem.spec.transport import Drafted, FittedCost, Prefilled, Verified
from tandem.spec.tree import children_of

VOCAB = 50


def target_next(history: list[int]) -> int:
    """The target's greedy choice: a fixed, history-dependent token that repeats itself now and then."""
    if len(history) % 7 == 0:
        return history[-3] if len(history) >= 3 else 1
    return (sum(history[-4:]) * 31 + len(history)) % VOCAB


def draft_next(history: list[int]) -> int:
    """Agrees with the target except at every fourth position."""
    good = target_next(history)
    return good if len(history) % 4 else (good + 1) % VOCAB


def target_only(prompt: list[int], n: int, stop_ids: frozenset[int] = frozenset()) -> list[int]:
    history = list(prompt)
    out: list[int] = []
    while len(out) < n:
        token = target_next(history)
        history.append(token)
        out.append(token)
        if token in stop_ids:
            break
    return out


class FakeTarget:
    def __init__(self) -> None:
        self.histories: dict[str, list[int]] = {}
        self.released: list[str] = []
        self.verified_tokens = 0
        self.trees = 0  # Verify calls that carried a token tree

    streams = 1

    def fitted_cost(self) -> FittedCost | None:
        return FittedCost(0.1, 0.001)

    async def prefill(self, seq_id, token_ids, sampling, prompt_len=0, propose=0, wait_for_room_s=0.0):
        await asyncio.sleep(0)
        if prompt_len:  # a rebuild: the whole history, nothing new
            self.histories[seq_id] = list(token_ids)
            return Prefilled(token_ids[-1])
        token = target_next(list(token_ids))
        self.histories[seq_id] = [*token_ids, token]
        return Prefilled(token)

    async def verify(self, seq_id, committed_len, draft_tokens, draft_probs, draft_parents=(), propose=0):
        await asyncio.sleep(0)
        history = self.histories[seq_id]
        assert committed_len == len(history), "the loop must verify against the whole committed history"
        assert not draft_probs  # greedy: deterministic drafts
        self.verified_tokens += len(draft_tokens)
        self.trees += bool(draft_parents)
        children = children_of(draft_parents or range(-1, len(draft_tokens) - 1))
        kept, node = [], -1
        while (node := next((c for c in children.get(node, []) if draft_tokens[c] == target_next(history)),
                            None)) is not None:
            history.append(draft_tokens[node])
            kept.append(node)
        nxt = target_next(history)
        history.append(nxt)
        return Verified(kept, nxt)

    async def release(self, seq_id):
        self.released.append(seq_id)
        self.histories.pop(seq_id, None)


class FakeDraft:
    def __init__(self) -> None:
        self.histories: dict[str, list[int]] = {}
        self.calls = 0
        self.released: list[str] = []
        self.prompt_lens: set[int] = set()
        self.cached_prompts: list[list[int]] = []  # the prompts it read, as its prefix cache would hold them
        self.stops: list[float] = []  # each Propose's stop_below

    def fitted_cost(self) -> FittedCost | None:
        return FittedCost(0.01, 0.001)

    async def propose(self, seq_id, committed_len, new_tokens, k, sampling, alternatives=0, prompt_len=0,
                      verified_len=0, stop_below=0.0):
        await asyncio.sleep(0)
        self.calls += 1
        self.prompt_lens.add(prompt_len)
        held = self.histories.setdefault(seq_id, [])
        assert committed_len <= len(held), "committed_len beyond what the draft holds"
        history = held[:committed_len] + list(new_tokens)
        self.histories[seq_id] = history
        self.stops.append(stop_below)
        drafted: list[int] = []
        for _ in range(k):
            drafted.append(draft_next(history + drafted))
            if stop_below > 0 and len(history + drafted) % 4 == 0:
                break  # unsure before a position where its guess is wrong, as a real draft mostly is
        # Next-best: the token one below the drafted one, which is the target's where the draft errs.
        others = [[(t - 1 - i) % VOCAB for i in range(alternatives)] for t in drafted] if alternatives else []
        if committed_len == 0 and k and prompt_len:
            self.cached_prompts.append(list(new_tokens[:prompt_len]))  # as a draft worker offers a read prompt
        return Drafted(drafted, [], others)

    def cached_prefix(self, token_ids) -> int:
        """Whole 16-token blocks of the longest prompt read before that ``token_ids`` begins with."""
        held = max((common_prefix_len(p, token_ids) for p in self.cached_prompts), default=0)
        return held // 16 * 16

    def sequence_room(self) -> int | None:
        return None  # a pool without bound

    async def release(self, seq_id):
        self.released.append(seq_id)


def run(options: SpecOptions, prompt=(3, 1, 4, 1, 5), n=40, stop_ids=frozenset(), with_draft=True):
    target, draft = FakeTarget(), FakeDraft()
    state = RequestState(list(prompt), SamplingParams(), StopConditions(n, frozenset(stop_ids)))
    loop = SpeculationLoop(state, "s", options, target, draft if with_draft else None, CostModel(), 10_000)
    asyncio.run(loop.run_to_end())
    return state, target, draft


@pytest.mark.parametrize("method", ["none", "draft", "ngram", "hybrid"])
@pytest.mark.parametrize("pipelined", [False, True])
def test_greedy_output_equals_target_alone(method, pipelined):
    k = 0 if method == "none" else 4
    state, target, draft = run(SpecOptions(method, k, adaptive_k=False, pipelined=pipelined))
    assert state.generated == target_only([3, 1, 4, 1, 5], 40)
    assert state.finish_reason == "length"
    assert target.released == ["s"]
    if method in ("draft", "hybrid"):
        assert state.stats.drafted > 0 and 0 < state.stats.accepted < state.stats.drafted  # rejections happened
        assert draft.released == ["s"]
        assert draft.prompt_lens == {5}  # every Propose says where the prompt ends
    if method == "none":
        assert state.stats.drafted == 0 and state.stats.rounds == 39 and draft.calls == 0
    if method == "ngram":
        assert draft.calls == 0 and state.stats.ngram_rounds == state.stats.spec_rounds > 0


def test_hybrid_takes_long_ngram_matches_and_the_draft_otherwise(monkeypatch):
    # A target that writes freely for 30 tokens, then repeats itself with period 10: n-gram lookup
    # wins once the text repeats, the draft model drafts before.
    free = target_next
    monkeypatch.setattr(sys.modules[__name__], "target_next", lambda h: free(h) if len(h) < 30 else h[-10])
    state, _, draft = run(SpecOptions("hybrid", 4, adaptive_k=False, hybrid_min_match=3), n=80)
    assert state.generated == target_only([3, 1, 4, 1, 5], 80)
    assert 0 < state.stats.ngram_rounds < state.stats.spec_rounds
    assert draft.calls > 0


def test_pipelining_reuses_drafts_made_during_verification():
    unpipelined, _, d1 = run(SpecOptions("draft", 3, adaptive_k=False, pipelined=False))
    pipelined, _, d2 = run(SpecOptions("draft", 3, adaptive_k=False, pipelined=True))
    assert pipelined.generated == unpipelined.generated
    # every round of the unpipelined run waits for one Propose; the pipelined run also drafts ahead
    assert d1.calls == unpipelined.stats.spec_rounds


def test_stop_token_inside_an_accepted_run_cuts_there():
    expected = target_only([3, 1, 4, 1, 5], 40)
    stop = expected[9]
    cut = expected.index(stop) + 1
    state, _, _ = run(SpecOptions("draft", 4, adaptive_k=False), stop_ids=frozenset({stop}))
    assert state.generated == expected[:cut] and state.finish_reason == "stop"


def test_length_limit_inside_a_run_and_k_never_exceeds_the_room():
    state, target, _ = run(SpecOptions("draft", 8, adaptive_k=False), n=5)
    assert state.generated == target_only([3, 1, 4, 1, 5], 5)
    # 1 token from the prefill, 4 left: a round never drafts more than the room minus the target's own token
    assert target.verified_tokens <= 3 * state.stats.rounds


def test_adaptive_k_drafts_when_cheap_and_stops_when_drafts_are_always_wrong(monkeypatch):
    state, _, _ = run(SpecOptions("draft", 6))
    assert state.stats.drafted > 0 and state.generated == target_only([3, 1, 4, 1, 5], 40)
    monkeypatch.setattr(sys.modules[__name__], "draft_next", lambda h: (target_next(h) + 1) % VOCAB)
    bad, _, _ = run(SpecOptions("draft", 6), n=80)
    assert bad.generated == target_only([3, 1, 4, 1, 5], 80)
    assert bad.stats.k_counts[0] > bad.stats.rounds // 2  # it learned to stop drafting


def test_a_request_held_at_k_zero_still_explores_and_drafts_again_when_the_draft_turns_right(monkeypatch):
    """The draft is wrong for the first 60 tokens, then right: k falls to 0, and must come back.

    Without exploring rounds a request at k = 0 never measures its draft again (its rate only moves
    when it drafts), and the 140 tokens the draft would guess are decoded one by one."""
    prompt = [3, 1, 4, 1, 5]
    turn = len(prompt) + 60
    monkeypatch.setattr(sys.modules[__name__], "draft_next",
                        lambda h: target_next(h) if len(h) >= turn else (target_next(h) + 1) % VOCAB)
    state, _, _ = run(SpecOptions("draft", 4), prompt=prompt, n=200)
    assert state.generated == target_only(prompt, 200)
    assert state.stats.k_counts[0] > 0  # the wrong stretch pushed it to plain decoding
    assert state.stats.accepted > 70  # and it drafted most of the right stretch again
    assert state.stats.rounds < 140


class PricedPromptDraft(FakeDraft):
    """A draft worker that has measured what a prompt token costs it (2 ms), and records what each call read."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[tuple[int, int]] = []  # (committed_len, new tokens) per Propose

    def fitted_cost(self) -> FittedCost | None:
        return FittedCost(0.01, 0.001, prompt_token_s=0.002)

    async def propose(self, seq_id, committed_len, new_tokens, k, sampling, alternatives=0, prompt_len=0,
                      verified_len=0, stop_below=0.0):
        self.reads.append((committed_len, len(new_tokens)))
        return await super().propose(seq_id, committed_len, new_tokens, k, sampling, alternatives, prompt_len)


@pytest.mark.parametrize("method", ["draft", "hybrid"])
def test_a_long_prompt_waits_for_its_draft_until_the_answer_repays_the_read(method):
    """600 prompt tokens cost the draft 1.2 s to read, about 20 drafted tokens' savings: the first rounds
    go without it (n-gram rounds), then it reads the prompt and what was generated in one call."""
    prompt = [(i * 7) % VOCAB for i in range(600)]
    target, draft = FakeTarget(), PricedPromptDraft()
    state = RequestState(list(prompt), SamplingParams(), StopConditions(80))
    loop = SpeculationLoop(state, "s", SpecOptions(method, 4), target, draft, CostModel(), 10_000)
    asyncio.run(loop.run_to_end())
    assert state.generated == target_only(prompt, 80)
    assert state.stats.draft_wait_rounds > 5
    first_read, later = draft.reads[0], draft.reads[1:]
    assert first_read[0] == 0 and first_read[1] > 600 + state.stats.draft_wait_rounds  # the prompt and the answer
    assert all(new < 10 for _, new in later)  # then it kept up, round by round
    assert state.stats.accepted > 20

    short = RequestState(prompt[:40], SamplingParams(), StopConditions(80))
    asyncio.run(SpeculationLoop(short, "s", SpecOptions(method, 4), FakeTarget(), PricedPromptDraft(), CostModel(),
                                10_000).run_to_end())
    assert short.stats.draft_wait_rounds == 0  # a short prompt is read at once


def test_a_draft_is_not_made_to_read_a_long_prompt_while_lookups_copy_the_answer_from_it(monkeypatch):
    """A rag answer quoting its 600-token prompt: each lookup round copies a run of it, so the tokens come faster
    than drafting would make them, and the draft never reads the prompt. Priced against plain steps, two such
    rounds' tokens made it read (an 805-token Spec-Bench rag prompt: decode 19 s where waiting took 7)."""
    rng = random.Random(0)
    prompt = [rng.randrange(VOCAB) for _ in range(600)]
    monkeypatch.setattr(sys.modules[__name__], "target_next", lambda h: prompt[100 + len(h) - len(prompt)])
    for method in ("draft", "hybrid"):
        target, draft = FakeTarget(), PricedPromptDraft()
        state = RequestState(list(prompt), SamplingParams(), StopConditions(80))
        asyncio.run(SpeculationLoop(state, "s", SpecOptions(method, 4), target, draft, CostModel(), 10_000)
                    .run_to_end())
        assert state.generated == prompt[100:180]
        assert draft.reads == [] and state.stats.draft_wait_rounds == state.stats.rounds < 20, method


def test_a_system_prompt_the_draft_has_read_is_not_waited_for_again():
    """Questions after one 600-token system prompt: the first request's draft waits, then reads it (the
    answer is long enough); the second's draft finds it cached, and drafts from its first round."""
    system = [(i * 7) % VOCAB for i in range(600)]
    draft = PricedPromptDraft()
    for question in ([1, 2, 3], [4, 5, 6]):
        prompt = system + question
        state = RequestState(prompt, SamplingParams(), StopConditions(80))
        asyncio.run(SpeculationLoop(state, "s", SpecOptions("hybrid", 4), FakeTarget(), draft, CostModel(),
                                    10_000).run_to_end())
        assert state.generated == target_only(prompt, 80)
        if question == [1, 2, 3]:
            assert state.stats.draft_wait_rounds > 5
        else:
            assert state.stats.draft_wait_rounds == 0


def test_a_failing_verifier_still_releases_both_sides():
    class Broken(FakeTarget):
        async def verify(self, *a):
            raise RuntimeError("worker died")

    target, draft = Broken(), FakeDraft()
    state = RequestState([1, 2, 3], SamplingParams(), StopConditions(10))
    loop = SpeculationLoop(state, "s", SpecOptions("draft", 2, adaptive_k=False, pipelined=True), target, draft,
                           CostModel(), 1000)
    with pytest.raises(RuntimeError, match="worker died"):
        asyncio.run(loop.run_to_end())
    assert target.released == ["s"] and draft.released == ["s"]


def test_a_draft_method_needs_a_channel():
    state = RequestState([1], SamplingParams(), StopConditions(3))
    with pytest.raises(ValueError, match="needs a draft channel"):
        SpeculationLoop(state, "s", SpecOptions("draft", 2), FakeTarget(), None, CostModel(), 100)


def test_the_continuation_cache_proposes_what_an_earlier_request_generated():
    from tandem.spec.shared_cache import SharedContinuations

    async def two_requests():
        cache = SharedContinuations("fake-tokenizer", None)  # the embedded, in-process tier
        await cache.start()
        states = []
        for _ in range(2):
            target = FakeTarget()
            state = RequestState([3, 1, 4, 1, 5], SamplingParams(), StopConditions(40))
            loop = SpeculationLoop(state, "s", SpecOptions("ngram", 4, adaptive_k=False), target, None,
                                   CostModel(), 10_000, cache=cache)
            await loop.run_to_end()
            states.append(state)
        await cache.close()
        return states

    first, second = asyncio.run(two_requests())
    expected = target_only([3, 1, 4, 1, 5], 40)
    assert first.generated == second.generated == expected
    assert second.stats.cache_rounds > 0
    assert second.stats.accepted > first.stats.accepted  # what the first generated, the second reuses


@pytest.mark.parametrize("method", ["draft", "ngram", "hybrid"])
@pytest.mark.parametrize("pipelined", [False, True])
def test_greedy_output_with_trees_equals_target_alone(method, pipelined):
    state, target, _ = run(SpecOptions(method, 4, adaptive_k=False, pipelined=pipelined, tree="on", tree_width=2),
                           n=60)
    assert state.generated == target_only([3, 1, 4, 1, 5], 60)
    assert target.trees > 0 and state.stats.tree_rounds == target.trees


def test_tree_branches_add_tokens_where_the_chain_fails():
    """The draft errs at every fourth position and its next-best is the target's token there."""
    chain, _, _ = run(SpecOptions("draft", 2, adaptive_k=False), n=80)
    tree, _, _ = run(SpecOptions("draft", 2, adaptive_k=False, tree="on", tree_width=1), n=80)
    assert tree.generated == chain.generated
    assert tree.stats.branch_tokens > 0
    assert tree.stats.rounds < chain.stats.rounds


def test_the_caches_other_runs_become_whole_branches_where_they_part_from_the_chain():
    """The cache's most frequent run after the prompt parts from the target at its 5th token (past the
    tree's 3 depths); the run the target follows was seen once. Its nodes after the parting save the round."""
    from tandem.spec.shared_cache import SharedContinuations

    prompt = [3, 1, 4, 1, 5]
    truth = target_only(prompt, 40)
    wrong = [*truth[:4], (truth[4] + 1) % VOCAB, 0, 0, 0, 0, 0]

    async def request(tree: str) -> RequestState:
        cache = SharedContinuations("fake-tokenizer", None)
        await cache.start()
        for _ in range(2):
            cache.learn([*prompt, *wrong], final=True)
        cache.learn([*prompt, *truth[:16]], final=True)
        state = RequestState(prompt, SamplingParams(), StopConditions(10))
        loop = SpeculationLoop(state, "s", SpecOptions("ngram", 8, adaptive_k=False, tree=tree, tree_width=2),
                               FakeTarget(), None, CostModel(), 10_000, cache=cache)
        await loop.run_to_end()
        await cache.close()
        return state

    chain, tree = asyncio.run(request("off")), asyncio.run(request("on"))
    assert chain.generated == tree.generated == truth[:10]
    assert tree.stats.branch_tokens >= 4  # truth[4:8], below the chain's 4th node
    assert (tree.stats.rounds, chain.stats.rounds) == (1, 2)  # 1 + 9 tokens at once; 1 + 5, then the rest


def test_auto_tree_follows_the_cost_model():
    """Verifying more rows is nearly free here (FittedCost per token 1% of the base): auto builds trees. (The draft
    drafts whole chains: stopping where it is unsure, the fake draft would stop before every wrong guess, and leave
    the branches nothing to mend.)"""
    state, target, _ = run(SpecOptions("draft", 4, tree="auto", tree_width=1, draft_stops=False), n=80)
    assert state.generated == target_only([3, 1, 4, 1, 5], 80)
    assert target.trees > 0


def test_tree_off_sends_chains_only():
    _, target, _ = run(SpecOptions("draft", 4, adaptive_k=False, tree="off"), n=40)
    assert target.trees == 0


class DearRowsTarget(FakeTarget):
    """A target whose verification rows are dear (each one half a step), as fp32 on a CPU without AVX-512."""

    def fitted_cost(self) -> FittedCost | None:
        return FittedCost(0.1, 0.05)


def run_by_evidence(rates: MatchRates, n: int = 60) -> tuple[RequestState, FakeTarget]:
    target = DearRowsTarget()
    state = RequestState([3, 1, 4, 1, 5], SamplingParams(), StopConditions(n))
    loop = SpeculationLoop(state, "s", SpecOptions("ngram", 4), target, None, CostModel(), 10_000,
                           match_rates=rates)
    asyncio.run(loop.run_to_end())
    return state, target


def taught(accepted: int) -> MatchRates:
    """Rates that saw every kind of request-text match accept ``accepted`` of 4 tokens, 200 times."""
    rates = MatchRates()
    for n in (1, 2, 3, 5, 8):
        for _ in range(200):
            rates.observe(NGRAM, n, False, 4, accepted)
    return rates


def test_ngram_rounds_verify_what_their_kind_of_match_earns():
    expected = target_only([3, 1, 4, 1, 5], 60)
    wrong, _ = run_by_evidence(taught(accepted=0))
    right, _ = run_by_evidence(taught(accepted=4))
    assert wrong.generated == right.generated == expected
    matched = right.stats.ngram_rounds  # rounds whose text had a match (all proposed when matches are right)
    assert matched > 10 and right.stats.k_counts[4] > 0
    # Kinds that never pay propose nothing but their rare exploration rounds (one token each).
    assert wrong.stats.drafted <= matched // EXPLORE_EVERY + 1
    assert all(k <= 1 for k, count in wrong.stats.k_counts.items() if count)


def test_match_rates_learn_from_the_rounds_and_stay_apart_from_the_request_rate():
    rates = MatchRates()
    state, target = run_by_evidence(rates)
    assert state.generated == target_only([3, 1, 4, 1, 5], 60)
    observed = sum(t.accepted + t.rejected for t in rates.trackers.values())
    assert rates.trackers and all(source == NGRAM and not sampled for source, _, sampled in rates.trackers)
    assert observed > len(rates.trackers) * (AcceptanceTracker().accepted + AcceptanceTracker().rejected)
    assert target.verified_tokens == state.stats.drafted  # every drafted token was verified, none other


@pytest.mark.parametrize("pipelined", [False, True])
def test_an_adaptive_requests_draft_stops_where_it_is_unsure_and_the_output_is_the_targets(pipelined):
    """(Pipelined, a draft that stopped guessed no extra token: all it drafted is verified, as its chain.)"""
    state, _, draft = run(SpecOptions("draft", 6, pipelined=pipelined), n=80)
    assert state.generated == target_only([3, 1, 4, 1, 5], 80)
    assert max(draft.stops) > 0
    full, _, full_draft = run(SpecOptions("draft", 6, pipelined=pipelined, draft_stops=False), n=80)
    assert full.generated == state.generated and set(full_draft.stops) == {0.0}
    # the tokens it did not draft were the ones the target would have turned down
    assert state.stats.accepted / state.stats.drafted > full.stats.accepted / full.stats.drafted
    fixed, _, fixed_draft = run(SpecOptions("draft", 4, adaptive_k=False))
    assert set(fixed_draft.stops) == {0.0}  # a fixed k is drafted whole


class CheapRowsTarget(FakeTarget):
    """A target whose verification rows cost almost nothing beside a step (AMX, a GPU at small batch)."""

    def fitted_cost(self) -> FittedCost | None:
        return FittedCost(0.1, 0.0001)


def run_repeating(monkeypatch, options: SpecOptions, n: int = 120, rates: MatchRates | None = None):
    """A target that writes freely for 30 tokens, then repeats its last 20 for good: a long run to copy."""
    free = target_next
    monkeypatch.setattr(sys.modules[__name__], "target_next", lambda h: free(h) if len(h) < 30 else h[-20])
    target, draft = CheapRowsTarget(), FakeDraft()
    state = RequestState([3, 1, 4, 1, 5], SamplingParams(), StopConditions(n))
    loop = SpeculationLoop(state, "s", options, target, draft if options.uses_draft else None, CostModel(), 10_000,
                           match_rates=rates if rates is not None else MatchRates())
    asyncio.run(loop.run_to_end())
    assert state.generated == target_only([3, 1, 4, 1, 5], n)
    return state, draft


@pytest.mark.parametrize("method", ["ngram", "hybrid"])
def test_lookup_rounds_verify_long_runs_past_the_draft_models_k(monkeypatch, method):
    """Where the text repeats, a lookup's round verifies as many tokens as its kind of match earns (up to
    ``lookup_k_max``), not the k sized for a draft model's steps; the draft model's own rounds keep k."""
    state, draft = run_repeating(monkeypatch, SpecOptions(method, 4, hybrid_min_match=3))
    assert max(state.stats.k_counts) > 4, state.stats.k_counts
    capped, _ = run_repeating(monkeypatch, SpecOptions(method, 4, hybrid_min_match=3, lookup_k_max=4))
    assert max(capped.stats.k_counts) <= 4 and capped.stats.rounds > state.stats.rounds
    fixed, _ = run_repeating(monkeypatch, SpecOptions(method, 4, adaptive_k=False, hybrid_min_match=3))
    assert max(fixed.stats.k_counts) == 4  # a fixed k is the request's, for every source


def test_a_lookup_round_s_tree_stays_within_what_a_round_may_hold(monkeypatch):
    """A long lookup chain leaves no room for the tree's branches: every round holds at most MAX_K nodes."""
    from tandem.spec.adaptive import MAX_K

    sent: list[int] = []
    verify = CheapRowsTarget.verify

    async def counting(self, seq_id, committed_len, draft_tokens, *args, **kwargs):
        sent.append(len(draft_tokens))
        return await verify(self, seq_id, committed_len, draft_tokens, *args, **kwargs)

    monkeypatch.setattr(CheapRowsTarget, "verify", counting)
    state, _ = run_repeating(monkeypatch, SpecOptions("ngram", 4, tree="on", tree_width=2))
    assert max(sent) == MAX_K and state.stats.tree_rounds > 0


class DearDraft(FakeDraft):
    """A draft model whose step costs five target steps: adaptive k holds it at 0 (a draft under load)."""

    def fitted_cost(self) -> FittedCost | None:
        return FittedCost(0.5, 0.01)


def test_a_hybrid_round_whose_draft_model_is_held_at_zero_looks_up_instead(monkeypatch):
    """Where the draft model does not pay, a hybrid request's rounds still verify what its text repeats (a lookup
    costs no model step), and those guesses do not teach the rate that decides whether the model pays; the draft
    model is asked only in its exploration rounds."""
    free = target_next
    monkeypatch.setattr(sys.modules[__name__], "target_next", lambda h: free(h) if len(h) < 30 else h[-20])
    target, draft = CheapRowsTarget(), DearDraft()
    state = RequestState([3, 1, 4, 1, 5], SamplingParams(), StopConditions(120))
    loop = SpeculationLoop(state, "s", SpecOptions("hybrid", 4, hybrid_min_match=3), target, draft, CostModel(),
                           10_000, match_rates=MatchRates())
    before = (state.tracker.accepted, state.tracker.rejected)
    asyncio.run(loop.run_to_end())
    assert state.generated == target_only([3, 1, 4, 1, 5], 120)
    assert state.stats.ngram_rounds > 5 and state.stats.accepted > 40  # the repeated run was copied, not decoded
    assert state.stats.rounds < 60  # (a plain step a token: 119 rounds)
    assert draft.calls <= state.stats.rounds // EXPLORE_EVERY + 1  # exploration only
    observed = state.tracker.accepted + state.tracker.rejected - sum(before)
    assert observed <= draft.calls  # each exploring round drafts one token; the lookups taught nothing


SHARED_CPU = "cpu:node-1:0,1"


class BusyTarget(FakeTarget):
    """A target two streams share, on the machine's CPUs; a step 0.22 s, a row almost free (bf16 on AMX)."""

    streams = 2

    def fitted_cost(self) -> FittedCost | None:
        return FittedCost(0.22, 0.0005, device_key=SHARED_CPU)


class DraftOn(FakeDraft):
    """A draft step 0.1 s, on the given device, whose steps hold one call each (streams out of step)."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key

    def fitted_cost(self) -> FittedCost | None:
        return FittedCost(0.1, 0.001, device_key=self.key, calls_per_batch=1.0)


@pytest.mark.parametrize("key, drafts", [("cuda:node-1:GPU-7", True), (SHARED_CPU, False)])
def test_a_draft_on_the_target_s_device_drafts_only_where_every_stream_s_steps_pay(key, drafts):
    """With two streams out of step, a draft on a GPU of its own pays (its steps take nothing from the target); the
    same draft beside the target on one CPU takes the device for each stream's steps in turn, and is held at 0
    but for its exploring rounds."""
    target, draft = BusyTarget(), DraftOn(key)
    state = RequestState([3, 1, 4, 1, 5], SamplingParams(), StopConditions(80))
    loop = SpeculationLoop(state, "s", SpecOptions("hybrid", 4, hybrid_min_match=3), target, draft, CostModel(),
                           10_000, match_rates=MatchRates())
    asyncio.run(loop.run_to_end())
    assert state.generated == target_only([3, 1, 4, 1, 5], 80)
    if drafts:
        assert draft.calls > state.stats.rounds // 2
    else:
        assert draft.calls <= state.stats.rounds // EXPLORE_EVERY + 1  # exploration only
