"""``load_tokenizer`` gives what ``AutoTokenizer.from_pretrained`` gives, without loading the model's config."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tiny_models import TINY_COMMON, save_tiny_model, save_tiny_tokenizer

REPO_ROOT = Path(__file__).resolve().parents[1]

TEXTS = ("Hello world", "def f(x):\n    return x**2  # unicode: \u00fc\u00f1\u00ee \u65e5\u672c", " lead", "\t\n  \n")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi there"}]


def assert_same_tokenizer(ours, theirs) -> None:
    from tandem.tokenizer import encode_messages, tokenizer_fingerprint

    assert type(ours) is type(theirs)
    assert tokenizer_fingerprint(ours) == tokenizer_fingerprint(theirs)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text)), text
    assert ours.all_special_ids == theirs.all_special_ids
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
        theirs.eos_token_id, theirs.bos_token_id, theirs.pad_token_id)
    assert ours.chat_template == theirs.chat_template
    if ours.chat_template:
        assert encode_messages(ours, CONVERSATION) == encode_messages(theirs, CONVERSATION)


@pytest.fixture(params=["llama", "qwen2"])
def checkpoint(request, tmp_path) -> Path:
    """A tiny checkpoint of each family, with a real tokenizer and chat template."""
    save_tiny_model(tmp_path, request.param)
    return save_tiny_tokenizer(tmp_path, TINY_COMMON["vocab_size"], chat=True)


def test_the_tokenizer_is_the_one_auto_tokenizer_loads(checkpoint) -> None:
    from transformers import AutoTokenizer

    from tandem.tokenizer import _tokenizer_choice_config, load_tokenizer

    choice = _tokenizer_choice_config(checkpoint)
    assert choice is not None  # the fast path was taken, with the checkpoint's own model type
    assert choice.model_type == json.loads((checkpoint / "config.json").read_text())["model_type"]
    assert_same_tokenizer(load_tokenizer(checkpoint), AutoTokenizer.from_pretrained(str(checkpoint)))


@pytest.mark.parametrize("change", ["no tokenizer_class", "remote code", "no config.json", "no model_type"])
def test_a_checkpoint_the_fast_path_cannot_read_loads_through_auto_tokenizer_as_before(checkpoint, change) -> None:
    from transformers import AutoTokenizer

    from tandem.tokenizer import _tokenizer_choice_config, load_tokenizer

    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    model_config = json.loads((checkpoint / "config.json").read_text())
    if change == "no tokenizer_class":
        del tokenizer_config["tokenizer_class"]
    elif change == "remote code":  # a class that only the checkpoint's own code defines: never chosen by us
        model_config["auto_map"] = {"AutoConfig": "configuration_custom.CustomConfig"}
    elif change == "no model_type":
        del model_config["model_type"]
    (checkpoint / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (checkpoint / "config.json").write_text(json.dumps(model_config))
    if change == "no config.json":  # a tokenizer-only directory, as `tandem serve coordinator --tokenizer` may get
        (checkpoint / "config.json").unlink()
    assert _tokenizer_choice_config(checkpoint) is None
    if change != "remote code":  # that one would run the checkpoint's code (refused without trust_remote_code)
        assert_same_tokenizer(load_tokenizer(checkpoint), AutoTokenizer.from_pretrained(str(checkpoint)))


LOAD_AND_COMPARE = """
import json, sys
from tandem.tokenizer import load_tokenizer, tokenizer_fingerprint
ours = load_tokenizer(sys.argv[1])
loaded = sorted(m for m in ("torch.distributed.tensor", "sympy") if m in sys.modules)
from transformers import AutoTokenizer
sys.path.insert(0, sys.argv[2])
from tests.test_tokenizer_loading import assert_same_tokenizer
assert_same_tokenizer(ours, AutoTokenizer.from_pretrained(sys.argv[1]))
print(json.dumps({"imported": loaded, "class": type(ours).__name__}))
"""


@pytest.mark.slow  # a process of its own and a real model: not the unit tier
def test_smollm2_s_tokenizer_loads_without_importing_the_model_config_s_dependencies(smollm2_dir) -> None:
    """AutoTokenizer loads LlamaConfig only to choose the class, and that import pulls in torch.distributed.tensor
    and sympy (1 s of every SmolLM2 worker's and coordinator's start). In a fresh process: pytest's has them."""
    done = subprocess.run([sys.executable, "-c", LOAD_AND_COMPARE, str(smollm2_dir), str(REPO_ROOT)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"imported": [], "class": "TokenizersBackend"}


def test_byte_identical_tokenizer_files_are_the_same_tokenizer_and_anything_else_is_not_proven(tmp_path):
    """`tandem up`'s cheap check before it compares fingerprints (which loads both tokenizers)."""
    from tandem.tokenizer import load_tokenizer, same_tokenizer_files, tokenizer_fingerprint

    first, twin = save_tiny_tokenizer(tmp_path / "a", 40), save_tiny_tokenizer(tmp_path / "b", 40)
    other = save_tiny_tokenizer(tmp_path / "c", 50)
    assert same_tokenizer_files(first, twin)
    assert tokenizer_fingerprint(load_tokenizer(first)) == tokenizer_fingerprint(load_tokenizer(twin))
    assert not same_tokenizer_files(first, other)
    (twin / "special_tokens_map.json").write_text("{}")  # a file only one of them has
    assert not same_tokenizer_files(first, twin) and not same_tokenizer_files(twin, first)
    assert not same_tokenizer_files(first, tmp_path / "missing")


def test_bad_words_become_the_token_runs_of_the_word_alone_and_after_a_space(smollm2_dir) -> None:
    """vLLM's bad_words: a byte-level BPE spells "hello" and " hello" with different tokens; both are banned."""
    from tandem.tokenizer import bad_word_ids, load_tokenizer

    tokenizer = load_tokenizer(smollm2_dir)
    runs = bad_word_ids(tokenizer, [" hello", "hello"])  # (leading space stripped first: one word, twice)
    assert runs == (tuple(tokenizer.encode("hello", add_special_tokens=False)),
                    tuple(tokenizer.encode(" hello", add_special_tokens=False)))
    assert runs[0] != runs[1]
    with pytest.raises(ValueError, match="empty or blank"):
        bad_word_ids(tokenizer, ["\t"])
