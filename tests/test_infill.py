"""Fill in the middle (tandem/infill.py): the prompt is the model's own marker tokens around the client's prefix and
suffix, found from the tokenizer's vocabulary, for each family's spelling; a model without markers has none."""

from __future__ import annotations

import json

import pytest

from tandem.infill import InfillFormat, no_infill_message
from tandem.tokenizer import load_tokenizer
from tests.tiny_models import TINY_FIM_SPECIALS, save_tiny_tokenizer

SPELLINGS = {
    "qwen": {3: "<|fim_prefix|>", 4: "<|fim_suffix|>", 5: "<|fim_middle|>", 6: "<|endoftext|>", 7: "<|file_sep|>"},
    "starcoder": {3: "<fim_prefix>", 4: "<fim_suffix>", 5: "<fim_middle>", 6: "<|endoftext|>", 7: "<file_sep>"},
    "deepseek": {3: "<｜fim▁begin｜>", 4: "<｜fim▁hole｜>", 5: "<｜fim▁end｜>", 6: "<|EOT|>"},
}


def tokenizer_with(tmp_path, specials: dict[int, str], bos_first: bool = False):
    save_tiny_tokenizer(tmp_path, 100, extra_specials=specials)
    if bos_first:  # as DeepSeek-Coder's tokenizer does: every encoding starts with its BOS
        path = tmp_path / "tokenizer.json"
        data = json.loads(path.read_text())
        data["post_processor"] = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>",
                                  "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}], "pair": [
                                  {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                                  "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
        path.write_text(json.dumps(data))
    return load_tokenizer(tmp_path)


@pytest.mark.parametrize("family", sorted(SPELLINGS))
def test_each_familys_markers_are_found_and_the_prompt_is_its_joined_text(tmp_path, family):
    """The prompt is what the tokenizer makes of ``PRE prefix SUF suffix MID`` written out with the markers as
    special tokens (an independent spelling of the same prompt), and the format's end tokens end a middle."""
    specials = SPELLINGS[family]
    tokenizer = tokenizer_with(tmp_path, specials)
    infill = InfillFormat.of(tokenizer)
    assert infill is not None
    assert (infill.prefix_id, infill.suffix_id, infill.middle_id) == (3, 4, 5)
    assert infill.stop_ids == frozenset(set(specials) - {3, 4, 5})
    prefix, suffix = "def f(x):\n    return", "\n\nprint(f(2))"
    joined = specials[3] + prefix + specials[4] + suffix + specials[5]
    assert infill.prompt_ids(tokenizer, prefix, suffix) == tokenizer.encode(joined, add_special_tokens=True)


def test_a_tokenizer_that_starts_with_a_bos_keeps_it_before_the_markers(tmp_path):
    tokenizer = tokenizer_with(tmp_path, SPELLINGS["deepseek"], bos_first=True)
    infill = InfillFormat.of(tokenizer)
    assert infill is not None and infill.lead == (1,)
    ids = infill.prompt_ids(tokenizer, "ab", "cd")
    assert ids == [1, 3, *tokenizer.encode("ab", add_special_tokens=False), 4,
                   *tokenizer.encode("cd", add_special_tokens=False), 5]
    assert ids.count(1) == 1  # the texts are encoded bare: no BOS of their own between the markers


def test_an_empty_side_is_no_tokens_between_its_markers(tmp_path):
    tokenizer = tokenizer_with(tmp_path, TINY_FIM_SPECIALS)
    infill = InfillFormat.of(tokenizer)
    assert infill.prompt_ids(tokenizer, "", "xy") == [3, 4, *tokenizer.encode("xy", add_special_tokens=False), 5]
    assert infill.prompt_ids(tokenizer, "xy", "") == [3, *tokenizer.encode("xy", add_special_tokens=False), 4, 5]


def test_a_model_without_markers_has_no_format_and_its_refusal_names_the_field(tmp_path):
    partial = {3: "<|fim_prefix|>", 4: "<|fim_suffix|>"}  # one marker short is no format either
    assert InfillFormat.of(tokenizer_with(tmp_path / "none", {})) is None
    assert InfillFormat.of(tokenizer_with(tmp_path / "partial", partial)) is None
    message = no_infill_message("suffix")
    assert message.startswith("suffix: ") and "<|fim_prefix|>" in message


@pytest.mark.long
def test_qwen_coder_fills_a_function_body_as_transformers_does_and_prompt_lookup_keeps_it(capsys):
    """Real text (Qwen2.5-Coder-0.5B, fp32, where prepared): ``tandem generate --suffix`` writes transformers'
    greedy middle for the same prompt, spelled independently (the markers in the joined text), up to and with
    <|endoftext|>; prompt lookup, which reads the suffix too, writes the same tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem.cli import main
    from tests.conftest import prepared_model_dir

    model_dir = prepared_model_dir("qwen-coder-0.5b")
    if model_dir is None:
        pytest.skip("qwen-coder-0.5b not prepared: run `tandem models prepare qwen-coder-0.5b`")
    tokenizer = load_tokenizer(model_dir)
    prefix = 'def area(r):\n    """The area of a circle of radius r."""\n    import math\n    '
    suffix = "\n\n\nprint(area(2.0))\n"
    ids = tokenizer.encode(f"<|fim_prefix|>{prefix}<|fim_suffix|>{suffix}<|fim_middle|>")
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=[end],
                             pad_token_id=end)
    expected = out[0, len(ids):].tolist()
    assert expected[-1] == end and "math.pi" in tokenizer.decode(expected)  # the body, and no more
    for method in ("none", "ngram"):
        assert main(["generate", prefix, "--suffix", suffix, "--target", str(model_dir), "--draft", "none",
                     "--method", method, "--dtype", "float32", "--max-new-tokens", "32", "--json"]) == 0
        answer = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert answer["token_ids"] == expected and answer["finish_reason"] == "stop"
