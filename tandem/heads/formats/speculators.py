"""EAGLE-3 heads as vLLM's speculators library writes them (and as the EAGLE-3 authors publish them), as ``EagleHead``.

The speculators library (github vllm-project/speculators: ``Eagle3SpeculatorConfig``,
``Eagle3DraftModel``, written by ``save_pretrained``):

- ``config.json``: ``speculators_model_type: "eagle3"``; ``transformer_layer_config``, the
  draft decoder layer's transformers config (shape, rope, eps; its ``vocab_size`` is the
  target's); ``draft_vocab_size``; ``target_hidden_size``; ``eagle_aux_hidden_state_layer_ids``
  (the target layers read, or null); the variant flags ``norm_before_residual``,
  ``norm_before_fc``, ``fc_norm``, ``norm_output``, ``embed_requires_grad``; and
  ``speculators_config.verifier.name_or_path``, the target.
- ``model.safetensors`` (or shards named by ``model.safetensors.index.json``): ``fc.weight``
  [H, n*H], ``layers.0.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
  ``layers.0.self_attn.{q,k,v,o}_proj.weight``, ``layers.0.mlp.{gate,up,down}_proj.weight``,
  ``norm.weight``, ``lm_head.weight`` [draft_vocab, H], ``d2t`` [draft_vocab] int64, ``t2d``
  [vocab] bool, and ``embed_tokens.weight``, a copy of the target's embedding.

The EAGLE-3 authors' checkpoints (and SpecForge's): ``config.json`` is a Llama config
with ``draft_vocab_size`` (architectures ``LlamaForCausalLMEagle3``), the layer's tensors
are ``midlayer.*`` (vLLM reads them as ``layers.0.*``), in ``model.safetensors`` or
``pytorch_model.bin``.

What changes on the way in (as vLLM's ``llama_eagle3.py`` reads these files):

- ``d2t`` holds offsets: draft id ``i`` is target id ``i + d2t[i]``. Tandem's is the id itself.
- q, k and v rows are concatenated into ``qkv_proj``, gate then up rows into ``gate_up_proj``.
- the embedding is dropped: Tandem's head reads the target's own table. A trained one
  (``embed_requires_grad``) differs from it, so such heads are refused.
- the feature streams are the aux layer ids, in ascending order: vLLM's target appends
  the residual stream entering each of those layers as it passes them, which is Tandem's
  stream index. Where none are named, vLLM and speculators read layers 2, L // 2 and
  L - 3 of an L-layer target, so the caller must say L (``target_num_layers``).

Variants Tandem's layer does not compute are refused by name rather than served wrong:
``norm_before_residual``, ``norm_before_fc``, ``fc_norm``, ``norm_output``, more than one
decoder layer, a non-Llama layer (a qwen3 layer adds q/k norms), a hidden size other than
the target's, and biases anywhere but on q/k/v.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.config import ModelConfig
from tandem.heads.config import HeadsConfig, HeadsConfigError
from tandem.heads.formats import check_shape, load_weights

SPECULATORS_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
AUTHORS_WEIGHTS = (*SPECULATORS_WEIGHTS, "pytorch_model.bin", "pytorch_model.bin.index.json")
UNSUPPORTED_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")  # speculators' variant switches, all default off
# Tensors these files carry that Tandem's head takes from elsewhere: the target's embedding (and, in older
# speculators files, its final norm and lm_head, used only as training targets); t2d only cross-checks d2t.
DROPPED = ("embed_tokens.weight", "t2d", "verifier_lm_head.weight", "verifier_norm.weight")
AUTHORS_PREFIX, LAYER = "midlayer.", "layers.0."
DEFAULT_AUX_LAYERS = 3  # vLLM's default reads three target layers: 2, L // 2, L - 3


@dataclass(frozen=True, slots=True)
class _Described:
    """What a config says, in either layout."""

    layer: ModelConfig  # the decoder layer's shape (vocab_size: the target's)
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...] | None  # None: not named, vLLM's default applies
    target_name: str
    weights_files: tuple[str, ...]


def is_eagle3_layout(config: dict[str, Any] | None) -> bool:
    if not config:
        return False
    architectures = config.get("architectures") or []
    return ("speculators_model_type" in config or "draft_vocab_size" in config
            or any("eagle3" in str(name).lower() for name in architectures))


def read_eagle3(directory: Path, config: dict[str, Any],
                target_num_layers: int | None) -> tuple[HeadsConfig, dict[str, torch.Tensor]]:
    described = _describe(config, f"EAGLE-3 heads {directory / 'config.json'}")
    weights_path, public = load_weights(directory, described.weights_files, "EAGLE-3 heads")
    where = f"EAGLE-3 heads {weights_path}"
    public = {LAYER + name[len(AUTHORS_PREFIX):] if name.startswith(AUTHORS_PREFIX) else name: tensor
              for name, tensor in public.items()}
    layer = described.layer
    fc = public.get("fc.weight")
    if fc is None:
        raise HeadsConfigError(f"{where}: tensor fc.weight is missing (the projection of the target's hidden states)")
    if fc.dim() != 2 or fc.shape[0] != layer.hidden_size or fc.shape[1] % layer.hidden_size:
        raise HeadsConfigError(f"{where}: tensor fc.weight has shape {tuple(fc.shape)}, expected "
                               f"({layer.hidden_size}, n * {layer.hidden_size}) for n target layers")
    num_streams = fc.shape[1] // layer.hidden_size
    streams = _feature_streams(described.aux_layer_ids, num_streams, target_num_layers, where)
    state = _tandem_state(public, layer, num_streams, described.draft_vocab_size, where)
    cfg = HeadsConfig(
        kind="eagle", layout="speculators", hidden_size=layer.hidden_size, vocab_size=layer.vocab_size,
        draft_vocab_size=described.draft_vocab_size, feature_streams=streams, target_fingerprint="",
        target_name=described.target_name, num_attention_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
        head_dim=layer.head_dim, intermediate_size=layer.intermediate_size, rms_norm_eps=layer.rms_norm_eps,
        rope_theta=layer.rope_theta, rope_scaling=layer.rope_scaling, attention_bias=layer.attention_bias,
    )
    return cfg, state


# ----- the config ---------------------------------------------------------------------------------------------
def _describe(config: dict[str, Any], where: str) -> _Described:
    speculators = "speculators_model_type" in config
    if speculators and config["speculators_model_type"] != "eagle3":
        raise HeadsConfigError(f"{where}: speculators model type {config['speculators_model_type']!r}; Tandem reads "
                               "eagle3 heads only")
    for flag in UNSUPPORTED_FLAGS:
        if config.get(flag):
            raise HeadsConfigError(f"{where}: {flag} is set, a variant of the EAGLE-3 layer Tandem does not implement")
    if speculators and "norm_before_residual" not in config:
        raise HeadsConfigError(f"{where}: the config does not say norm_before_residual (vLLM then assumes true, the "
                               "speculators library false); Tandem implements false: add \"norm_before_residual\": "
                               "false if the heads were trained that way")
    if config.get("norm_before_residual"):
        raise HeadsConfigError(f"{where}: norm_before_residual is set (the residual starts from the normed hidden "
                               "state); Tandem's EAGLE-3 layer starts it from the hidden state itself")
    if config.get("embed_requires_grad"):
        raise HeadsConfigError(f"{where}: embed_requires_grad is set, so the heads trained an embedding of their own; "
                               "Tandem's EAGLE-3 head reads the target's embedding")
    if speculators:
        layer_config = config.get("transformer_layer_config")
        if not isinstance(layer_config, dict):
            raise HeadsConfigError(f"{where}: transformer_layer_config is missing or not an object")
        verifier = ((config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path") or ""
        aux = config.get("eagle_aux_hidden_state_layer_ids")
    else:
        layer_config, verifier = config, ""
        aux = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") \
            or config.get("eagle_aux_hidden_state_layer_ids")
    layer = _layer_shape(layer_config, where)
    target_hidden = config.get("target_hidden_size")
    if target_hidden is not None and int(target_hidden) != layer.hidden_size:
        raise HeadsConfigError(f"{where}: the head's hidden size {layer.hidden_size} differs from the target's "
                               f"{target_hidden}; Tandem's EAGLE-3 head reads the target's embedding and needs "
                               "them equal")
    return _Described(
        layer=layer,
        draft_vocab_size=int(config.get("draft_vocab_size") or layer.vocab_size),  # vLLM: absent means the target's
        aux_layer_ids=tuple(int(i) for i in aux) if aux else None,
        target_name=str(verifier),
        weights_files=SPECULATORS_WEIGHTS if speculators else AUTHORS_WEIGHTS,
    )


def _layer_shape(layer_config: dict[str, Any], where: str) -> ModelConfig:
    """The decoder layer's shape, read as Tandem reads a Llama config.json (rope, head_dim and eps defaults)."""
    model_type = layer_config.get("model_type")
    if model_type != "llama":
        raise HeadsConfigError(f"{where}: the decoder layer is {model_type!r}; Tandem's EAGLE-3 layer is Llama's "
                               "(a qwen3 layer adds q/k norms it does not compute)")
    num_layers = int(layer_config.get("num_hidden_layers", 1))
    if num_layers != 1:
        raise HeadsConfigError(f"{where}: {num_layers} decoder layers; Tandem's EAGLE-3 head has one")
    try:
        return ModelConfig.from_hf_dict({**layer_config, "num_hidden_layers": 1})
    except KeyError as exc:
        raise HeadsConfigError(f"{where}: the decoder layer's config lacks {exc}") from None
    except (TypeError, ValueError) as exc:
        raise HeadsConfigError(f"{where}: the decoder layer's config: {exc}") from None


def _feature_streams(aux_layer_ids: tuple[int, ...] | None, num_streams: int, target_num_layers: int | None,
                     where: str) -> tuple[int, ...]:
    if aux_layer_ids is None:
        if num_streams != DEFAULT_AUX_LAYERS:
            raise HeadsConfigError(f"{where}: fc.weight reads {num_streams} target layers and the config names none "
                                   "(eagle_aux_hidden_state_layer_ids); vLLM's default is three")
        if target_num_layers is None:
            raise HeadsConfigError(
                f"{where}: the config does not name the target layers the head reads "
                "(eagle_aux_hidden_state_layer_ids); vLLM then reads layers 2, L // 2 and L - 3 of an L-layer "
                "target: pass target_num_layers (read_any_layout, load_heads) or add the ids to config.json"
            )
        if target_num_layers < 3:
            raise HeadsConfigError(f"{where}: vLLM's default layers 2, L // 2, L - 3 need a target of at least 3 "
                                   f"layers, not {target_num_layers}")
        aux_layer_ids = (2, target_num_layers // 2, target_num_layers - 3)
    if len(set(aux_layer_ids)) != len(aux_layer_ids):
        raise HeadsConfigError(f"{where}: target layers {list(aux_layer_ids)} repeat one (vLLM captures each once)")
    if len(aux_layer_ids) != num_streams:
        raise HeadsConfigError(f"{where}: the config names {len(aux_layer_ids)} target layers {list(aux_layer_ids)}, "
                               f"fc.weight reads {num_streams}")
    return tuple(sorted(aux_layer_ids))  # vLLM concatenates them in layer order, whatever order the config lists


# ----- the tensors --------------------------------------------------------------------------------------------
def _tandem_state(public: dict[str, torch.Tensor], layer: ModelConfig, num_streams: int, draft_vocab: int,
                  where: str) -> dict[str, torch.Tensor]:
    rest = dict(public)
    hidden, inter = layer.hidden_size, layer.intermediate_size
    q_rows, kv_rows = layer.num_heads * layer.head_dim, layer.num_kv_heads * layer.head_dim

    def take(name: str, *shape: int) -> torch.Tensor:
        tensor = check_shape(rest, name, shape, where)
        del rest[name]
        return tensor

    attn, mlp = LAYER + "self_attn.", LAYER + "mlp."
    state = {
        "fc.weight": take("fc.weight", hidden, num_streams * hidden),
        "layer.input_layernorm.weight": take(LAYER + "input_layernorm.weight", hidden),
        "layer.hidden_norm.weight": take(LAYER + "hidden_norm.weight", hidden),
        "layer.self_attn.qkv_proj.weight": torch.cat([  # [q_rows + 2 * kv_rows, 2 * hidden]
            take(attn + "q_proj.weight", q_rows, 2 * hidden),
            take(attn + "k_proj.weight", kv_rows, 2 * hidden),
            take(attn + "v_proj.weight", kv_rows, 2 * hidden),
        ]),
        "layer.self_attn.o_proj.weight": take(attn + "o_proj.weight", hidden, q_rows),
        "layer.post_attention_layernorm.weight": take(LAYER + "post_attention_layernorm.weight", hidden),
        "layer.mlp.gate_up_proj.weight": torch.cat([  # [2 * inter, hidden]: gate rows, then up rows
            take(mlp + "gate_proj.weight", inter, hidden),
            take(mlp + "up_proj.weight", inter, hidden),
        ]),
        "layer.mlp.down_proj.weight": take(mlp + "down_proj.weight", hidden, inter),
        "norm.weight": take("norm.weight", hidden),
        "lm_head.weight": take("lm_head.weight", draft_vocab, hidden),
    }
    if layer.attention_bias:
        state["layer.self_attn.qkv_proj.bias"] = torch.cat([  # [q_rows + 2 * kv_rows]
            take(attn + "q_proj.bias", q_rows),
            take(attn + "k_proj.bias", kv_rows),
            take(attn + "v_proj.bias", kv_rows),
        ])
    state["d2t"] = _absolute_d2t(rest.pop("d2t", None), rest.get("t2d"), draft_vocab, layer.vocab_size, where)
    for name in DROPPED:
        rest.pop(name, None)
    if rest:
        extra_layers = sorted({name.split(".")[1] for name in rest if name.startswith("layers.")})
        if extra_layers:
            raise HeadsConfigError(f"{where}: tensors of decoder layers {extra_layers}; Tandem's EAGLE-3 head has one")
        raise HeadsConfigError(f"{where}: tensors Tandem's EAGLE-3 layer has no place for: {sorted(rest)[:8]} "
                               "(biases, q/k norms or extra norms of a variant it does not compute)")
    return state


def _absolute_d2t(offsets: torch.Tensor | None, t2d: torch.Tensor | None, draft_vocab: int, vocab: int,
                  where: str) -> torch.Tensor:
    """Tandem's d2t ([draft_vocab] int64 target ids) from the file's offsets (target id = draft id + d2t[draft id])."""
    if offsets is None:
        if draft_vocab != vocab:
            raise HeadsConfigError(f"{where}: no d2t, so draft ids cannot be mapped to the target's: the draft "
                                   f"vocabulary has {draft_vocab} ids, the target's {vocab}")
        return torch.arange(vocab, dtype=torch.int64)
    check_shape({"d2t": offsets}, "d2t", (draft_vocab,), where)
    if offsets.is_floating_point() or offsets.dtype == torch.bool:
        raise HeadsConfigError(f"{where}: d2t has dtype {offsets.dtype}, expected integer offsets")
    absolute = torch.arange(draft_vocab, dtype=torch.int64) + offsets.to(torch.int64)  # [draft_vocab]
    outside = ((absolute < 0) | (absolute >= vocab)).nonzero().flatten()
    if outside.numel():
        first = int(outside[0])
        raise HeadsConfigError(f"{where}: d2t maps draft id {first} to {int(absolute[first])}, outside the target's "
                               f"vocabulary of {vocab} (this layout stores offsets: target id = draft id + d2t)")
    if t2d is not None:
        check_shape({"t2d": t2d}, "t2d", (vocab,), where)
        used = t2d.to(torch.bool)  # [vocab]: the target ids the draft vocabulary holds
        if int(used.sum()) != draft_vocab or not bool(used[absolute].all()):
            raise HeadsConfigError(f"{where}: d2t and t2d disagree on which target ids the {draft_vocab} draft ids are")
    return absolute
