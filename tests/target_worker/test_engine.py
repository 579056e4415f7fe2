"""TargetEngine.run_batch: Prefill, Verify and Release; exact KV rollback; bad calls fail alone; a full pool.

bfloat16 engines: our layers are batch-invariant there, so a K/V computed in
a 5-token verify equals, bit for bit, one computed in a 2-token one.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine import ForwardItem, ModelEngine
from tandem.errors import InvalidRequestError, KVCacheExhaustedError, StaleSequenceError, UnknownSequenceError
from tandem.rpc.distributions import decode_distributions, encode_distributions
from tandem.sampling import SamplingParams
from target_worker import engine as engine_module
from target_worker.engine import PrefillCall, Prefilled, ReleaseCall, TargetEngine, Verdict, VerifyCall

PROMPT = [3, 14, 15, 92, 65, 35, 89]
GREEDY = SamplingParams()


@pytest.fixture(autouse=True)
def one_thread():
    """Many tiny ops: one thread is faster, and on a busy 2-core machine far faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_target(model_dir, kv_cache_tokens: int = 2048) -> TargetEngine:
    return TargetEngine(ModelEngine.load(
        EngineConfig(model_dir, dtype="bfloat16", kv_cache_tokens=kv_cache_tokens, block_size=4)))


@pytest.fixture
def target(tiny_qwen2_dir) -> TargetEngine:
    return make_target(tiny_qwen2_dir)


def ok(results: list) -> list:
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise failed[0]
    return results


def greedy_continuation(engine: ModelEngine, tokens: list[int], n: int) -> list[int]:
    """The model's own greedy continuation, on a scratch sequence."""
    out = []
    logits = engine.forward([ForwardItem("scratch", tokens)])[0]
    for _ in range(n):
        out.append(int(logits[-1].argmax()))
        logits = engine.forward([ForwardItem("scratch", [out[-1]])])[0]
    engine.release("scratch")
    return out


def kv_of(engine: ModelEngine, seq_id: str) -> torch.Tensor:
    """``[2, layers, length, Hkv, D]``: the K and V a sequence's attention can read."""
    cache = engine.kv_cache
    seq = cache.sequence(seq_id)
    positions = torch.arange(seq.length)
    blocks = torch.tensor(seq.block_ids, dtype=torch.int64)[positions // cache.block_size]
    offsets = positions % cache.block_size
    return torch.stack([cache.key[:, blocks, offsets], cache.value[:, blocks, offsets]])


@dataclass
class Snapshot:
    history: list[int]
    kv: torch.Tensor
    blocks: list[int]
    generator_state: torch.Tensor | None


def snapshot(target: TargetEngine, seq_id: str) -> Snapshot:
    seq = target.sequences[seq_id]
    return Snapshot(list(seq.history), kv_of(target.engine, seq_id).clone(),
                    list(target.engine.kv_cache.sequence(seq_id).block_ids),
                    None if seq.generator is None else seq.generator.get_state())


def assert_unchanged(target: TargetEngine, seq_id: str, before: Snapshot) -> None:
    after = snapshot(target, seq_id)
    assert after.history == before.history
    assert after.blocks == before.blocks
    assert torch.equal(after.kv, before.kv)
    if before.generator_state is not None:
        assert torch.equal(after.generator_state, before.generator_state)


def test_prefill_verify_release_through_run_batch(target):
    expected = greedy_continuation(target.engine, PROMPT, 6)
    (first,) = ok(target.run_batch([PrefillCall("a", PROMPT, GREEDY)]))
    assert first == Prefilled(expected[0])
    assert target.engine.seq_len("a") == len(PROMPT)  # the KV holds every committed token but the last
    # Drafts equal to the target's own continuation: all accepted, plus the bonus token.
    (verdict,) = ok(target.run_batch([VerifyCall("a", len(PROMPT) + 1, expected[1:5], [])]))
    assert verdict == Verdict(4, expected[5])
    assert target.sequences["a"].history == [*PROMPT, *expected[:6]]
    assert target.engine.seq_len("a") == len(PROMPT) + 5
    assert ok(target.run_batch([ReleaseCall("a"), ReleaseCall("a")])) == [True, False]
    assert target.num_sequences == 0
    assert target.engine.kv_cache.num_free_blocks == target.engine.kv_cache.num_blocks


def test_kv_after_a_rejection_equals_kv_of_a_sequence_that_saw_only_the_accepted_tokens(target):
    expected = greedy_continuation(target.engine, PROMPT, 6)
    wrong = (expected[2] + 1) % target.vocab_size
    ok(target.run_batch([PrefillCall("a", PROMPT, GREEDY), PrefillCall("b", PROMPT, GREEDY)]))
    # a: 4 drafts, the second wrong: 1 accepted, the target's token replaces the second.
    # b: only the accepted draft.
    verdicts = ok(target.run_batch([
        VerifyCall("a", len(PROMPT) + 1, [expected[1], wrong, 7, 8], []),
        VerifyCall("b", len(PROMPT) + 1, [expected[1]], []),
    ]))
    assert verdicts == [Verdict(1, expected[2]), Verdict(1, expected[2])]
    assert target.sequences["a"].history == target.sequences["b"].history
    assert target.engine.kv_cache.sequence("a").length == target.engine.kv_cache.sequence("b").length
    assert len(target.engine.kv_cache.sequence("a").block_ids) == len(target.engine.kv_cache.sequence("b").block_ids)
    assert torch.equal(kv_of(target.engine, "a"), kv_of(target.engine, "b"))
    # And they go on alike.
    committed = len(target.sequences["a"].history)
    verdicts = ok(target.run_batch([VerifyCall(s, committed, expected[3:5], []) for s in ("a", "b")]))
    assert verdicts[0] == verdicts[1] == Verdict(2, expected[5])
    assert torch.equal(kv_of(target.engine, "a"), kv_of(target.engine, "b"))


def test_a_verify_may_roll_back_into_committed_tokens(target):
    """committed_len below the history: the tail is forgotten (the coordinator rebuilt its view)."""
    expected = greedy_continuation(target.engine, PROMPT, 6)
    ok(target.run_batch([PrefillCall("a", PROMPT, GREEDY), PrefillCall("b", PROMPT, GREEDY)]))
    ok(target.run_batch([VerifyCall("a", len(PROMPT) + 1, expected[1:4], [])]))
    (verdict,) = ok(target.run_batch([VerifyCall("a", len(PROMPT) + 1, [expected[1]], [])]))
    ok(target.run_batch([VerifyCall("b", len(PROMPT) + 1, [expected[1]], [])]))
    assert target.sequences["a"].history == target.sequences["b"].history
    assert torch.equal(kv_of(target.engine, "a"), kv_of(target.engine, "b"))


def test_each_bad_call_fails_alone_and_leaves_its_sequence_as_it_was(target):
    sampled = SamplingParams(temperature=1.0, seed=5)
    ok(target.run_batch([PrefillCall("a", PROMPT, GREEDY), PrefillCall("b", PROMPT, GREEDY),
                         PrefillCall("c", PROMPT, sampled)]))
    before = {s: snapshot(target, s) for s in ("b", "c")}
    n = len(PROMPT) + 1
    vocab = target.vocab_size
    q = torch.softmax(torch.randn(2, vocab, generator=torch.Generator().manual_seed(0)), -1)
    zero_at_draft = torch.zeros(2, vocab)
    zero_at_draft[:, 0] = 1.0  # drafts are 5 and 6: probability 0 under the q they claim to come from
    calls = [
        VerifyCall("a", n, [5, 6], []),  # good
        VerifyCall("a", n, [5, 6], []),  # a second call of the same sequence in the batch
        VerifyCall("b", n + 1, [5], []),  # stale: more committed tokens than the target holds
        VerifyCall("b", 0, [5], []),  # committed_len 0
        VerifyCall("nobody", 3, [5], []),  # unknown sequence
        VerifyCall("c", n, [5, 6], encode_distributions(q[:1])),  # probs count != draft count
        VerifyCall("c", n, [5, 6], encode_distributions(zero_at_draft)),
        VerifyCall("c", n, [5, vocab], []),  # a draft token outside the vocabulary
        VerifyCall("c", n, [5] * 600, []),  # past the context
        PrefillCall("b", [1, vocab + 3], GREEDY),  # a re-prefill with a bad token id
        PrefillCall("d", [], GREEDY),
    ]
    results = target.run_batch(calls)
    assert isinstance(results[0], Verdict)
    expected = [InvalidRequestError, StaleSequenceError, StaleSequenceError, UnknownSequenceError,
                InvalidRequestError, InvalidRequestError, InvalidRequestError, InvalidRequestError,
                InvalidRequestError, InvalidRequestError]
    for result, kind in zip(results[1:], expected):
        assert type(result) is kind, result
    for seq_id, snap in before.items():
        assert_unchanged(target, seq_id, snap)
    assert "d" not in target.sequences
    # And the sequences still work.
    (verdict,) = ok(target.run_batch([VerifyCall("c", n, [5, 6], encode_distributions(q))]))
    assert 0 <= verdict.num_accepted <= 2


def test_malformed_draft_probs_fail_the_call_alone(target):
    from tandem.v1 import common_pb2

    sampled = SamplingParams(temperature=1.0, seed=5)
    ok(target.run_batch([PrefillCall("c", PROMPT, sampled)]))
    before = snapshot(target, "c")
    bad = common_pb2.SparseDistribution(token_ids=[5, 5], probs_fp16=b"\x00\x3c\x00\x3c")  # a repeated id
    (result,) = target.run_batch([VerifyCall("c", len(PROMPT) + 1, [5], [bad])])
    assert isinstance(result, InvalidRequestError) and "increasing" in str(result)
    assert_unchanged(target, "c", before)


def test_sampled_verify_tests_against_the_decoded_draft_probs(target, monkeypatch):
    seen = []

    def spy(logits, draft_tokens, draft_probs, params, generator, position=None, raw=None):
        seen.append(draft_probs)
        return real_verify(logits, draft_tokens, draft_probs, params, generator, position=position, raw=raw)

    real_verify = engine_module.verify
    monkeypatch.setattr(engine_module, "verify", spy)
    sampled = SamplingParams(temperature=0.8, top_k=20, seed=1, rejection_rule=True)  # the rule reads q
    ok(target.run_batch([PrefillCall("a", PROMPT, sampled)]))
    q = torch.softmax(torch.randn(3, target.vocab_size, generator=torch.Generator().manual_seed(2)) * 3, -1)
    drafts = [int(t) for t in q.argmax(-1)]
    msgs = encode_distributions(q)
    ok(target.run_batch([VerifyCall("a", len(PROMPT) + 1, drafts, msgs)]))
    assert torch.equal(seen[0], decode_distributions(msgs, target.vocab_size))


def test_a_full_pool_refuses_the_call_that_does_not_fit_and_corrupts_nothing(tiny_qwen2_dir):
    target = make_target(tiny_qwen2_dir, kv_cache_tokens=24)  # 6 blocks of 4
    cache = target.engine.kv_cache
    prompt = list(range(10, 20))  # 10 tokens: 3 blocks each
    ok(target.run_batch([PrefillCall("a", prompt, GREEDY), PrefillCall("b", prompt, GREEDY)]))
    assert cache.num_free_blocks == 0
    before = {s: snapshot(target, s) for s in ("a", "b")}
    committed = len(prompt) + 1
    results = target.run_batch([
        VerifyCall("a", committed, [1, 2, 3, 4], []),  # KV 10 -> 15 tokens: a 4th block
        PrefillCall("c", prompt, GREEDY),  # 3 new blocks
        PrefillCall("b", [*prompt, 1, 2, 3], GREEDY, replace=True),  # a rebuild needing a 4th block: b must survive
    ])
    assert all(isinstance(r, KVCacheExhaustedError) for r in results), results
    for seq_id, snap in before.items():
        assert_unchanged(target, seq_id, snap)
    assert "c" not in target.sequences and not cache.has_sequence("c") and cache.num_free_blocks == 0

    # A verify that gives blocks back makes room in the same batch: a rolls back to its first 4 tokens.
    results = target.run_batch([PrefillCall("c", prompt[:4], GREEDY), VerifyCall("a", 5, [], [])])
    assert isinstance(results[0], Prefilled) and isinstance(results[1], Verdict), results
    assert target.engine.seq_len("a") == 5 and cache.num_free_blocks == 0  # a: 2 blocks, b: 3, c: 1

    ok(target.run_batch([ReleaseCall("b")]))
    results = target.run_batch([VerifyCall("c", 5, [1, 2, 3, 4], [])])
    assert isinstance(results[0], Verdict), results


def test_release_applies_in_queue_order_within_a_batch(target):
    ok(target.run_batch([PrefillCall("a", PROMPT, GREEDY)]))
    results = target.run_batch([
        VerifyCall("a", len(PROMPT) + 1, [5], []), ReleaseCall("a"),  # verify first, then the release
        ReleaseCall("x"), PrefillCall("x", PROMPT, GREEDY),  # released (not held), then prefilled
    ])
    assert isinstance(results[0], Verdict) and results[1] is True
    assert results[2] is False and isinstance(results[3], Prefilled)
    assert "a" not in target.sequences and not target.engine.kv_cache.has_sequence("a")
    assert "x" in target.sequences


def test_a_failed_forward_leaves_every_sequence_consistent(target, monkeypatch):
    expected = greedy_continuation(target.engine, PROMPT, 4)
    ok(target.run_batch([PrefillCall("a", PROMPT, GREEDY)]))
    n = len(PROMPT) + 1

    def boom(items):
        raise RuntimeError("device lost")

    monkeypatch.setattr(target.engine, "forward", boom)
    results = target.run_batch([VerifyCall("a", n, expected[1:3], []), PrefillCall("b", PROMPT, GREEDY)])
    assert all(isinstance(r, RuntimeError) for r in results)
    monkeypatch.undo()
    assert "b" not in target.sequences and not target.engine.kv_cache.has_sequence("b")
    assert target.engine.seq_len("a") == n - 1 and len(target.sequences["a"].history) == n
    (verdict,) = ok(target.run_batch([VerifyCall("a", n, expected[1:3], [])]))
    assert verdict == Verdict(2, expected[3])


def test_warmup_leaves_nothing_behind(target):
    target.warmup()
    assert target.num_sequences == 0
    assert target.engine.kv_cache.num_free_blocks == target.engine.kv_cache.num_blocks


def test_a_rebuild_from_the_history_restores_the_kv_bit_for_bit(target):
    """A request that moves replica is re-prefilled with its prompt and the tokens it generated
    (prompt_len says where the prompt ends); the KV must be what verification had built."""
    ok(target.run_batch([PrefillCall("a", PROMPT, GREEDY)]))
    for drafts in ([1, 2, 3, 4], [5, 6], [7, 8, 9, 10], [11]):  # rounds with rejections: whatever the model says
        ok(target.run_batch([VerifyCall("a", len(target.sequences["a"].history), drafts, [])]))
    history = list(target.sequences["a"].history)
    assert len(history) - len(PROMPT) > engine_module.ROWWISE_MAX_QUERY // 4  # several runs of generated tokens
    (rebuilt,) = ok(target.run_batch([PrefillCall("b", history, GREEDY, prompt_len=len(PROMPT))]))
    assert rebuilt.next_token == history[-1]
    assert target.sequences["b"].history == history
    assert torch.equal(kv_of(target.engine, "b"), kv_of(target.engine, "a"))
    # and the rebuilt sequence verifies on exactly as the original does
    a, b = ok(target.run_batch([VerifyCall("a", len(history), [1, 2], []), VerifyCall("b", len(history), [1, 2], [])]))
    assert a == b


def test_a_seeded_sequence_draws_the_same_after_a_rebuild(target):
    """Seeded requests draw each position's randomness from (seed, position): moved, they go on alike."""
    sampled = SamplingParams(temperature=1.0, seed=11)
    ok(target.run_batch([PrefillCall("a", PROMPT, sampled)]))
    ok(target.run_batch([VerifyCall("a", len(PROMPT) + 1, [], [])]))
    history = list(target.sequences["a"].history)
    ok(target.run_batch([PrefillCall("b", history, sampled, prompt_len=len(PROMPT))]))
    drawn = [ok(target.run_batch([VerifyCall(s, len(history), [], [])]))[0].next_token for s in ("a", "b")]
    assert drawn[0] == drawn[1]
    assert target.sequences["b"].history[:-1] == history  # the rebuild sampled nothing of its own
    seeds = [SamplingParams(temperature=1.0, seed=s) for s in range(8)]
    draws = set()
    for i, params in enumerate(seeds):  # other seeds draw otherwise (8 draws at T=1 over a random model)
        ok(target.run_batch([PrefillCall(f"s{i}", history, params, prompt_len=len(PROMPT))]))
        draws.add(ok(target.run_batch([VerifyCall(f"s{i}", len(history), [], [])]))[0].next_token)
    assert len(draws) > 1


# ----- token trees ---------------------------------------------------------------------

def test_a_tree_keeps_the_path_the_target_follows_and_its_kv_equals_the_chains(target):
    """a verifies a tree whose kept path is off its first branch; b the same tokens as a chain."""
    expected = greedy_continuation(target.engine, PROMPT, 6)
    vocab = target.vocab_size
    wrong = [(t + 1) % vocab for t in expected]
    ok(target.run_batch([PrefillCall("a", PROMPT, GREEDY), PrefillCall("b", PROMPT, GREEDY)]))
    n = len(PROMPT) + 1
    # nodes: 0 wrong1 (root), 1 e1 (root), 2 wrong2 (under 0), 3 wrong2 (under 1), 4 e2 (under 1), 5 e3 (under 4)
    tokens = [wrong[1], expected[1], wrong[2], wrong[2], expected[2], expected[3]]
    parents = [-1, -1, 0, 1, 1, 4]
    verdicts = ok(target.run_batch([VerifyCall("a", n, tokens, [], parents),
                                    VerifyCall("b", n, expected[1:4], [])]))
    assert verdicts[0] == Verdict(3, expected[4], [1, 4, 5])
    assert verdicts[1] == Verdict(3, expected[4])
    assert target.sequences["a"].history == target.sequences["b"].history == [*PROMPT, *expected[:5]]
    assert target.engine.seq_len("a") == target.engine.seq_len("b") == len(PROMPT) + 4
    assert torch.equal(kv_of(target.engine, "a"), kv_of(target.engine, "b"))
    # And they go on alike (a tree that keeps only its root's first child, b a chain).
    committed = len(target.sequences["a"].history)
    verdicts = ok(target.run_batch([VerifyCall("a", committed, [wrong[5], expected[5]], [], [-1, -1]),
                                    VerifyCall("b", committed, [expected[5]], [])]))
    assert verdicts[0].accepted_nodes == [1] and verdicts[1].accepted_nodes == [0]
    assert verdicts[0].next_token == verdicts[1].next_token
    assert torch.equal(kv_of(target.engine, "a"), kv_of(target.engine, "b"))


def test_a_tree_whose_root_is_all_it_keeps_rolls_back_to_the_committed_tokens(target):
    expected = greedy_continuation(target.engine, PROMPT, 2)
    vocab = target.vocab_size
    ok(target.run_batch([PrefillCall("a", PROMPT, GREEDY), PrefillCall("b", PROMPT, GREEDY)]))
    n = len(PROMPT) + 1
    bad = [(expected[1] + i) % vocab for i in (1, 2, 3)]
    (verdict,) = ok(target.run_batch([VerifyCall("a", n, bad, [], [-1, -1, 0])]))
    (chain,) = ok(target.run_batch([VerifyCall("b", n, [], [])]))
    assert verdict == Verdict(0, expected[1], []) and chain.next_token == expected[1]
    assert torch.equal(kv_of(target.engine, "a"), kv_of(target.engine, "b"))


def test_bad_trees_fail_alone_and_leave_the_sequence_as_it_was(target):
    ok(target.run_batch([PrefillCall("a", PROMPT, GREEDY)]))
    before = snapshot(target, "a")
    n = len(PROMPT) + 1
    for parents, words in (([-1], "1 parents for 2"), ([-1, 1], r"draft_parents: parents\[1\] = 1"),
                           ([-1, -3], r"parents\[1\] = -3")):
        (result,) = target.run_batch([VerifyCall("a", n, [5, 6], [], parents)])
        assert isinstance(result, InvalidRequestError), result
        assert re.search(words, str(result)), str(result)
        assert_unchanged(target, "a", before)
    (result,) = target.run_batch([VerifyCall("a", n, [5] * 16, [], [-1] * 16)])
    assert isinstance(result, InvalidRequestError) and "at most 15" in str(result)
    assert_unchanged(target, "a", before)


def test_a_sampled_tree_reads_empty_messages_as_point_masses(target, monkeypatch):
    seen = []

    def spy(logits, tokens, children, draft_probs, params, generator, position=None, raw=None):
        seen.append((children, draft_probs))
        return real(logits, tokens, children, draft_probs, params, generator, position=position, raw=raw)

    real = engine_module.verify_tree
    monkeypatch.setattr(engine_module, "verify_tree", spy)
    sampled = SamplingParams(temperature=1.0, seed=4, rejection_rule=True)  # the rule reads q
    ok(target.run_batch([PrefillCall("a", PROMPT, sampled)]))
    q = torch.softmax(torch.randn(1, target.vocab_size, generator=torch.Generator().manual_seed(3)), -1)
    drafted = int(q.argmax())
    other = (drafted + 1) % target.vocab_size
    from tandem.spec.tree import POINT_MASS

    (verdict,) = ok(target.run_batch([VerifyCall("a", len(PROMPT) + 1, [drafted, other],
                                                 [*encode_distributions(q), POINT_MASS], [-1, -1])]))
    children, probs = seen[0]
    assert children == {-1: [0, 1]}
    assert torch.equal(probs[0], decode_distributions(encode_distributions(q), target.vocab_size)[0])
    assert torch.equal(probs[1], torch.nn.functional.one_hot(torch.tensor(other), target.vocab_size).float())
    assert len(target.sequences["a"].history) == len(PROMPT) + 1 + verdict.num_accepted + 1
