"""Tiny random-weight checkpoints in the Hugging Face layout, made by transformers itself."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_COMMON = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)


def save_tiny_model(out_dir: Path, family: str, seed: int = 0, **overrides) -> Path:
    """Write config.json + model.safetensors of a random Llama or Qwen2 model; returns ``out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    params = {**TINY_COMMON, **overrides}
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(tie_word_embeddings=True, **params))
    elif family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(tie_word_embeddings=False, **params))
        with torch.no_grad():  # random init leaves biases at 0; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:
        raise ValueError(family)
    with torch.no_grad():  # larger weights than the default init, so that logits are not near-uniform
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    model.save_pretrained(out_dir)
    return out_dir


# A chat template as small as the tokenizer: ``<s>`` and each turn's text, then ``#`` to ask for an answer.
TINY_CHAT_TEMPLATE = ("{% for message in messages %}<s>{{ message['content'] }}{% endfor %}"
                      "{% if greeting is defined %}{{ greeting }}{% endif %}"  # a variable: chat_template_kwargs
                      "{% if add_generation_prompt %}#{% endif %}")


def save_tiny_tokenizer(out_dir: Path, vocab_size: int, eos_token_id: int = TINY_COMMON["eos_token_id"],
                        bos_token_id: int | None = TINY_COMMON["bos_token_id"], chat: bool = False,
                        extra_specials: dict[int, str] | None = None) -> Path:
    """Write a real ``tokenizers`` WordLevel tokenizer (tokenizer.json + tokenizer_config.json); returns ``out_dir``.

    Ids ``eos_token_id`` and ``bos_token_id`` are the special tokens ``</s>`` and ``<s>``, the
    highest other id is ``<unk>``, and every other id is one printable ASCII character (``!``,
    ``"``, ``#``...; ids past those 94 are ``w{id}``). Text is read character by character, so
    ``"!#"`` is two tokens. With ``chat`` it carries ``TINY_CHAT_TEMPLATE``, so that requests with
    ``chat=True`` work as on a real model. ``extra_specials`` names more ids as special tokens (a code model's
    fill-in-the-middle markers). ``tandem.tokenizer.load_tokenizer`` loads it with the same ids
    whatever the model's family: for Qwen2 directories transformers insists on its own
    byte-level BPE class, which rebuilds the model from this vocabulary with no merges, and
    for single ASCII characters that reads text the same way.
    """
    import json

    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    specials = {eos_token_id: "</s>"}
    if bos_token_id is not None:
        specials[bos_token_id] = "<s>"
    specials.update(extra_specials or {})
    specials[max(i for i in range(vocab_size) if i not in specials)] = "<unk>"
    chars = iter(chr(c) for c in range(33, 127))
    names = {i: specials.get(i) or next(chars, f"w{i}") for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel({name: i for i, name in names.items()}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Split(Regex("."), behavior="isolated")]
    )
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(list(specials.values()))
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    # Every special named here: a tokenizer class with defaults of its own (Qwen2's <|endoftext|>)
    # would otherwise add tokens past the model's vocabulary.
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>",
              "pad_token": "</s>", "bos_token": "<s>" if bos_token_id is not None else None,
              "model_max_length": TINY_COMMON["max_position_embeddings"]}
    if chat:
        config["chat_template"] = TINY_CHAT_TEMPLATE
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return out_dir


# A code model's fill-in-the-middle markers and end token (Qwen2.5-Coder's spelling), on ids the tiny tokenizer
# would otherwise give to the characters '"', '#', '$' and '%'.
TINY_FIM_SPECIALS = {3: "<|fim_prefix|>", 4: "<|fim_suffix|>", 5: "<|fim_middle|>", 6: "<|endoftext|>"}


def save_tiny_served_model(out_dir: Path, seed: int = 11, max_positions: int = 2048, fim: bool = False) -> Path:
    """A tiny Llama with a real tokenizer and chat template: what the plumbing tests serve through real
    processes (faults, fuzz, TLS, discovery, soak). Loads and answers in milliseconds, so the tests
    measure the system, not the model; ``max_positions`` leaves room for long streams. ``fim``: its tokenizer has
    fill-in-the-middle markers (``TINY_FIM_SPECIALS``)."""
    save_tiny_model(out_dir, "llama", seed=seed, max_position_embeddings=max_positions)
    return save_tiny_tokenizer(out_dir, TINY_COMMON["vocab_size"], chat=True,
                               extra_specials=TINY_FIM_SPECIALS if fim else None)
