"""`tandem generate`: the JSON contract, and bad input refused before any work."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from tandem.cli import main


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem", *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
@pytest.mark.parametrize("method", ["none", "early-exit", "ngram", "hybrid"])
def test_generate_json_on_smollm2(smollm2_dir, method):
    draft = ["--draft", str(smollm2_dir)] if method == "hybrid" else []
    proc = run_cli("generate", "Name three colors.", "--chat", "--target", str(smollm2_dir), "--method", method,
                   *draft, "--max-new-tokens", "24", "--dtype", "float32", "--json")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["text"].strip() and 0 < len(out["token_ids"]) <= 24
    for key in ("tokens_per_s", "drafted", "accepted", "rounds", "mean_accepted_len"):
        assert key in out["stats"]
    assert out["stats"]["tokens_per_s"] > 0
    if method == "none":
        assert out["stats"]["drafted"] == 0


@pytest.mark.slow
def test_methods_agree_on_greedy_text(smollm2_dir):
    outs = []
    for method in ("none", "early-exit"):
        proc = run_cli("generate", "def square(x):", "--target", str(smollm2_dir), "--method", method,
                       "--max-new-tokens", "16", "--dtype", "float32", "--json")
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1])["token_ids"])
    assert outs[0] == outs[1]


@pytest.mark.parametrize("flags,message", [
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["-k", "-2"], "k (draft tokens per round) must be in 0..15"),
    (["-k", "40"], "k (draft tokens per round) must be in 0..15"),
    (["--top-k", "-1"], "top_k must be >= 0"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be positive"),
    (["--method", "draft"], "needs a draft model"),
])
def test_bad_flags_fail_fast_with_a_named_error(flags, message, capsys, monkeypatch):
    from tandem import model_store

    def no_model_work(*args, **kwargs):
        raise AssertionError("a model was resolved before the flags were validated")

    monkeypatch.setattr(model_store, "resolve_model", no_model_work)
    assert main(["generate", "hi", "--target", "/nonexistent", *flags]) == 2
    assert message in capsys.readouterr().err


def test_unknown_method_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as info:
        main(["generate", "hi", "--method", "medusa"])
    assert info.value.code == 2
    assert "invalid choice: 'medusa'" in capsys.readouterr().err


@pytest.mark.slow
def test_draft_with_another_tokenizer_is_refused_before_weights_load(smollm2_dir, tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    other = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    other.pre_tokenizer = pre_tokenizers.Whitespace()
    draft = tmp_path / "draft"
    draft.mkdir()
    PreTrainedTokenizerFast(tokenizer_object=other, unk_token="[UNK]").save_pretrained(draft)
    shutil.copy(smollm2_dir / "config.json", draft / "config.json")
    (draft / "model.safetensors").write_bytes(b"never read: the tokenizer check comes first")
    code = main(["generate", "hi", "--target", str(smollm2_dir), "--draft", str(draft), "--method", "draft"])
    assert code == 2
    assert "tokenizer" in capsys.readouterr().err
