"""Self-distillation text: prompts made from the machine's files, the target's batched greedy answers to
them, and those answers read back as a corpus of conversations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine import FeatureSpec, ForwardItem, ModelEngine
from tandem.errors import InvalidRequestError
from tandem.heads.config import HeadsConfig
from tandem.heads.store import build_heads
from tandem.heads.train.answers import AnswerCount, answered_ids, generate_answers, read_answers
from tandem.heads.train.corpus import CorpusSettings, build_corpus
from tandem.heads.train.eagle_train import EagleObjective
from tandem.heads.train.features import NO_LABEL, extract_features
from tandem.heads.train.options import AnswerSettings, feature_streams
from tandem.heads.train.prompts import KIND_SHARES, TrainingPrompt, build_prompts, translation_prompts
from tandem.heads.train.shards import FeatureShards
from tandem.heads.train.sources import CODE, DOC, SourceFile, user_files
from tandem.tokenizer import encode_prompt, load_tokenizer

_MODULE = '''"""A module."""

import os


def parse_size(text: str, unit: str = "B") -> int:
    """Parse a human-readable size such as ``10 MiB`` into a number of bytes.

    Raises ValueError for text that names no size.
    """
    number, _, suffix = text.partition(" ")
    return int(number) * {{"B": 1, "KiB": 1024}}[suffix or unit]


def _private(x):
    """A private helper whose docstring is long enough to be chosen, but it is private."""
    return x


def join_paths_{n}(base, *parts):
    """Join ``parts`` onto ``base`` the way the operating system expects, normalising separators."""
    return os.path.join(base, *parts)
'''
_DOC = """Project {n}
==========

This project keeps a small index of the files in a directory and answers questions about them quickly.
It was written because the existing tools were slow on large trees and hard to extend.

The index is rebuilt whenever a file changes. Readers never block: they see the old index until the new one
is complete, and then switch to it in one step. This keeps every query consistent.

Configuration lives in a single file in the user's home directory. Every option has a default, and the
program explains any value it cannot use, naming the option and the value it expected.
"""


@pytest.fixture(scope="module")
def machine_files(tmp_path_factory) -> list[SourceFile]:
    root = tmp_path_factory.mktemp("machine")
    files = []
    for n in range(6):
        code = root / f"pkg{n}.py"
        code.write_text(_MODULE.format(n=n))
        # A real installed distribution, so the questions about packages have a summary to use.
        files.append(SourceFile(code, CODE, "pytest 9", "MIT", f"pkg{n}.py"))
        doc = root / f"README{n}.md"
        doc.write_text(_DOC.format(n=n))
        files.append(SourceFile(doc, DOC, f"debian doc{n}", "GPL-2+", f"doc{n}/README.md"))
    return files


def test_prompts_are_seeded_and_mix_every_kind(machine_files):
    prompts = build_prompts(machine_files, 60, seed=3)
    assert len(prompts) == 60
    assert prompts == build_prompts(machine_files, 60, seed=3)
    assert prompts != build_prompts(machine_files, 60, seed=4)
    assert len({p.id for p in prompts}) == 60
    assert {p.kind for p in prompts} == set(KIND_SHARES)
    assert {p.kind for p in prompts[:len(KIND_SHARES)]} == set(KIND_SHARES)  # any prefix is a mix


def test_function_prompts_are_a_signature_and_docstring_without_the_body(machine_files):
    functions = [p.text for p in build_prompts(machine_files, 40, seed=0) if p.kind == "function"]
    assert functions
    for text in functions:
        assert text.startswith(("def parse_size(", "def join_paths_"))
        assert text.rstrip().endswith('"""')  # the body is the target's to write
        assert "return" not in text and "_private" not in text


def test_prompts_from_documentation_quote_it(machine_files):
    prompts = build_prompts(machine_files, 80, seed=1)
    summaries = [p.text for p in prompts if p.kind == "summarize"]
    assert summaries and all("index" in text or "option" in text for text in summaries)
    assert all(p.text.startswith("Translate English to German: ") for p in prompts if p.kind == "to_german")


def test_translation_prompts_give_the_german_back_and_skip_what_is_not_a_sentence():
    prompts = translation_prompts([("to_german-00004", "Die Datei wird  gelöscht, wenn du fertig bist."),
                                   ("to_german-00005", "Ja"), ("to_german-00006", "```\ncode\n```")])
    assert prompts == [TrainingPrompt("translate-00004", "translate",
                                      "Translate German to English: Die Datei wird gelöscht, wenn du fertig bist.")]


def test_a_prompt_count_below_one_is_refused(machine_files):
    with pytest.raises(InvalidRequestError, match="--prompts must be >= 1, got 0"):
        build_prompts(machine_files, 0, seed=0)


# ----- the target's answers ----------------------------------------------------------------


def _prompts(n: int) -> list[TrainingPrompt]:
    return [TrainingPrompt(f"math-{i:05d}", "math", f"What is {i} plus {2 * i + 1}? " + "Think. " * i)
            for i in range(n)]


def _engine(model_dir: Path) -> ModelEngine:
    return ModelEngine.load(EngineConfig(model_dir, dtype="float32", kv_cache_tokens=4096))


def _greedy_alone(engine: ModelEngine, prompt_ids: list[int], max_new: int, stop_ids: frozenset[int]) -> list[int]:
    """The plain decoding loop, one sequence: what each batched answer must equal."""
    out: list[int] = []
    logits = engine.forward([ForwardItem("alone", prompt_ids, prompt=True)])[0]
    while True:
        token = int(logits[-1].argmax())
        if token in stop_ids or len(out) >= max_new:
            break
        out.append(token)
        logits = engine.forward([ForwardItem("alone", [token])])[0]
    engine.release("alone")
    return out


def test_batched_answers_equal_each_prompt_decoded_alone_and_resume(tiny_served_dir, tmp_path):
    engine, tokenizer = _engine(tiny_served_dir), load_tokenizer(tiny_served_dir)
    prompts = _prompts(5)
    settings = AnswerSettings(max_new_tokens=12, batch_size=3)  # more prompts than slots: prefills join mid-run
    out = tmp_path / "answers.jsonl"
    assert generate_answers(engine, tokenizer, prompts, out, frozenset(), settings) == AnswerCount(5, 0)
    rows = {row["id"]: row for row in read_answers(out)}
    assert set(rows) == {p.id for p in prompts}
    for prompt in prompts:
        alone = _greedy_alone(engine, encode_prompt(tokenizer, prompt.text, chat=True), 12, frozenset())
        row = rows[prompt.id]
        assert row["messages"] == [{"role": "user", "content": prompt.text},
                                   {"role": "assistant", "content": tokenizer.decode(alone)}]
        assert (row["answer_tokens"], row["stop"], row["kind"]) == (12, "length", "math")
    assert not any(engine.kv_cache.has_sequence(p.id) for p in prompts)  # every answer's KV released

    # A run cut short (its last line half written) continues with the prompts the file lacks.
    lines = out.read_text().splitlines()
    out.write_text("\n".join(lines[:3]) + "\n" + lines[3][:20])
    assert answered_ids(out) == {json.loads(line)["id"] for line in lines[:3]}
    assert generate_answers(engine, tokenizer, prompts, out, frozenset(), settings) == AnswerCount(2, 0)
    assert {row["id"]: row for row in read_answers(out)} == rows


def test_an_answer_ends_before_the_stop_token_the_target_chooses(tiny_served_dir, tmp_path):
    engine, tokenizer = _engine(tiny_served_dir), load_tokenizer(tiny_served_dir)
    prompt = _prompts(1)[0]
    free = _greedy_alone(engine, encode_prompt(tokenizer, prompt.text, chat=True), 12, frozenset())
    stop = free[4]  # a token the target says: treated as the end of its turn
    out = tmp_path / "answers.jsonl"
    generate_answers(engine, tokenizer, [prompt], out, frozenset({stop}), AnswerSettings(max_new_tokens=12))
    (row,) = read_answers(out)
    cut = free.index(stop)
    assert (row["answer_tokens"], row["stop"]) == (cut, "stop_token")
    assert row["messages"][1]["content"] == tokenizer.decode(free[:cut])


def test_prompts_longer_than_the_limit_are_skipped(tiny_served_dir, tmp_path):
    engine, tokenizer = _engine(tiny_served_dir), load_tokenizer(tiny_served_dir)
    prompts = _prompts(4)
    limit = len(encode_prompt(tokenizer, prompts[1].text, chat=True))
    out = tmp_path / "answers.jsonl"
    count = generate_answers(engine, tokenizer, prompts, out, frozenset(),
                             AnswerSettings(max_new_tokens=3, max_prompt_tokens=limit))
    assert count == AnswerCount(written=2, too_long=2)
    assert [row["id"] for row in read_answers(out)] == ["math-00000", "math-00001"]


def test_answer_settings_refuse_nonsense():
    with pytest.raises(InvalidRequestError, match="--batch-size must be >= 1, got 0"):
        AnswerSettings(batch_size=0)


# ----- answers read back as a corpus ---------------------------------------------------------


def test_conversations_become_one_chat_template_sequence_each(tiny_served_dir, tmp_path):
    tokenizer = load_tokenizer(tiny_served_dir)
    conversations = [[{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}" * 3}]
                     for i in range(20)]
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps({"id": str(i), "messages": m}) + "\n" for i, m in enumerate(conversations)))
    corpus = build_corpus(user_files([path]), tokenizer, CorpusSettings(tokens=10**6, seq_len=512, seed=0))
    expected = {tuple(tokenizer.encode(tokenizer.apply_chat_template(m, tokenize=False), add_special_tokens=False))
                for m in conversations}
    got = [tuple(seq) for seq in corpus.train + corpus.held_back]
    assert len(got) == 20 and set(got) == expected
    order = [expected_index for seq in got for expected_index, m in enumerate(conversations)
             if seq == tuple(tokenizer.encode(tokenizer.apply_chat_template(m, tokenize=False),
                                              add_special_tokens=False))]
    assert order != sorted(order)  # visited in a seeded order: the held-back ones are a random sample


def test_an_answer_cut_by_its_length_limit_ends_at_its_last_token(tiny_served_dir, tmp_path):
    """The target never ended a cut-off answer: the template's end of turn must not become a label."""
    tokenizer = load_tokenizer(tiny_served_dir)
    # A template that closes each turn, as real ones do (the tiny model's does not).
    tokenizer.chat_template = ("{% for m in messages %}<s>{{ m['content'] }}{{ eos_token }}{% endfor %}"
                               "{% if add_generation_prompt %}<s>{% endif %}")
    turns = [{"role": "user", "content": "question"}, {"role": "assistant", "content": "answer " * 12}]
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps({"messages": turns, "stop": "length"}) + "\n"
                    + json.dumps({"messages": turns, "stop": "stop_token"}) + "\n")
    corpus = build_corpus(user_files([path]), tokenizer, CorpusSettings(tokens=10**6, seq_len=512, seed=0))
    whole = tokenizer.encode(tokenizer.apply_chat_template(turns, tokenize=False), add_special_tokens=False)
    cut, ended = sorted(corpus.train + corpus.held_back, key=len)
    assert ended == whole and cut == whole[: len(cut)] and len(cut) < len(whole)
    assert tokenizer.decode(cut).endswith("answer") and tokenizer.decode(whole).endswith("answer</s>")


def test_a_malformed_conversation_names_its_line(tiny_served_dir, tmp_path):
    path = tmp_path / "answers.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n"
                    + json.dumps({"messages": [{"role": "user"}]}) + "\n")
    with pytest.raises(InvalidRequestError, match=r"answers.jsonl line 2: \"messages\" must be a list"):
        build_corpus(user_files([path]), load_tokenizer(tiny_served_dir), CorpusSettings(10**6, 64, 0))


def test_the_heads_learn_the_answers_not_the_prompts(tiny_served_dir, tmp_path):
    """Prompt positions carry no label through features, the draft vocabulary's counts and the objectives."""
    tokenizer = load_tokenizer(tiny_served_dir)
    conversations = [[{"role": "user", "content": f"question {i} " * (1 + i % 4)},
                      {"role": "assistant", "content": f"the answer is {i}" * 2}] for i in range(12)]
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations))
    corpus = build_corpus(user_files([path]), tokenizer, CorpusSettings(tokens=10**6, seq_len=512, seed=0))
    for seq, first in zip(corpus.train + corpus.held_back, corpus.train_learn_from + corpus.held_back_learn_from):
        # The label at `first` is the answer's first token: everything before is the prompt.
        # (The tiny tokenizer has no space token: "the answer is" reads back as "theansweris".)
        assert "answer" not in tokenizer.decode(seq[: first + 1]) and "question" in tokenizer.decode(seq[:first])
        assert tokenizer.decode(seq[first + 1:]).startswith("<s>theansweris")  # the template's turn mark first
    learned = corpus.summary["learned_tokens"]
    assert learned["train"] == sum(len(s) - f for s, f in zip(corpus.train, corpus.train_learn_from))

    engine = _engine(tiny_served_dir)
    spec = FeatureSpec(feature_streams("eagle", engine.config))
    shards = FeatureShards(extract_features(engine, spec, corpus, tmp_path / "features", seqs_per_forward=2))
    refs = [(i, j) for i, shard in enumerate(shards.train) for j in range(len(shard.lengths))]
    batch = shards.batch(refs)
    for row, (seq, first) in enumerate(zip(corpus.train, corpus.train_learn_from)):
        assert batch.tokens[row, : len(seq)].tolist() == seq
        assert (batch.labels[row, :first] == NO_LABEL).all() and (batch.labels[row, first: len(seq)] >= 0).all()
    counts = shards.counts("labels", engine.config.vocab_size)
    assert int(counts.sum()) == learned["train"]

    cfg = HeadsConfig(kind="eagle", hidden_size=engine.config.hidden_size, vocab_size=engine.config.vocab_size,
                      draft_vocab_size=engine.config.vocab_size, feature_streams=spec.streams,
                      num_attention_heads=engine.config.num_heads, num_kv_heads=engine.config.num_kv_heads,
                      head_dim=engine.config.head_dim, intermediate_size=32, rms_norm_eps=1e-6)
    head = build_heads(cfg)
    t2d = torch.arange(engine.config.vocab_size)
    objective = EagleObjective(head, t2d, engine.model.embed_tokens.weight.detach().float(), steps=2)
    step1, step2 = objective.predictions(batch)
    # Step j at pair t guesses label t + j: counted where that position is inside the sequence and learned.
    for step, (_, labels) in ((1, step1), (2, step2)):
        expected = sum(sum(1 for t in range(len(seq) - 1) if t + step < len(seq) and t + step >= first)
                       for seq, first in zip(corpus.train, corpus.train_learn_from))
        assert labels.numel() == expected and (labels >= 0).all()


def test_answers_from_the_command_line_build_prompts_from_the_machine_and_resume(tiny_served_dir, tmp_path, capsys):
    from tandem.cli import main

    out = tmp_path / "answers.jsonl"
    flags = ["heads", "answers", "--target", str(tiny_served_dir), "--out", str(out), "--prompts", "12",
             "--max-new-tokens", "4", "--batch-size", "4"]
    assert main(flags) == 0
    rows = read_answers(out)
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    # Every kind the machine's files allow (the random tiny target never ends a German answer, so none come back).
    err = captured.err
    skipped = int(err.split("; ")[1].split()[0]) if "skipped" in err else 0  # the tiny tokenizer spends a token a byte
    assert len(rows) + skipped == 12 and {row["kind"] for row in rows} <= set(KIND_SHARES)
    assert len({row["kind"] for row in rows}) > 5
    assert all(row["messages"][0]["role"] == "user" and row["answer_tokens"] == 4 for row in rows)
    assert main(flags) == 0 and read_answers(out) == rows  # nothing left to answer
    assert "0 answers written" in capsys.readouterr().err
    assert main([*flags[:-2], "--batch-size", "0"]) == 2
    assert "--batch-size must be >= 1, got 0" in capsys.readouterr().err


SEAM_TOKENS = 2  # (test_prepare_trains_the_default_heads_on_the_targets_own_answers)


def test_prepare_trains_the_default_heads_on_the_targets_own_answers(tiny_served_dir, tmp_path, monkeypatch,
                                                                     capsys):
    """`tandem heads prepare` writes the target's answers (kept, resumable), then trains on them alone; run
    again, it trains nothing. The catalog's target is swapped for the tiny one, and the plan made small."""
    from tandem.cli import heads as heads_cli
    from tandem.cli import main
    from tandem.heads.train.options import AnswerSettings, PrepareAnswers, TrainOptions

    plan = PrepareAnswers(prompts=8, settings=AnswerSettings(max_new_tokens=6, batch_size=4))
    options = TrainOptions(kind="eagle", tokens=100_000, seq_len=128, steps=3, batch_size=2, checkpoint_every=2,
                           eagle_intermediate_size=32)
    monkeypatch.setattr(heads_cli, "PREPARE_TARGET", str(tiny_served_dir))
    monkeypatch.setattr(heads_cli, "PREPARE_ANSWERS", plan)
    monkeypatch.setattr(heads_cli, "prepare_options", lambda kind: options)
    assert main(["heads", "prepare", "--cache-dir", str(tmp_path)]) == 0
    out = Path(capsys.readouterr().out.strip())
    answers = tmp_path / "answers" / plan.file_name(tiny_served_dir.name)
    assert out == tmp_path / "heads" / f"{tiny_served_dir.name}-eagle"
    rows = read_answers(answers)
    assert rows and all(row["answer_tokens"] <= 6 for row in rows)
    training = json.loads((out / "heads.json").read_text())["training"]
    assert training["corpus"]["source"] == "user" and str(answers) in training["command"]
    assert training["options"] == options.to_json()
    learned = training["corpus"]["learned_tokens"]
    # What a row can teach: its answer as the template reads it back (decoded and encoded again, which may take
    # more tokens: a "<unk>" the tiny model wrote reads back as five characters), the label before its first
    # token, the template's end of turn after an answer that stopped (a cut-off one ends at its last token), and
    # SEAM_TOKENS where the answer's first characters merge with the prompt's last ones when read as one text.
    # A bound of answer_tokens + 1 a row failed in CI (32 > 28) on a machine whose files made other prompts.
    tokenizer = load_tokenizer(tiny_served_dir)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "q"},
                                              {"role": "assistant", "content": "MARK"}], tokenize=False)
    end_of_turn = len(tokenizer.encode(rendered[rendered.rindex("MARK") + 4:], add_special_tokens=False))
    most = sum(len(tokenizer.encode(row["messages"][-1]["content"], add_special_tokens=False)) + 1 + SEAM_TOKENS
               + (0 if row["stop"] == "length" else end_of_turn) for row in rows)
    tokens = training["corpus"]["tokens"]
    learned_all = learned["train"] + learned["held_back"]
    assert 0 < learned_all <= most and learned_all < tokens["train"] + tokens["held_back"]  # never the prompts
    assert not (out.parent / f".{out.name}.work").exists()  # the features went with the run
    assert main(["heads", "prepare", "--cache-dir", str(tmp_path)]) == 0
    assert "already prepared" in capsys.readouterr().err
    # Another answers plan (a release that answers with more tokens) is another corpus: trained again on it.
    longer = PrepareAnswers(prompts=8, settings=AnswerSettings(max_new_tokens=7, batch_size=4))
    monkeypatch.setattr(heads_cli, "PREPARE_ANSWERS", longer)
    assert main(["heads", "prepare", "--cache-dir", str(tmp_path)]) == 0
    assert "already prepared" not in capsys.readouterr().err
    origins = json.loads((out / "heads.json").read_text())["training"]["corpus"]["origins"]
    assert [Path(origin).name for origin in origins] == [longer.file_name(tiny_served_dir.name)]
