"""A new prompt that shares a long prefix with one being computed waits for it (target_worker/shared_prompts.py):
which Prefills wait, that a wait ends and then reuses the shared blocks, and that the output is what it is
computed alone."""

from __future__ import annotations

import pytest

from tandem.config import EngineConfig
from tandem.cost_fit import PromptTokenCost
from tandem.engine import ModelEngine
from tandem.rpc.batcher import Unfinished
from tandem.sampling import SamplingParams
from target_worker.engine import PrefillCall, Prefilled, ReleaseCall, TargetEngine, VerifyCall
from target_worker.shared_prompts import MIN_SHARED_TOKENS, PromptRead, shared_blocks, should_wait
from tests.target_worker.test_engine import ok, one_thread  # noqa: F401 - autouse: one thread for tiny ops

pytestmark = pytest.mark.usefixtures("every_linear_packed")  # rows fixed by position: scored prompts keep scores

BS = 4
CONTEXT = [(7 * i) % 90 + 3 for i in range(300)]  # 300 tokens: shared beyond MIN_SHARED_TOKENS
GREEDY = SamplingParams()


def target_engine(model_dir, share: bool = True, chunk: int | None = 0) -> TargetEngine:
    return TargetEngine(ModelEngine.load(EngineConfig(model_dir, dtype="float32", kv_cache_tokens=8192,
                                                      block_size=BS, prefix_caching=True)),
                        prefill_chunk_tokens=chunk, share_prompts=share)


def dear_prompt_tokens(target: TargetEngine) -> None:
    """Price a prompt token far above a step's fixed cost, whatever this CPU measures next: every share waits."""
    target.engine.prompt_cost = PromptTokenCost()
    target.engine.prompt_cost.observe(100, 100.0)


def test_the_rule_counts_the_blocks_shared_beyond_the_cached_ones():
    assert shared_blocks(CONTEXT, [*CONTEXT, 1], BS) == 75 and shared_blocks(CONTEXT, CONTEXT, BS) == 74
    assert shared_blocks(CONTEXT, [1, *CONTEXT], BS) == 0
    leader = [PromptRead(CONTEXT, None)]
    follower = PromptRead([*CONTEXT, 5, 6], None)
    assert should_wait(follower, leader, 0, BS, 0.0, 0.0)  # 300 shared, nothing priced yet: >= MIN_SHARED_TOKENS
    assert not should_wait(follower, leader, 300 - MIN_SHARED_TOKENS + BS, BS, 0.0, 0.0)  # mostly cached already
    assert should_wait(follower, leader, 0, BS, 0.001, 0.2) and not should_wait(follower, leader, 0, BS, 0.001, 0.5)
    assert not should_wait(PromptRead([*CONTEXT, 5], 1), leader, 0, BS, 0.0, 0.0)  # a plain leader keeps no scores
    assert should_wait(PromptRead([*CONTEXT, 5], 1), [PromptRead(CONTEXT, 1)], 0, BS, 0.0, 0.0)
    assert not should_wait(PromptRead([*CONTEXT, 5], 2), [PromptRead(CONTEXT, 1)], 0, BS, 0.0, 0.0)
    assert should_wait(PromptRead([*CONTEXT, 5], None), [PromptRead(CONTEXT, 1)], 0, BS, 0.0, 0.0)
    assert not should_wait(follower, [], 0, BS, 0.0, 0.0)


def test_prompts_sharing_a_context_in_one_batch_compute_it_once_and_answer_as_computed_alone(tiny_qwen2_dir):
    target = target_engine(tiny_qwen2_dir)
    calls = [PrefillCall(f"p{i}", [*CONTEXT, 10 + i], GREEDY) for i in range(3)]
    first = ok(target.run_batch(calls))
    assert isinstance(first[0], Prefilled) and first[0].reused_tokens == 0
    assert all(isinstance(r, Unfinished) for r in first[1:])  # nothing started: no sequence, no KV
    assert set(target.sequences) == {"p0"}
    then = ok(target.run_batch(calls[1:]))  # as the batcher queues them again, first
    assert [r.reused_tokens for r in then] == [300 // BS * BS] * 2
    assert target.prompt_waits == 2
    alone = target_engine(tiny_qwen2_dir, share=False)
    assert ok(alone.run_batch(calls))[0].next_token == first[0].next_token
    computed = [ok(target_engine(tiny_qwen2_dir, share=False).run_batch([call]))[0].next_token
                for call in calls[1:]]
    assert [r.next_token for r in then] == computed


def test_a_prompt_waits_while_the_one_it_shares_with_is_computed_in_chunks(tiny_qwen2_dir):
    """Beside a running stream a long prompt is computed a chunk a step; a prompt sharing it waits each step until
    it is done, then takes it from the cache."""
    target = target_engine(tiny_qwen2_dir, chunk=64)
    dear_prompt_tokens(target)
    ok(target.run_batch([PrefillCall("stream", [1, 2, 3], GREEDY)]))

    def stream_step() -> VerifyCall:
        return VerifyCall("stream", len(target.sequences["stream"].history), [], [])

    leader, follower = PrefillCall("leader", [*CONTEXT, 40], GREEDY), PrefillCall("follower", [*CONTEXT, 41], GREEDY)
    steps = 0
    while True:
        steps += 1
        leading, following, _ = ok(target.run_batch([leader, follower, stream_step()]))
        assert isinstance(following, Unfinished) and "follower" not in target.sequences
        if not isinstance(leading, Unfinished):
            break
    assert steps > 1  # the leader took several chunks; the follower waited through all of them
    [answer, _] = ok(target.run_batch([follower, stream_step()]))
    assert answer.reused_tokens == 300 // BS * BS
    assert target.prompt_waits == steps


class UnpricedPromptTokens(PromptTokenCost):
    """A prompt token never priced: the rule then waits for MIN_SHARED_TOKENS shared, whatever this CPU measures."""

    @property
    def per_token_s(self) -> float:
        return 0.0


def test_scored_answers_after_one_context_wait_for_the_first_scored_one_and_score_as_computed_alone(tiny_qwen2_dir):
    """The first answer runs 256 rows a step; its blocks' KV is cached after its first step, but a scored prompt
    needs their kept scores too, so the others wait until it is done, then start on all of the context."""
    target = target_engine(tiny_qwen2_dir)
    target.engine.prompt_cost = UnpricedPromptTokens()
    scored = SamplingParams(prompt_logprobs=1)
    answers = [PrefillCall(f"a{j}", [*CONTEXT, 20 + j, 30 + j], scored) for j in range(3)]
    results = ok(target.run_batch(answers))  # a scored prompt runs 256 rows a step: the others wait throughout
    while isinstance(results[0], Unfinished):
        assert all(isinstance(r, Unfinished) for r in results[1:])
        results = ok(target.run_batch(answers))
    ok(target.run_batch([ReleaseCall(answers[0].seq_id)]))  # answered: its blocks stay cached, held by none
    rest = ok(target.run_batch(answers[1:]))  # the prefix's last token fed again, into a copy of its cached block
    assert [r.reused_tokens for r in rest] == [300 // BS * BS - 1] * 2
    for call, result in zip(answers, [results[0], *rest]):
        alone = target_engine(tiny_qwen2_dir, share=False)
        computed = ok(alone.run_batch([call]))[0]
        while isinstance(computed, Unfinished):
            computed = ok(alone.run_batch([call]))[0]
        assert [s.logprob for s in result.prompt_logprobs] == [s.logprob for s in computed.prompt_logprobs]
        assert result.next_token == computed.next_token


def test_a_released_leader_lets_its_followers_compute_their_own(tiny_qwen2_dir):
    target = target_engine(tiny_qwen2_dir, chunk=64)
    dear_prompt_tokens(target)
    ok(target.run_batch([PrefillCall("stream", [1, 2, 3], GREEDY)]))
    leader, follower = PrefillCall("leader", [*CONTEXT, 40], GREEDY), PrefillCall("follower", [*CONTEXT, 41], GREEDY)
    verify = VerifyCall("stream", len(target.sequences["stream"].history), [], [])
    assert [type(r) for r in ok(target.run_batch([leader, follower, verify]))[:2]] == [Unfinished, Unfinished]
    ok(target.run_batch([ReleaseCall("leader")]))  # its client went away mid-prompt
    answer = ok(target.run_batch([follower]))[0]
    while isinstance(answer, Unfinished):
        answer = ok(target.run_batch([follower]))[0]
    assert isinstance(answer, Prefilled)
