"""Which tokens end generation: the config's and the tokenizer's eos, and for a checkpoint converted from a GGUF,
the end tokens llama.cpp stops at (a GGUF names one eos; Qwen2.5's upstream config names two)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.config import ModelConfig
from tandem.model_store import MARKER_NAME
from tandem.tokenizer import load_tokenizer, stop_token_ids
from tests.tiny_models import TINY_COMMON, save_tiny_tokenizer


def checkpoint(path: Path, marker: dict | None) -> tuple[Path, object, ModelConfig]:
    """A config.json and a real tokenizer with ``<|endoftext|>`` and ``<|im_end|>`` as special tokens and
    ``<|endofprompt|>`` as a plain added one; ``marker``: the converter's tandem_model.json."""
    from transformers import LlamaConfig

    LlamaConfig(**TINY_COMMON).save_pretrained(path)  # eos 2
    save_tiny_tokenizer(path, TINY_COMMON["vocab_size"], eos_token_id=2, bos_token_id=1)
    tokenizer = load_tokenizer(path)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|endoftext|>", "<|im_end|>"]})
    tokenizer.add_tokens(["<|endofprompt|>"])  # not special: text a model may write
    tokenizer.save_pretrained(path)
    if marker is not None:
        (path / MARKER_NAME).write_text(json.dumps(marker))
    return path, load_tokenizer(path), ModelConfig.from_dir(path)


@pytest.mark.parametrize("marker,ends", [
    ({"name": "x", "gguf_file": "x.gguf", "layout_version": 3}, True),  # converted from a GGUF
    (None, False),  # a Hugging Face directory: its own generation config says where it ends
    ({"name": "x", "layout_version": 3}, False),  # a marker that names no GGUF
])
def test_a_checkpoint_converted_from_a_gguf_stops_where_llama_cpp_stops(tmp_path, marker, ends):
    path, tokenizer, config = checkpoint(tmp_path, marker)
    vocab = tokenizer.get_vocab()
    end_tokens = {vocab["<|endoftext|>"], vocab["<|im_end|>"]}
    stops = stop_token_ids(path, tokenizer, config)
    assert 2 in stops and vocab["<|endofprompt|>"] not in stops
    assert (end_tokens <= stops) is ends and (end_tokens & stops == set()) is not ends


def test_the_generation_config_s_eos_list_counts_too(tmp_path):
    path, tokenizer, config = checkpoint(tmp_path, None)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 5]}))
    assert stop_token_ids(path, tokenizer, config) == {2, 5}
