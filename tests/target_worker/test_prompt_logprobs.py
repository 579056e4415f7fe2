"""The target's log-probabilities of a prompt's own tokens (``prompt_logprobs``, OpenAI's completions ``echo``).

What they must be: prompt token i scored by row i - 1, as the log-softmax of the raw logits; equal bitwise to
what the target says of the same token when it emits it after the same text (rows are fixed by position); the
same however the prompt is cut into steps (the bound on rows per step, chunked prefill beside a stream); read from
the prefix cache only with the blocks' kept scores (``tandem.prompt_score_cache``), and then bitwise what the whole
prompt computed gives; untouched by penalties and grammars, as emitted tokens' are.

Engines here pack the tiny model's layers, as a real model's are (``every_linear_packed``): a row's logits are then
the same in a run of any length, which the bitwise claims need; a dtype this CPU does not pack is skipped there.
"""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine import ForwardItem, ModelEngine
from tandem.errors import InvalidRequestError
from tandem.inprocess import GenerationRequest, SpeculativeGenerator
from tandem.prompt_logprobs import score_rows
from tandem.rpc.batcher import Unfinished
from tandem.sampling import SamplingParams
from tandem.spec.options import SpecOptions
from target_worker import engine as engine_module
from target_worker.engine import PrefillCall, Prefilled, ReleaseCall, TargetEngine, VerifyCall
from tests.target_worker.test_engine import ok, one_thread  # noqa: F401 - autouse: one thread for tiny ops

pytestmark = pytest.mark.usefixtures("every_linear_packed")

TOP = 3
PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71]


def load(model_dir, dtype: str = "float32", caching: bool = True) -> ModelEngine:
    config = EngineConfig(model_dir, dtype=dtype, kv_cache_tokens=4096, block_size=4, prefix_caching=caching)
    if not config.pack_weights:
        pytest.skip(f"{dtype} weights are not packed on this CPU: a row's logits depend on the run's length")
    engine = ModelEngine.load(config)
    assert engine.rows_fixed_by_position
    return engine


def prefill_to_end(target: TargetEngine, call: PrefillCall, beside: list | None = None) -> tuple[Prefilled, int]:
    """Run a Prefill until it answers (chunks answer ``Unfinished``), each step beside ``beside``'s calls (made
    per step from the sequences' histories); the answer and the steps it took."""
    steps = 0
    while True:
        steps += 1
        others = beside(target) if beside else []
        result = ok(target.run_batch([call, *others]))[0]
        if not isinstance(result, Unfinished):
            return result, steps


def scored(tokens: list[int], top: int = TOP) -> PrefillCall:
    return PrefillCall(f"scored-{len(tokens)}-{top}", tokens, SamplingParams(prompt_logprobs=top))


def as_tuples(scores) -> list[tuple]:
    return [(s.logprob, tuple(s.top_ids), tuple(s.top_logprobs)) for s in scores]


def test_score_rows_reads_each_rows_token_and_its_most_likely():
    torch.manual_seed(0)
    logits = torch.randn(5, 11) * 3
    tokens = [4, 0, 10, 3, 3]
    scores = score_rows(logits, tokens, TOP)
    logp = torch.log_softmax(logits, -1)
    for row, (token, score) in enumerate(zip(tokens, scores)):
        assert score.logprob == pytest.approx(logp[row, token].item(), abs=1e-6)
        assert score.top_ids == logp[row].topk(TOP).indices.tolist()
        assert score.top_logprobs == sorted(score.top_logprobs, reverse=True)
        assert score.rank == 1 + sorted(logp[row].tolist(), reverse=True).index(logp[row, token].item())
    assert [s.rank for s in scores] != [1] * 5  # (the test's rows rank their tokens variously)
    assert [s.top_ids for s in score_rows(logits, tokens, 0)] == [[]] * 5
    assert [s.rank for s in score_rows(logits, tokens, 0)] == [s.rank for s in scores]  # ranked whatever the top
    assert score_rows(logits[:0], [], TOP) == []
    with pytest.raises(ValueError, match="4 rows of logits for 5 tokens"):
        score_rows(logits[:4], tokens, TOP)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_prompt_tokens_scores_are_what_the_target_says_when_it_emits_them(tiny_qwen2_dir, dtype):
    """Generate greedily with log-probabilities, then score prompt + answer: the answer's scores are the same,
    bitwise; and every score matches a dense reference of the engine's own logits."""
    engine = load(tiny_qwen2_dir, dtype)
    [generated] = SpeculativeGenerator(engine, None, SpecOptions("none", 0)).generate(
        [GenerationRequest(PROMPT, max_new_tokens=12, sampling=SamplingParams(logprobs=TOP))])
    text = [*PROMPT, *generated.token_ids]
    target = TargetEngine(load(tiny_qwen2_dir, dtype))
    prefilled, _ = prefill_to_end(target, scored(text))
    assert len(prefilled.prompt_logprobs) == len(text) - 1
    echoed = prefilled.prompt_logprobs[len(PROMPT) - 1:]  # the scores of the generated tokens
    assert len(echoed) == 12 and as_tuples(echoed) == as_tuples(generated.logprobs)
    # A reference: the engine's logits of every row in one plain forward, log-softmaxed.
    reference = load(tiny_qwen2_dir, dtype, caching=False)
    logits = reference.forward([ForwardItem("ref", text, num_logits=len(text))])[0]  # [T, vocab]
    logp = torch.log_softmax(logits.float(), -1)
    want = [logp[i - 1, text[i]].item() for i in range(1, len(text))]
    assert [s.logprob for s in prefilled.prompt_logprobs] == pytest.approx(want, abs=1e-5)
    ranks = [int((logp[i - 1] > logp[i - 1, text[i]]).sum()) + 1 for i in range(1, len(text))]
    assert [s.rank for s in prefilled.prompt_logprobs] == ranks and max(ranks) > 1
    # the Prefill's own first token is the one plain decoding gives after the whole text
    assert prefilled.next_token == int(logits[-1].argmax())


def test_the_scores_are_the_same_however_the_prompt_is_cut(tiny_qwen2_dir, monkeypatch):
    """Whole, in bounded runs of rows (each a step of its own), and chunked beside a running stream."""
    whole, steps = prefill_to_end(TargetEngine(load(tiny_qwen2_dir)), scored(PROMPT))
    assert steps == 1
    monkeypatch.setattr(engine_module, "SCORED_ROWS_PER_STEP", 4)
    target = TargetEngine(load(tiny_qwen2_dir))
    bounded, steps = prefill_to_end(target, scored(PROMPT))
    assert steps == -(-len(PROMPT) // 4)  # a step per 4 rows
    assert as_tuples(bounded.prompt_logprobs) == as_tuples(whole.prompt_logprobs)
    assert bounded.next_token == whole.next_token
    monkeypatch.setattr(engine_module, "SCORED_ROWS_PER_STEP", 256)
    chunked_target = TargetEngine(load(tiny_qwen2_dir), prefill_chunk_tokens=3)
    ok(chunked_target.run_batch([PrefillCall("stream", [5, 6, 7], SamplingParams())]))

    def stream_step(t: TargetEngine) -> list:
        return [VerifyCall("stream", len(t.sequences["stream"].history), [], [])]

    chunked, steps = prefill_to_end(chunked_target, scored(PROMPT), beside=stream_step)
    assert steps > 3  # three tokens a step beside the stream
    assert as_tuples(chunked.prompt_logprobs) == as_tuples(whole.prompt_logprobs)
    assert chunked.next_token == whole.next_token


def test_a_scored_prompt_starts_on_the_prefix_cache_only_where_its_blocks_scores_are_kept(tiny_qwen2_dir):
    """Blocks a plain prompt left hold KV only: a scored prompt computes them. Its own blocks keep their scores
    too: the same prompt again, or another answer after the same context (lm-eval's multiple choice), starts on
    them and feeds the prefix's last token again (its row scores the next one); every score and decision is
    bitwise a cache-off target's. Another top count finds nothing kept."""
    target = TargetEngine(load(tiny_qwen2_dir))
    uncached = TargetEngine(load(tiny_qwen2_dir, caching=False))
    plain = ok(target.run_batch([PrefillCall("a", PROMPT, SamplingParams())]))[0]
    ok(target.run_batch([ReleaseCall("a")]))
    first, _ = prefill_to_end(target, scored(PROMPT))
    assert first.reused_tokens == 0 and first.next_token == plain.next_token
    ok(target.run_batch([ReleaseCall(scored(PROMPT).seq_id)]))
    again, _ = prefill_to_end(target, scored(PROMPT))
    full_blocks = (len(PROMPT) - 1) // 4 * 4
    assert again.reused_tokens == full_blocks - 1
    assert as_tuples(again.prompt_logprobs) == as_tuples(first.prompt_logprobs)
    assert again.next_token == first.next_token
    other_answer = [*PROMPT[:14], 7, 90, 12, 61]  # the context's first three blocks, then another ending
    answer = PrefillCall("answer", other_answer, SamplingParams(prompt_logprobs=TOP))
    from_cache, _ = prefill_to_end(target, answer)
    computed, _ = prefill_to_end(uncached, answer)
    assert from_cache.reused_tokens == 11 and computed.reused_tokens == 0
    assert as_tuples(from_cache.prompt_logprobs) == as_tuples(computed.prompt_logprobs)
    assert from_cache.next_token == computed.next_token
    other_top, _ = prefill_to_end(target, scored(PROMPT, top=TOP - 1))
    assert other_top.reused_tokens == 0
    after = ok(target.run_batch([PrefillCall("b", PROMPT, SamplingParams())]))[0]
    assert after.reused_tokens == full_blocks and after.prompt_logprobs is None


def test_a_scored_prompt_on_a_held_block_leaves_its_holders_kv_exact(tiny_qwen2_dir):
    """The prefix's last block is still held by the prompt that scored it: feeding its last token again writes into
    a private copy, so the holder decodes on as a cache-off target does."""
    target = TargetEngine(load(tiny_qwen2_dir))
    uncached = TargetEngine(load(tiny_qwen2_dir, caching=False))
    held = PrefillCall("held", PROMPT, SamplingParams(prompt_logprobs=TOP))
    reference = PrefillCall("held", PROMPT, SamplingParams())
    assert prefill_to_end(target, held)[0].next_token == prefill_to_end(uncached, reference)[0].next_token
    second, _ = prefill_to_end(target, PrefillCall("second", PROMPT, SamplingParams(prompt_logprobs=TOP)))
    assert second.reused_tokens > 0
    for _ in range(6):  # the holder decodes over its blocks, one of which the second prompt rewrote its own copy of
        steps = [ok(t.run_batch([VerifyCall("held", len(t.sequences["held"].history), [], [])]))[0]
                 for t in (target, uncached)]
        assert steps[0].next_token == steps[1].next_token
    assert target.sequences["held"].history == uncached.sequences["held"].history


def test_scores_are_the_raw_logits_whatever_penalties_and_bias_do(tiny_qwen2_dir):
    target = TargetEngine(load(tiny_qwen2_dir))
    plain, _ = prefill_to_end(target, scored(PROMPT))
    adjusted = PrefillCall("adjusted", PROMPT, SamplingParams(prompt_logprobs=TOP, repetition_penalty=1.7,
                                                              logit_bias=((plain.next_token, -100.0),)))
    result, _ = prefill_to_end(target, adjusted)
    assert as_tuples(result.prompt_logprobs) == as_tuples(plain.prompt_logprobs)
    assert result.next_token != plain.next_token  # the bias did act on the decision


def test_only_a_prompt_is_scored_and_once(tiny_qwen2_dir):
    """A rebuild (prompt_len > 0) scores nothing; a Verify after a scored Prefill carries no prompt scores; a
    one-token prompt has nothing to score; the range is checked."""
    target = TargetEngine(load(tiny_qwen2_dir))
    first, _ = prefill_to_end(target, scored(PROMPT, top=0))
    assert all(s.top_ids == [] for s in first.prompt_logprobs) and len(first.prompt_logprobs) == len(PROMPT) - 1
    seq = target.sequences[scored(PROMPT, top=0).seq_id]
    assert seq.prompt_scores is None  # handed over with the reply, not kept
    verdict = ok(target.run_batch([VerifyCall(scored(PROMPT, top=0).seq_id, len(seq.history), [], [])]))[0]
    assert not hasattr(verdict, "prompt_logprobs")
    rebuild = PrefillCall("moved", [*PROMPT, first.next_token], SamplingParams(prompt_logprobs=TOP),
                          prompt_len=len(PROMPT))
    assert ok(target.run_batch([rebuild]))[0].prompt_logprobs is None
    single, _ = prefill_to_end(target, scored([42]))
    assert single.prompt_logprobs == []
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be in 0..20"):
        SamplingParams(prompt_logprobs=21)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_a_heads_prompt_scored_in_steps_proposes_what_it_proposes_unscored(tiny_qwen2_dir, kind, monkeypatch):
    """Scoring feeds the heads the same rows (EAGLE's KV grows with each step of rows): the first proposal is the
    unscored Prefill's, and the scores the plain target's."""
    from tandem.heads.serving import drafter_for
    from target_worker.engine import Proposed
    from tests.heads.tiny_heads import tiny_heads

    def first_proposal(scoring: bool):
        engine = load(tiny_qwen2_dir)
        target = TargetEngine(engine, drafter=drafter_for(tiny_heads(engine, kind), engine))
        call = PrefillCall("heads", PROMPT, SamplingParams(prompt_logprobs=TOP if scoring else None), propose=6)
        result, steps = prefill_to_end(target, call)
        assert isinstance(result, Proposed)
        return result, steps

    plain, _ = first_proposal(False)
    monkeypatch.setattr(engine_module, "SCORED_ROWS_PER_STEP", 8)
    scoring, steps = first_proposal(True)
    assert steps == 3  # 21 rows, 8 a step
    assert (scoring.proposal.tokens, scoring.proposal.parents) == (plain.proposal.tokens, plain.proposal.parents)
    assert scoring.result.next_token == plain.result.next_token
    unheaded, _ = prefill_to_end(TargetEngine(load(tiny_qwen2_dir)), scored(PROMPT))
    assert as_tuples(scoring.result.prompt_logprobs) == as_tuples(unheaded.prompt_logprobs)


def test_the_in_process_generator_returns_the_prompt_scores_with_speculation_on(tiny_qwen2_dir):
    """Through the one loop (n-gram speculation): the first Prefill's scores, whatever rounds follow."""
    engine = load(tiny_qwen2_dir)
    sampling = SamplingParams(prompt_logprobs=TOP, logprobs=TOP)
    [result] = SpeculativeGenerator(engine, None, SpecOptions("ngram", 4)).generate(
        [GenerationRequest(PROMPT, max_new_tokens=8, sampling=sampling)])
    direct, _ = prefill_to_end(TargetEngine(load(tiny_qwen2_dir)), scored(PROMPT))
    assert as_tuples(result.prompt_logprobs) == as_tuples(direct.prompt_logprobs)
    assert len(result.logprobs) == len(result.token_ids) == 8
