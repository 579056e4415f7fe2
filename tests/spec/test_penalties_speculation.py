"""Greedy decoding with penalties and a logit bias: speculative output is still the target alone's, for
every proposer and for trees, because each verified row is adjusted for the drafts before it.

A row judged against the committed text alone (the drafts on its path left out) is the defect these
tests must catch: it is run too, and its output must differ.
"""

from __future__ import annotations

import pytest

import target_worker.engine
from tandem.sampling_params import SamplingParams, logit_bias_pairs
from tests.spec.test_greedy_equivalence import PROMPTS, load, run

# Strong enough that a tiny random model's favourite loops are broken: the penalties decide many tokens.
PENALISED = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.6, presence_penalty=0.4,
                           logit_bias=logit_bias_pairs({7: 0.8, 61: -3.0}))


@pytest.fixture(scope="module")
def target(tiny_qwen2_dir):
    return load(tiny_qwen2_dir)


@pytest.fixture(scope="module")
def plain(target):
    """Target-only output with the penalties: the reference every speculative run must equal."""
    return [r.token_ids for r in run(target, None, sampling=PENALISED)]


def test_penalties_change_the_target_alone_output(target, plain):
    unpenalised = [r.token_ids for r in run(target, None)]
    assert plain != unpenalised  # otherwise the equalities below would prove nothing about penalties


@pytest.mark.parametrize("method,tree", [("draft-same", "off"), ("draft", "off"), ("ngram", "off"),
                                         ("hybrid", "off"), ("draft", "on"), ("hybrid", "on")])
def test_speculative_output_equals_the_target_alone(target, plain, tiny_qwen2_dir, tiny_qwen2_other_dir, method,
                                                    tree):
    draft = {"draft-same": lambda: load(tiny_qwen2_dir), "draft": lambda: load(tiny_qwen2_other_dir),
             "hybrid": lambda: load(tiny_qwen2_other_dir), "ngram": lambda: None}[method]()
    results = run(target, draft, method.removesuffix("-same"), sampling=PENALISED, k_max=4, ngram_max=3,
                  hybrid_min_match=2, tree=tree, tree_width=2)
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats.drafted for r in results) > 0
    if method != "ngram":  # (penalties turn down most repeats, which are all an n-gram lookup proposes)
        assert sum(r.stats.accepted for r in results) > 0  # drafts were kept, under rows that counted them
    if tree == "on":
        assert sum(r.stats.tree_rounds for r in results) > 0
    if method == "draft-same":  # the same model drafting applies the same penalties: it is always right
        assert all(r.stats.accepted == r.stats.drafted for r in results)
    assert target.kv_cache.num_free_blocks == target.kv_cache.num_blocks


def test_rows_judged_without_their_drafts_change_the_output(target, plain, tiny_qwen2_dir, monkeypatch):
    """The defect: every row adjusted for the committed text only. The output drifts from the target's."""
    monkeypatch.setattr(target_worker.engine, "row_paths_of", lambda drafts, parents: [[]] * (len(drafts) + 1))
    results = run(target, load(tiny_qwen2_dir), "draft", sampling=PENALISED, k_max=4)
    assert [r.token_ids for r in results] != plain


def test_a_large_bias_forces_its_token_and_speculation_agrees(target, tiny_qwen2_dir):
    forced = SamplingParams(logit_bias=((13, 100.0),))
    for draft, method in ((None, "none"), (load(tiny_qwen2_dir), "draft")):
        results = run(target, draft, method, prompts=PROMPTS[:2], n=12, sampling=forced, k_max=4)
        assert all(r.token_ids == [13] * 12 for r in results)


@pytest.mark.slow
def test_smollm2_repetition_penalty_equals_transformers_and_speculation(smollm2_dir):
    """On a real model and real text: our plain decoding with a repetition penalty is transformers'
    ``generate(repetition_penalty=...)``, and every speculative method gives that same text."""
    import torch
    from transformers import AutoModelForCausalLM

    from draft_worker.engine import early_exit_engine
    from tandem.tokenizer import encode_prompt, load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    prompt = encode_prompt(tok, "Repeat after me five times: the cat sat on the mat.", chat=True)
    sampling, n = SamplingParams(repetition_penalty=1.3), 40
    hf = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    with torch.inference_mode():
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n,
                          repetition_penalty=1.3, pad_token_id=tok.eos_token_id)
    reference = out[0, len(prompt):].tolist()
    engine = load(smollm2_dir)
    plain = run(engine, None, prompts=[prompt], n=n, sampling=sampling, stop=frozenset())[0].token_ids
    assert plain == reference
    assert plain != run(engine, None, prompts=[prompt], n=n)[0].token_ids  # the penalty changed the text
    for draft, method in ((early_exit_engine(engine, 20), "early-exit"), (None, "ngram")):
        result = run(engine, draft, method, prompts=[prompt], n=n, sampling=sampling, k_max=4, ngram_max=3)[0]
        assert result.token_ids == plain
        assert result.stats.drafted > 0
        if method == "early-exit":  # (the penalty turns down the repeats an n-gram lookup proposes)
            assert result.stats.accepted > 0


def test_seeded_sampling_with_penalties_is_plain_seeded_decoding(target, tiny_qwen2_other_dir):
    """A seeded request keeps the target's own seeded draw at each position, drawn from that position's
    adjusted row: its output with penalties is the plain seeded output, whatever proposed the drafts."""
    sampling = SamplingParams(temperature=0.8, seed=99, repetition_penalty=1.2, frequency_penalty=0.5,
                              presence_penalty=0.5, logit_bias=((7, 1.0),))
    alone = [r.token_ids for r in run(target, None, sampling=sampling)]
    assert alone != [r.token_ids for r in run(target, None, sampling=SamplingParams(temperature=0.8, seed=99))]
    for method, tree in (("draft", "off"), ("hybrid", "on")):
        results = run(target, load(tiny_qwen2_other_dir), method, sampling=sampling, k_max=4, ngram_max=3,
                      hybrid_min_match=2, tree=tree, tree_width=2)
        assert [r.token_ids for r in results] == alone


def test_min_tokens_holds_stop_tokens_back_and_speculation_agrees(target, tiny_qwen2_dir, tiny_qwen2_other_dir):
    """vLLM's min_tokens: the stop tokens are -inf on every row before it, each row for its own drafted path. A
    stop token the model writes early ends the plain text there; held back, the text runs past it, and every
    proposer gives the target alone's text."""
    free = [r.token_ids for r in run(target, None, n=12)]
    stop = free[2][1]  # the second token of a prompt's answer: with it as a stop token, that answer ends at once
    ended = [r.token_ids for r in run(target, None, n=12, stop=frozenset({stop}))]
    assert len(ended[2]) == 2 and ended[2][-1] == stop
    held = SamplingParams(min_tokens=8, min_tokens_stop_ids=(stop,))
    plain = [r.token_ids for r in run(target, None, n=12, stop=frozenset({stop}), sampling=held)]
    assert all(stop not in tokens[:8] for tokens in plain) and len(plain[2]) > 2
    for method, tree in (("draft-same", "off"), ("draft", "off"), ("ngram", "off"), ("hybrid", "on")):
        draft = {"draft-same": lambda: load(tiny_qwen2_dir), "draft": lambda: load(tiny_qwen2_other_dir),
                 "hybrid": lambda: load(tiny_qwen2_other_dir), "ngram": lambda: None}[method]()
        results = run(target, draft, method.removesuffix("-same"), n=12, stop=frozenset({stop}), sampling=held,
                      k_max=4, ngram_max=3, hybrid_min_match=2, tree=tree, tree_width=2)
        assert [r.token_ids for r in results] == plain, method


# vLLM's allowed_token_ids: a small set, the repeats an n-gram lookup finds included.
ALLOWED = SamplingParams(allowed_token_ids=(3, 9, 17, 21, 33, 40, 52))


def test_allowed_token_ids_equal_transformers_and_every_method(target, tiny_qwen2_dir, tiny_qwen2_other_dir):
    """Plain decoding with allowed_token_ids is transformers' generate with the same ids allowed at every step
    (its prefix_allowed_tokens_fn), and every speculative method, trees included, gives that same text."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen2_dir), dtype=torch.float32).eval()
    plain = [r.token_ids for r in run(target, None, sampling=ALLOWED, n=24)]
    for prompt, ours in zip(PROMPTS, plain):
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=24, min_new_tokens=24,
                              prefix_allowed_tokens_fn=lambda batch, ids: list(ALLOWED.allowed_token_ids),
                              pad_token_id=0)
        assert ours == out[0, len(prompt):].tolist()
        assert set(ours) <= set(ALLOWED.allowed_token_ids)
    assert plain != [r.token_ids for r in run(target, None, n=24)]  # the mask decided tokens
    for method, tree in (("draft", "off"), ("hybrid", "on"), ("ngram", "off"), ("draft", "on")):
        draft = None if method == "ngram" else load(tiny_qwen2_other_dir)
        results = run(target, draft, method, sampling=ALLOWED, n=24, k_max=4, ngram_max=3, hybrid_min_match=2,
                      tree=tree, tree_width=2)
        assert [r.token_ids for r in results] == plain, (method, tree)
        assert sum(r.stats.accepted for r in results) > 0  # drafts within the allowed ids were kept


def test_bad_words_keep_out_of_the_text_and_every_method_agrees(target, tiny_qwen2_dir, tiny_qwen2_other_dir):
    """vLLM's bad_words (as the coordinator's token runs): a one-token word and a two-token run that the plain
    text holds are absent from the banned text, and every speculative method, trees included, gives that text
    (each row bans for its own path, drafts included)."""
    free = [r.token_ids for r in run(target, None, n=16)]
    single = free[0][3]
    pair = next((a, b) for text in free for a, b in zip(text, text[1:]) if single not in (a, b))
    banned = SamplingParams(bad_word_ids=((single,), pair))
    plain = [r.token_ids for r in run(target, None, sampling=banned, n=16)]
    assert plain != free
    for text in plain:
        assert single not in text and pair not in list(zip(text, text[1:]))
    for method, tree in (("draft", "off"), ("hybrid", "on"), ("ngram", "off")):
        draft = None if method == "ngram" else load(tiny_qwen2_other_dir)
        results = run(target, draft, method, sampling=banned, n=16, k_max=4, ngram_max=3, hybrid_min_match=2,
                      tree=tree, tree_width=2)
        assert [r.token_ids for r in results] == plain, (method, tree)
