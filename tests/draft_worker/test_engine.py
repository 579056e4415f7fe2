"""DraftEngine.run_batch: Propose and Release; exact KV rollback; bad calls fail alone; a full pool;
sampled drafts come with the very messages of the q they were drawn from.

bfloat16 engines: our layers are batch-invariant there, so K/V computed in
different batch shapes are equal bit for bit.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from draft_worker import engine as engine_module
from draft_worker.engine import (
    MAX_PROPOSE,
    DraftEngine,
    DraftReply,
    ProposeCall,
    ReleaseCall,
    early_exit_engine,
)
from tandem.config import EngineConfig
from tandem.engine import ForwardItem, ModelEngine
from tandem.errors import InvalidRequestError, KVCacheExhaustedError, StaleSequenceError, UnknownSequenceError
from tandem.rpc import distributions
from tandem.sampling import SamplingParams
from tandem.v1 import common_pb2

PROMPT = [3, 14, 15, 92, 65, 35, 89]
GREEDY = SamplingParams()


@pytest.fixture(autouse=True)
def one_thread():
    """Many tiny ops: one thread is faster, and on a busy 2-core machine far faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def load(model_dir, kv_cache_tokens: int = 2048) -> ModelEngine:
    return ModelEngine.load(EngineConfig(model_dir, dtype="bfloat16", kv_cache_tokens=kv_cache_tokens, block_size=4))


@pytest.fixture
def draft(tiny_qwen2_dir) -> DraftEngine:
    return DraftEngine(load(tiny_qwen2_dir))


def ok(results: list) -> list:
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]
    return results


def greedy_continuation(engine: ModelEngine, tokens: list[int], n: int) -> list[int]:
    out = []
    logits = engine.forward([ForwardItem("scratch", tokens)])[0]
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = engine.forward([ForwardItem("scratch", [out[-1]])])[0]
    engine.release("scratch")
    return out


def kv_of(engine: ModelEngine, seq_id: str) -> torch.Tensor:
    cache = engine.kv_cache
    seq = cache.sequence(seq_id)
    positions = torch.arange(seq.length)
    blocks = torch.tensor(seq.block_ids, dtype=torch.int64)[positions // cache.block_size]
    offsets = positions % cache.block_size
    return torch.stack([cache.key[:, blocks, offsets], cache.value[:, blocks, offsets]])


def snapshot(draft: DraftEngine, seq_id: str):
    seq = draft.sequences[seq_id]
    return (list(seq.tokens), kv_of(draft.engine, seq_id).clone(),
            list(draft.engine.kv_cache.sequence(seq_id).block_ids),
            None if seq.generator is None else seq.generator.get_state())


def assert_unchanged(draft: DraftEngine, seq_id: str, before) -> None:
    after = snapshot(draft, seq_id)
    assert after[0] == before[0] and after[2] == before[2]
    assert torch.equal(after[1], before[1])
    if before[3] is not None:
        assert torch.equal(after[3], before[3])


def test_greedy_propose_drafts_the_models_own_continuation(draft):
    expected = greedy_continuation(draft.engine, PROMPT, 5)
    (reply,) = ok(draft.run_batch([ProposeCall("a", 0, PROMPT, 5, GREEDY)]))
    assert reply == DraftReply(expected, [])
    # The cache holds every token but the last draft; the sequence holds the same tokens.
    assert draft.sequences["a"].tokens == [*PROMPT, *expected[:4]]
    assert draft.engine.seq_len("a") == len(PROMPT) + 4
    # Next round: the target kept 2 drafts and chose its own third token (90).
    (reply,) = ok(draft.run_batch([ProposeCall("a", len(PROMPT), [*expected[:2], 90], 3, GREEDY)]))
    assert reply.tokens == greedy_continuation(draft.engine, [*PROMPT, *expected[:2], 90], 3)


def test_kv_after_a_rollback_equals_kv_of_a_sequence_that_never_saw_the_rejected_drafts(draft):
    ok(draft.run_batch([ProposeCall("a", 0, PROMPT, 6, GREEDY)]))
    history = [*PROMPT, 40, 41]  # the target rejected every draft: a's cache rolls back to PROMPT
    replies = ok(draft.run_batch([ProposeCall("a", len(PROMPT), [40, 41], 3, GREEDY),
                                  ProposeCall("b", 0, history, 3, GREEDY)]))
    assert replies[0] == replies[1]
    assert draft.sequences["a"].tokens == draft.sequences["b"].tokens
    assert torch.equal(kv_of(draft.engine, "a"), kv_of(draft.engine, "b"))
    assert len(draft.engine.kv_cache.sequence("a").block_ids) == len(draft.engine.kv_cache.sequence("b").block_ids)


def test_what_the_draft_has_not_read_is_fed_as_the_target_read_it(draft):
    """A prompt longer than a short run, then generated tokens: with ``prompt_len`` the draft's KV is
    bitwise the KV of the target's reading (Prefill of the prompt, then short verification runs),
    however the tokens reach it: with the first Propose, or in a long catch-up later."""
    prompt = [(7 * i + 3) % draft.vocab_size for i in range(24)]  # [24]: read as a prompt chunk
    generated = [(11 * i + 5) % draft.vocab_size for i in range(21)]
    target_like = draft.engine
    target_like.forward([ForwardItem("target", prompt, num_logits=0)])
    for run in ([generated[0]], generated[1:6], generated[6:21]):  # what Verify calls would feed
        target_like.forward([ForwardItem("target", run, num_logits=0)])
    first = ProposeCall("first", 0, [*prompt, *generated], 1, GREEDY, prompt_len=len(prompt))
    ok(draft.run_batch([first]))
    late = [ProposeCall("late", 0, prompt, 0, GREEDY, prompt_len=len(prompt)),  # records only
            ProposeCall("late", len(prompt), generated, 1, GREEDY, prompt_len=len(prompt))]
    for call in late:
        ok(draft.run_batch([call]))
    expected = kv_of(target_like, "target")
    assert torch.equal(kv_of(draft.engine, "first"), expected)
    assert torch.equal(kv_of(draft.engine, "late"), expected)


def test_k_zero_only_records_the_history(draft):
    (reply,) = ok(draft.run_batch([ProposeCall("a", 0, PROMPT, 0, GREEDY)]))
    assert reply == DraftReply([], [])
    assert draft.sequences["a"].tokens == PROMPT and draft.engine.seq_len("a") == 0
    (reply,) = ok(draft.run_batch([ProposeCall("a", len(PROMPT), [7], 2, GREEDY)]))
    assert reply.tokens == greedy_continuation(draft.engine, [*PROMPT, 7], 2)


def test_each_bad_call_fails_alone_and_leaves_its_sequence_as_it_was(draft):
    sampled = SamplingParams(temperature=1.0, seed=3)
    ok(draft.run_batch([ProposeCall("a", 0, PROMPT, 2, GREEDY), ProposeCall("b", 0, PROMPT, 2, sampled)]))
    before = snapshot(draft, "b")
    held = len(draft.sequences["b"].tokens)
    results = draft.run_batch([
        ProposeCall("a", len(PROMPT), [5], 2, GREEDY),  # good
        ProposeCall("a", len(PROMPT), [5], 2, GREEDY),  # a second Propose of a in the batch
        ProposeCall("b", held + 1, [5], 2, sampled),  # stale: more than the draft holds
        ProposeCall("b", 3, [5, draft.vocab_size], 2, sampled),  # a token outside the vocabulary
        ProposeCall("b", 3, [5], MAX_PROPOSE + 1, sampled),  # k too large
        ProposeCall("b", -1, [5], 2, sampled),
        ProposeCall("b", 0, [], 2, sampled),  # nothing to draft from
        ProposeCall("b", 0, [1] * 600, 1, sampled),  # past the context
        ProposeCall("nobody", 4, [5], 2, sampled),  # unknown sequence with a committed prefix
        ProposeCall("", 0, [5], 2, sampled),
        ProposeCall("b", 3, [5], 2, sampled, prompt_len=5),  # a prompt longer than the sequence
        ProposeCall("b", 3, [5], 2, sampled, prompt_len=-1),
    ])
    assert isinstance(results[0], DraftReply) and len(results[0].tokens) == 2
    expected = [InvalidRequestError, StaleSequenceError, InvalidRequestError, InvalidRequestError,
                InvalidRequestError, InvalidRequestError, InvalidRequestError, UnknownSequenceError,
                InvalidRequestError, InvalidRequestError, InvalidRequestError]
    assert len(results) == len(expected) + 1
    for result, kind in zip(results[1:], expected):
        assert type(result) is kind, result
    assert_unchanged(draft, "b", before)
    assert set(draft.sequences) == {"a", "b"}


def test_a_full_pool_refuses_the_call_that_does_not_fit_and_corrupts_nothing(tiny_qwen2_dir):
    draft = DraftEngine(load(tiny_qwen2_dir, kv_cache_tokens=24))  # 6 blocks of 4
    cache = draft.engine.kv_cache
    ok(draft.run_batch([ProposeCall("a", 0, list(range(10, 19)), 2, GREEDY)]))  # 9 + 1 tokens: 3 blocks
    before = snapshot(draft, "a")
    # b: 10 tokens fit in the 3 free blocks, but its 4 drafts need 13 slots: refused up front.
    results = draft.run_batch([ProposeCall("b", 0, list(range(20, 30)), 4, GREEDY),
                               ProposeCall("a", 9, [1, 2, 3], 1, GREEDY)])  # a: 12 slots, 3 blocks: fits
    assert isinstance(results[0], KVCacheExhaustedError) and isinstance(results[1], DraftReply), results
    assert "b" not in draft.sequences and not cache.has_sequence("b")
    assert draft.sequences["a"].tokens == [*before[0][:9], 1, 2, 3]
    before = snapshot(draft, "a")
    results = draft.run_batch([ProposeCall("c", 0, list(range(20, 30)), 4, GREEDY)])
    assert isinstance(results[0], KVCacheExhaustedError)
    assert_unchanged(draft, "a", before)
    assert ok(draft.run_batch([ReleaseCall("a")])) == [True]
    (reply,) = ok(draft.run_batch([ProposeCall("c", 0, list(range(20, 30)), 4, GREEDY)]))
    assert len(reply.tokens) == 4


def test_release_applies_in_queue_order_within_a_batch(draft):
    ok(draft.run_batch([ProposeCall("a", 0, PROMPT, 2, GREEDY)]))
    results = draft.run_batch([
        ProposeCall("a", len(PROMPT), [5], 2, GREEDY), ReleaseCall("a"),  # propose first, then release
        ReleaseCall("x"), ProposeCall("x", 0, PROMPT, 1, GREEDY),  # released (not held), then new
    ])
    assert isinstance(results[0], DraftReply) and results[1] is True
    assert results[2] is False and isinstance(results[3], DraftReply)
    assert "a" not in draft.sequences and not draft.engine.kv_cache.has_sequence("a")
    assert ok(draft.run_batch([ReleaseCall("x"), ReleaseCall("x")])) == [True, False]
    assert draft.num_sequences == 0 and draft.engine.kv_cache.num_free_blocks == draft.engine.kv_cache.num_blocks


def test_sampled_drafts_come_with_the_messages_of_the_q_they_were_drawn_from(draft, monkeypatch):
    drawn_from: list[torch.Tensor] = []
    encodings: list[int] = []
    real_sample, real_encode = engine_module.sample, distributions.encode_for_sampling

    def spy_sample(probs, generator):
        drawn_from.append(probs[0].clone())
        return real_sample(probs, generator)

    def spy_encode(q):
        encodings.append(q.shape[0])
        return real_encode(q)

    monkeypatch.setattr(engine_module, "sample", spy_sample)
    monkeypatch.setattr(distributions, "encode_for_sampling", spy_encode)
    sampled = [SamplingParams(temperature=1.0, seed=1, rejection_rule=True),
               SamplingParams(temperature=0.7, top_p=0.9, seed=2, rejection_rule=True)]
    replies = ok(draft.run_batch([ProposeCall("a", 0, PROMPT, 4, sampled[0]),
                                  ProposeCall("b", 0, PROMPT[:3], 4, sampled[1])]))
    assert encodings == [2, 2, 2, 2]  # one encoding per step for both rows
    draws = iter(drawn_from)
    for step in range(4):
        for reply in replies:
            decoded = distributions.decode_distributions([reply.probs[step]], draft.vocab_size)[0]
            support = decoded.nonzero().squeeze(-1)
            assert torch.equal(decoded[support], next(draws))  # bit for bit what the token was drawn from
            assert decoded[reply.tokens[step]] > 0


def test_seeded_drafts_repeat_whatever_else_is_in_the_batch(tiny_qwen2_dir):
    sampling = SamplingParams(temperature=1.0, seed=11)
    alone = DraftEngine(load(tiny_qwen2_dir)).run_batch([ProposeCall("a", 0, PROMPT, 4, sampling)])
    crowd = DraftEngine(load(tiny_qwen2_dir)).run_batch([
        ProposeCall("z", 0, [9, 9], 3, SamplingParams(temperature=1.2, seed=5)),
        ProposeCall("a", 0, PROMPT, 4, sampling),
        ProposeCall("y", 0, [8], 2, GREEDY),
    ])
    assert ok(alone)[0] == ok(crowd)[1]


def test_early_exit_engine_drafts_in_process_with_a_pool_of_its_own(tiny_qwen2_dir):
    target = load(tiny_qwen2_dir)
    drafter = early_exit_engine(target, 1)
    assert drafter.model is target.model and drafter.kv_cache is not target.kv_cache
    draft = DraftEngine(drafter)
    (reply,) = ok(draft.run_batch([ProposeCall("a", 0, PROMPT, 3, GREEDY)]))
    assert len(reply.tokens) == 3
    assert not target.kv_cache.has_sequence("a") and target.kv_cache.num_free_blocks == target.kv_cache.num_blocks
    for layers in (0, target.config.num_layers):
        with pytest.raises(ValueError, match="early-exit layers"):
            early_exit_engine(target, layers)


def test_the_service_sends_the_engines_messages_as_they_are():
    """The servicer only copies DraftReply.probs into the reply: no second encoding."""
    from draft_worker.service import DraftService
    from tandem.v1 import draft_pb2

    msg = common_pb2.SparseDistribution(token_ids=[2, 5], probs_fp16=b"\x00\x38\x01\x38")  # not normalised

    class FakeBatcher:
        async def submit(self, call):
            assert isinstance(call, ProposeCall) and call.sampling.temperature == 1.0
            return DraftReply([5], [msg])

    class FakeServer:
        def check_accepting(self):
            pass

    service = DraftService(None, FakeBatcher(), FakeServer(), "m", "fp", [])
    request = draft_pb2.ProposeRequest(seq_id="a", committed_len=0, new_tokens=[1, 2], k=1)
    request.sampling.temperature = 1.0
    reply = asyncio.run(service.Propose(request, None))
    assert list(reply.tokens) == [5] and reply.probs[0].SerializeToString() == msg.SerializeToString()


def test_warmup_leaves_nothing_behind(draft):
    draft.warmup()
    assert draft.num_sequences == 0
    assert draft.engine.kv_cache.num_free_blocks == draft.engine.kv_cache.num_blocks


def test_alternatives_are_the_next_best_tokens_other_than_the_drafted_one(draft):
    (reply,) = ok(draft.run_batch([ProposeCall("a", 0, PROMPT, 3, GREEDY, alternatives=2)]))
    assert len(reply.alternatives) == 3
    history = list(PROMPT)
    for token, others in zip(reply.tokens, reply.alternatives):
        logits = draft.engine.forward([ForwardItem("scratch", history)])[0][-1]
        draft.engine.release("scratch")
        assert others == [t for t in logits.topk(3).indices.tolist() if t != token][:2]
        history.append(token)
    (plain,) = ok(draft.run_batch([ProposeCall("b", 0, PROMPT, 3, GREEDY)]))
    assert plain.tokens == reply.tokens and plain.alternatives == []
    (bad,) = draft.run_batch([ProposeCall("c", 0, PROMPT, 3, GREEDY, alternatives=99)])
    assert isinstance(bad, InvalidRequestError) and "alternatives" in str(bad)


def top_probabilities(engine: ModelEngine, history: list[int], tokens: list[int]) -> list[float]:
    """The model's top probability before each of ``tokens`` (after ``history``), as one forward computes it."""
    logits = engine.forward([ForwardItem("scratch", [*history, *tokens[:-1]], num_logits=len(tokens))])[0]
    engine.release("scratch")
    return torch.softmax(logits.float(), dim=-1).amax(dim=-1).tolist()


def test_stop_below_stops_drafting_where_the_drafts_top_probabilities_multiply_below_it(draft):
    """After each drafted token the product of the top probabilities so far is compared with stop_below: the
    draft stops at the first below it, and what it drafted is the start of the whole k's draft."""
    (whole,) = ok(draft.run_batch([ProposeCall("whole", 0, PROMPT, 5, GREEDY)]))
    tops = top_probabilities(draft.engine, PROMPT, whole.tokens)
    products = [float(torch.tensor(tops[:j + 1]).prod()) for j in range(5)]
    assert products[2] > products[3]
    between = (products[2] + products[3]) / 2  # above after three tokens, below after four
    (cut,) = ok(draft.run_batch([ProposeCall("cut", 0, PROMPT, 5, GREEDY, stop_below=between)]))
    assert cut.tokens == whole.tokens[:4]
    (one,) = ok(draft.run_batch([ProposeCall("one", 0, PROMPT, 5, GREEDY, stop_below=1.0)]))
    assert one.tokens == whole.tokens[:1]  # at least one token is drafted
    sampled = SamplingParams(temperature=1.0, seed=3)
    (seeded,) = ok(draft.run_batch([ProposeCall("s", 0, PROMPT, 5, sampled, stop_below=1.0)]))
    assert len(seeded.tokens) == len(seeded.probs) == 1  # a sampled draft stops alike, with its q
    for bad in (1.5, -0.1, float("nan")):
        (refused,) = draft.run_batch([ProposeCall("bad", 0, PROMPT, 3, GREEDY, stop_below=bad)])
        assert isinstance(refused, InvalidRequestError) and "stop_below" in str(refused)
    assert "bad" not in draft.sequences
