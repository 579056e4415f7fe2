"""The target's log-probabilities of the tokens a verdict emits: the rows that decided them, chains and trees,
greedy and sampled, and through the in-process loop equal to a plain forward pass of the target."""

from __future__ import annotations

import pytest
import torch

from tandem.engine import ForwardItem, ModelEngine
from tandem.inprocess import GenerationRequest, SpeculativeGenerator
from tandem.sampling import SamplingParams
from tandem.spec.options import SpecOptions
from tandem.spec.rejection import PendingVerdict, fetch, first_token, verify, verify_tree
from tandem.spec.tree import children_of

VOCAB = 12
TOP = 3


def expected(logits: torch.Tensor, rows: list[int], tokens: list[int]) -> list[tuple[float, list[int]]]:
    logp = torch.log_softmax(logits.float(), -1)
    return [(logp[r, t].item(), logp[r].topk(TOP).indices.tolist()) for r, t in zip(rows, tokens)]


def observed(verdict) -> list[tuple[float, list[int]]]:
    return [(s.logprob, s.top_ids) for s in verdict.logprobs]


def check(verdict, logits: torch.Tensor, rows: list[int], tokens: list[int]) -> None:
    assert len(verdict.logprobs) == len(tokens)
    for (lp, top), (want_lp, want_top) in zip(observed(verdict), expected(logits, rows, tokens)):
        assert lp == pytest.approx(want_lp, abs=1e-5)
        assert top == want_top
    for s in verdict.logprobs:  # the top values are those tokens' log-probabilities, best first
        assert s.top_logprobs == sorted(s.top_logprobs, reverse=True) and len(s.top_logprobs) == TOP


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chain_logprobs_are_the_target_rows_of_the_kept_drafts_and_the_next_token(temperature):
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB) * 3
    greedy = logits.argmax(-1).tolist()
    drafts = [greedy[0], greedy[1], (greedy[2] + 1) % VOCAB]  # the third is not the target's choice
    params = SamplingParams(temperature=temperature, seed=3, logprobs=TOP)
    verdict = verify(logits, drafts, None, params, params.make_generator()).result()
    kept = drafts[: verdict.num_accepted]
    check(verdict, logits, list(range(verdict.num_accepted + 1)), [*kept, verdict.next_token])
    if temperature == 0:
        assert verdict.num_accepted == 2 and verdict.next_token == greedy[2]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_tree_logprobs_follow_the_kept_path(temperature):
    torch.manual_seed(1)
    logits = torch.randn(5, VOCAB) * 4  # row 0 the root, row i + 1 node i
    greedy = logits.argmax(-1).tolist()
    # node 0 (child of the root) the root's argmax, node 1 its sibling; node 2 under node 0 is node 0's row's
    # argmax; node 3 under node 2 is not what node 2's row picks.
    tokens = [greedy[0], (greedy[0] + 1) % VOCAB, greedy[1], (greedy[3] + 1) % VOCAB]
    parents = [-1, -1, 0, 2]
    params = SamplingParams(temperature=temperature, seed=5, logprobs=TOP)
    verdict = verify_tree(logits, tokens, children_of(parents), None, params,
                          params.make_generator()).result()
    path = verdict.accepted_nodes
    rows = [0, *(n + 1 for n in path)]
    check(verdict, logits, rows, [*(tokens[n] for n in path), verdict.next_token])
    if temperature == 0:
        assert path == [0, 2] and verdict.next_token == greedy[3]


def test_first_token_and_a_batch_that_mixes_asking_and_not():
    torch.manual_seed(2)
    logits = torch.randn(1, VOCAB)
    asked = SamplingParams(logprobs=TOP)
    pending = [first_token(logits, asked, None), first_token(logits, SamplingParams(), None),
               verify(torch.randn(3, VOCAB), [1, 2], None, SamplingParams(logprobs=0), None)]
    assert all(isinstance(p, PendingVerdict) for p in pending)
    first, plain, zero_top = fetch(pending)
    check(first, logits, [0], [int(logits.argmax())])
    assert plain.logprobs is None and plain.next_token == first.next_token
    assert len(zero_top.logprobs) == zero_top.num_accepted + 1 and all(not s.top_ids for s in zero_top.logprobs)


def test_logprobs_out_of_range_are_refused_naming_them():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)


@pytest.mark.parametrize("method", ["draft", "ngram"])
def test_loop_logprobs_equal_a_target_only_forward(tiny_llama_dir, method):
    """Through the whole loop (prefill, rounds of accepted and rejected drafts): each generated token's
    log-probability is the one a single forward pass of the target over prompt + output gives it."""
    from tandem.config import EngineConfig

    target = ModelEngine.load(EngineConfig(tiny_llama_dir, dtype="float32", kv_cache_tokens=512, block_size=4))
    draft = ModelEngine.load(EngineConfig(tiny_llama_dir, dtype="float32", kv_cache_tokens=512, block_size=4))
    generator = SpeculativeGenerator(target, draft, SpecOptions(method, k_max=3))
    prompt = [5, 9, 5, 9, 5, 9, 3]
    [result] = generator.generate([GenerationRequest(prompt, max_new_tokens=12,
                                                     sampling=SamplingParams(logprobs=2))])
    generated = result.token_ids
    assert result.stats.rounds > 0 and len(result.logprobs) == len(generated)

    check_engine = ModelEngine.load(EngineConfig(tiny_llama_dir, dtype="float32", kv_cache_tokens=512, block_size=4))
    sequence = [*prompt, *generated]
    [logits] = check_engine.forward([ForwardItem("check", sequence[:-1], num_logits=len(sequence) - 1)])
    logp = torch.log_softmax(logits.float(), -1)[len(prompt) - 1:]  # [generated, vocab]: each token's row
    for i, (token, score) in enumerate(zip(generated, result.logprobs)):
        assert score.logprob == pytest.approx(logp[i, token].item(), abs=1e-4), i
        assert score.top_ids == logp[i].topk(2).indices.tolist(), i
