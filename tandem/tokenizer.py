"""Tokenizer loading, stop tokens, and a fingerprint that says whether two tokenizers agree."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from tandem.config import ModelConfig
from tandem.errors import InvalidRequestError
from tandem.model_store import MARKER_NAME


def load_tokenizer(model_dir: Path) -> Any:
    """The checkpoint's own tokenizer, through transformers' AutoTokenizer (the class it would choose, the same ids)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), config=_tokenizer_choice_config(Path(model_dir)))


def _tokenizer_choice_config(model_dir: Path) -> Any:
    """What AutoTokenizer reads of the model's config to choose a tokenizer class, or None to let it load the config.

    AutoTokenizer loads the model's config only to choose the class, and in transformers 5 loading it imports the
    architecture's config module; Llama's imports torch.distributed.tensor and sympy, about 1 s of every SmolLM2
    worker's and coordinator's start on 2 cores (2.8 s to load its tokenizer in a fresh process, 1.8 s without),
    for a model whose weights Tandem loads itself. A plain ``PretrainedConfig``
    with the same model type, name and declared tokenizer class takes the same branches. Only a checkpoint whose
    tokenizer_config.json names its class (and carries no remote code) gets it; any other falls back to the full load.
    """
    from transformers import PretrainedConfig

    try:
        tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
        model_config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not tokenizer_config.get("tokenizer_class") or "auto_map" in tokenizer_config or "auto_map" in model_config:
        return None
    if not isinstance(model_config.get("model_type"), str):
        return None
    config = PretrainedConfig(name_or_path=str(model_dir), tokenizer_class=model_config.get("tokenizer_class"))
    config.model_type = model_config["model_type"]
    return config


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the token -> id map: equal fingerprints mean the same ids for the same text.

    Used to refuse a draft whose vocabulary differs from the target's, and to
    namespace shared n-gram caches.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


# The files a Hugging Face tokenizer is read from: byte-identical sets of them make identical token -> id maps.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model")


def same_tokenizer_files(first: Path, second: Path) -> bool:
    """Whether two model directories hold byte-identical tokenizer files (a cheap proof of the same tokenizer:
    a model family's sizes ship the same files). False says nothing: compare the fingerprints then."""
    first, second = Path(first), Path(second)
    if not (first.is_dir() and second.is_dir() and (first / "tokenizer.json").is_file()):
        return False
    for name in TOKENIZER_FILES:
        a, b = first / name, second / name
        if a.is_file() != b.is_file() or (a.is_file() and a.read_bytes() != b.read_bytes()):
            return False
    return True


def check_same_tokenizer(target_tokenizer: Any, target_dir: Path, draft_dir: Path) -> None:
    """Refuse a draft whose tokenizer maps text to other ids than the target's (its proposals would be noise)."""
    draft_tokenizer = load_tokenizer(draft_dir)
    if tokenizer_fingerprint(draft_tokenizer) != tokenizer_fingerprint(target_tokenizer):
        raise InvalidRequestError(
            f"the draft model's tokenizer ({draft_dir}) differs from the target's ({target_dir}): "
            "speculative decoding needs both to map text to the same token ids"
        )


# The end-of-generation tokens llama.cpp stops at beside a GGUF's one eos (src/llama-vocab.cpp, where a vocabulary
# has them as special tokens). A GGUF names a single eos, so a checkpoint converted from one lost the rest of its
# generation config: Qwen2.5-Instruct's upstream config stops at <|im_end|> and <|endoftext|>, its GGUF names only
# <|im_end|>, and after a tool call block Qwen2.5-Coder-1.5B writes <|endoftext|> (p = 1.0), past which
# generation ran on.
GGUF_END_TOKENS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>",
                             "_<EOT>", "<\uff5cend\u2581of\u2581sentence\uff5c>"})


def stop_token_ids(model_dir: Path, tokenizer: Any, config: ModelConfig) -> frozenset[int]:
    """End-of-sequence ids from the config, generation_config.json and the tokenizer; for a checkpoint converted
    from a GGUF (``tandem models prepare``), also the end tokens llama.cpp stops at (``GGUF_END_TOKENS``)."""
    ids = set(config.eos_token_ids)
    gen_cfg = Path(model_dir) / "generation_config.json"
    if gen_cfg.is_file():
        eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    if _converted_from_gguf(Path(model_dir)):
        added = getattr(tokenizer, "added_tokens_decoder", {})
        ids.update(i for i, token in added.items() if token.special and token.content in GGUF_END_TOKENS)
    return frozenset(int(i) for i in ids)


def _converted_from_gguf(model_dir: Path) -> bool:
    """Whether ``model_dir`` was written by the GGUF converter (its marker names the GGUF file)."""
    try:
        return bool(json.loads((model_dir / MARKER_NAME).read_text()).get("gguf_file"))
    except (OSError, ValueError, AttributeError):
        return False


def encode_prompt(tokenizer: Any, prompt: str, chat: bool) -> list[int]:
    """Token ids of ``prompt``; with ``chat`` wrapped in the tokenizer's chat template as a user turn."""
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; drop --chat")
        return encode_messages(tokenizer, [{"role": "user", "content": prompt}])
    return list(tokenizer.encode(prompt, add_special_tokens=True))


# What the chat template is given by the request itself, or by the tokenizer: a template kwarg may not replace it.
TEMPLATE_NAMES = frozenset({"messages", "conversation", "tools", "documents", "add_generation_prompt",
                            "continue_final_message", "chat_template", "tokenize", "return_dict", "return_tensors",
                            "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask",
                            "bos_token", "eos_token", "pad_token", "unk_token", "raise_exception", "strftime_now"})


def template_kwargs(text: str) -> dict[str, Any]:
    """``ChatMessages.template_kwargs`` (a JSON object's text; empty: none) as the chat template's extra variables,
    or ValueError naming what is wrong: not a JSON object, or a name the template is already given."""
    if not text:
        return {}
    try:
        kwargs = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(kwargs, dict):
        raise ValueError(f"must be a JSON object of the template's variables, got {type(kwargs).__name__}")
    taken = sorted(TEMPLATE_NAMES.intersection(kwargs))
    if taken:
        raise ValueError(f"{', '.join(taken)}: set by the request itself (its own field), not a template variable")
    return kwargs


MAX_BAD_WORDS = 128  # words one request may ban (each one or two token runs, checked on every scored row)


def bad_word_ids(tokenizer: Any, words: list[str] | tuple[str, ...]) -> tuple[tuple[int, ...], ...]:
    """vLLM's ``bad_words`` as token runs: each word as it starts a text and after a space (a byte-level BPE spells
    the two with different tokens), distinct; ValueError naming an empty word or too many."""
    if len(words) > MAX_BAD_WORDS:
        raise ValueError(f"at most {MAX_BAD_WORDS} words, got {len(words)}")
    runs: dict[tuple[int, ...], None] = {}
    for word in words:
        if not word.strip():
            raise ValueError("a bad word must hold some text, got an empty or blank one")
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids:
                runs[ids] = None
    return tuple(runs)


def encode_messages(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                    continue_final: bool = False, kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of a conversation (``{"role", "content"[, "name", "tool_calls", "tool_call_id"]}`` turns) through
    the tokenizer's chat template, with ``tools`` (OpenAI's ``tools`` items) shown to the model, ending where the
    assistant's next turn starts; with ``continue_final``, ending inside the last turn (an assistant's, checked by
    ``check_continuation``), so that the model continues it. ``kwargs``: the template's extra variables
    (``template_kwargs``; a template ignores the ones it does not read)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: send a plain prompt instead")
    if continue_final:
        check_continuation(messages)
    ids = tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=not continue_final,
                                        continue_final_message=continue_final, tokenize=True, **(kwargs or {}))
    # transformers 5 returns a BatchEncoding here; 4.x a plain list
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def check_continuation(messages: list[dict[str, Any]]) -> None:
    """A conversation whose last turn the answer may continue: an assistant's text. A user's would make the answer
    the user's words, and a turn of calls has no text to continue."""
    last = messages[-1] if messages else {}
    if last.get("role") != "assistant":
        raise ValueError(f"the last turn is continued (continue_final_message), so it must be an assistant's; got "
                         f"{last.get('role') or 'none'}")
    if last.get("tool_calls"):
        raise ValueError("the last turn is continued (continue_final_message), so it must be text, not tool calls")
