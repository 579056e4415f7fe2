"""Heads trained elsewhere, read into Tandem's modules: the Medusa project's layout, speculators' and the EAGLE-3
authors' EAGLE-3 layouts. Each round-trips with the right values; wrong files are refused by name."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tandem.config import ModelConfig
from tandem.heads.config import HeadsConfigError
from tandem.heads.formats import read_any_layout
from tandem.heads.store import instantiate, load_heads, save_heads
from tests.heads.public_layouts import (
    TARGET_NAME,
    EagleShape,
    eagle3_public_tensors,
    medusa_head_module,
    write_eagle3_authors,
    write_medusa,
    write_speculators_eagle3,
)
from tests.tiny_models import TINY_COMMON

HIDDEN, VOCAB = TINY_COMMON["hidden_size"], TINY_COMMON["vocab_size"]
CPU = torch.device("cpu")


def tiny_target() -> ModelConfig:
    return ModelConfig.from_hf_dict({**TINY_COMMON, "model_type": "llama"})  # 3 layers, hidden 64, vocab 97


def read_module(path: Path, **kwargs):
    cfg, state = read_any_layout(path, **kwargs)
    return cfg, instantiate(cfg, state, str(path), torch.float32, CPU)


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


# ----- Medusa -------------------------------------------------------------------------------------------------
def test_medusa_safetensors_round_trip_computes_what_the_public_tensors_say(tmp_path):
    heads = medusa_head_module(num_heads=3, num_layers=1, hidden=HIDDEN, vocab=VOCAB)
    path = write_medusa(tmp_path / "m", heads.state_dict(), num_heads=3, num_layers=1)
    cfg, module = read_module(path)

    assert (cfg.kind, cfg.layout, cfg.shared_lm_head, cfg.num_heads, cfg.num_res_layers) == ("medusa", "medusa",
                                                                                           False, 3, 1)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size, cfg.feature_streams) == (HIDDEN, VOCAB, VOCAB,
                                                                                          (-1,))
    assert (cfg.target_name, cfg.target_fingerprint) == (TARGET_NAME, "")
    assert torch.equal(module.d2t, torch.arange(VOCAB))
    public = load_file(str(path / "medusa_lm_head.safetensors"))
    x = torch.randn(5, HIDDEN)  # [R, H]
    expected = []
    for k in range(3):  # head k: x + silu(W x + b), then its own lm_head
        h = x + F.silu(x @ public[f"{k}.0.linear.weight"].T + public[f"{k}.0.linear.bias"])
        expected.append(h @ public[f"{k}.1.weight"].T)
    torch.testing.assert_close(module(x), torch.stack(expected, dim=1), rtol=1e-5, atol=1e-5)  # [R, K, V]


def test_medusa_pt_with_repeated_blocks_matches_the_projects_own_module(tmp_path):
    heads = medusa_head_module(num_heads=2, num_layers=2, hidden=HIDDEN, vocab=VOCAB, seed=3)
    path = write_medusa(tmp_path / "m", heads.state_dict(), num_heads=2, num_layers=2, weights="pt")
    cfg, module = read_module(path)

    assert cfg.num_res_layers == 2
    x = torch.randn(4, HIDDEN)
    expected = torch.stack([head(x) for head in heads], dim=1)  # the project applies its one block twice
    torch.testing.assert_close(module(x), expected, rtol=1e-5, atol=1e-5)


def test_medusa_head_count_is_the_weights_not_an_under_reporting_config(tmp_path):
    heads = medusa_head_module(num_heads=4, num_layers=1, hidden=HIDDEN, vocab=VOCAB)
    cfg, _ = read_any_layout(write_medusa(tmp_path / "fewer", heads.state_dict(), num_heads=2, num_layers=1))
    assert cfg.num_heads == 4
    with pytest.raises(HeadsConfigError, match="medusa_num_heads 5, the weights hold 4 heads"):
        read_any_layout(write_medusa(tmp_path / "more", heads.state_dict(), num_heads=5, num_layers=1))


def test_medusa_pickle_that_needs_code_is_refused(tmp_path):
    heads = medusa_head_module(num_heads=2, num_layers=1, hidden=HIDDEN, vocab=VOCAB)
    path = write_medusa(tmp_path / "m", heads.state_dict(), num_heads=2, num_layers=1, weights="pt")
    torch.save(heads, path / "medusa_lm_head.pt")  # the whole module: unpickling it runs the project's classes
    with pytest.raises(HeadsConfigError, match=r"weights_only=True\) refuses"):
        read_any_layout(path)


def test_medusa_pickle_of_something_else_than_a_state_dict_is_refused(tmp_path):
    heads = medusa_head_module(num_heads=2, num_layers=1, hidden=HIDDEN, vocab=VOCAB)
    path = write_medusa(tmp_path / "m", heads.state_dict(), num_heads=2, num_layers=1, weights="pt")
    torch.save([torch.zeros(3)], path / "medusa_lm_head.pt")
    with pytest.raises(HeadsConfigError, match="holds a list, not a state dict of named tensors"):
        read_any_layout(path)


def write_broken_medusa(path: Path, mutate: Callable[[dict], None], **kwargs) -> Path:
    state = dict(medusa_head_module(num_heads=2, num_layers=1, hidden=HIDDEN, vocab=VOCAB).state_dict())
    mutate(state)
    return write_medusa(path, state, num_heads=2, num_layers=1, **kwargs)


@pytest.mark.parametrize("mutate, kwargs, message", [
    (lambda s: s.update({"1.1.weight": torch.zeros(VOCAB, HIDDEN + 1)}), {},
     r"tensor 1\.1\.weight has shape \(97, 65\), expected \(97, 64\)"),
    (lambda s: s.update({"0.0.linear.bias": torch.zeros(HIDDEN - 1)}), {}, r"tensor 0\.0\.linear\.bias has shape"),
    (lambda s: s.pop("1.0.linear.bias"), {}, r"tensor 1\.0\.linear\.bias is missing"),
    (lambda s: s.update({"0.0.scale": torch.zeros(1)}), {}, "outside the Medusa layout.*0.0.scale"),
    (lambda s: None, {"config": {"medusa_num_layers": 2}}, "medusa_num_layers 2, the weights hold 1"),
])
def test_medusa_wrong_files_are_refused_naming_the_problem(tmp_path, mutate, kwargs, message):
    with pytest.raises(HeadsConfigError, match=message):
        read_any_layout(write_broken_medusa(tmp_path / "m", mutate, **kwargs))


def test_medusa_config_without_weights_names_the_files_it_expected(tmp_path):
    path = tmp_path / "m"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "model_type": "llama"}))
    with pytest.raises(HeadsConfigError, match="medusa_lm_head.safetensors or medusa_lm_head.pt"):
        read_any_layout(path)


# ----- EAGLE-3 ------------------------------------------------------------------------------------------------
SHAPE = EagleShape()


def test_speculators_eagle3_round_trip_fuses_projections_and_makes_d2t_absolute(tmp_path):
    public, draft_ids = eagle3_public_tensors(SHAPE)
    path = write_speculators_eagle3(tmp_path / "e", public, SHAPE, aux_layer_ids=[2, 0, 1])
    cfg, head = read_module(path)

    assert (cfg.kind, cfg.layout, cfg.target_name, cfg.target_fingerprint) == ("eagle", "speculators", TARGET_NAME, "")
    assert cfg.feature_streams == (0, 1, 2)  # layer order, as vLLM concatenates them
    assert (cfg.hidden_size, cfg.vocab_size, cfg.draft_vocab_size) == (SHAPE.hidden, SHAPE.vocab, SHAPE.draft_vocab)
    assert (cfg.num_attention_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (
        SHAPE.heads, SHAPE.kv_heads, SHAPE.head_dim, SHAPE.intermediate)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.rope_scaling, cfg.attention_bias) == (1e-5, 10000.0, None, False)

    attn, mlp = "layers.0.self_attn.", "layers.0.mlp."
    assert torch.equal(head.d2t, draft_ids)
    assert torch.equal(head.d2t, torch.arange(SHAPE.draft_vocab) + public["d2t"])
    assert torch.equal(head.layer.self_attn.qkv_proj.weight,
                       torch.cat([public[attn + "q_proj.weight"], public[attn + "k_proj.weight"],
                                  public[attn + "v_proj.weight"]]))
    assert torch.equal(head.layer.mlp.gate_up_proj.weight,
                       torch.cat([public[mlp + "gate_proj.weight"], public[mlp + "up_proj.weight"]]))

    eps = cfg.rms_norm_eps
    x = torch.randn(5, SHAPE.hidden)  # [T, H]
    embeds = torch.randn(5, SHAPE.hidden)
    features = torch.randn(5, SHAPE.num_streams * SHAPE.hidden)
    two = torch.cat([rms(embeds, public["layers.0.input_layernorm.weight"], eps),
                     rms(x, public["layers.0.hidden_norm.weight"], eps)], dim=-1)  # [T, 2H]
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(head.project(features), features @ public["fc.weight"].T, **close)
    torch.testing.assert_close(head.layer.attention_input(embeds, x), two, **close)
    torch.testing.assert_close(
        head.layer.self_attn.qkv_proj(two),
        torch.cat([two @ public[attn + f"{p}_proj.weight"].T for p in "qkv"], dim=-1), **close)
    torch.testing.assert_close(
        head.layer.mlp(x),
        (F.silu(x @ public[mlp + "gate_proj.weight"].T) * (x @ public[mlp + "up_proj.weight"].T))
        @ public[mlp + "down_proj.weight"].T, **close)
    torch.testing.assert_close(head.logits(x), rms(x, public["norm.weight"], eps) @ public["lm_head.weight"].T,
                               **close)


def test_speculators_eagle3_sharded_weights_are_merged_by_their_index(tmp_path):
    public, _ = eagle3_public_tensors(SHAPE)
    path = write_speculators_eagle3(tmp_path / "e", public, SHAPE, aux_layer_ids=[0, 1, 2])
    whole = read_any_layout(path)[1]
    (path / "model.safetensors").unlink()
    names = sorted(public)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, shard_names in shards.items():
        save_file({name: public[name] for name in shard_names}, str(path / shard))
    weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))

    sharded = read_any_layout(path)[1]
    assert sorted(sharded) == sorted(whole)
    assert all(torch.equal(sharded[name], whole[name]) for name in whole)


def test_speculators_eagle3_qkv_biases_are_fused_in_order(tmp_path):
    public, _ = eagle3_public_tensors(SHAPE, attention_bias=True)
    path = write_speculators_eagle3(tmp_path / "e", public, SHAPE, aux_layer_ids=[0, 1, 2],
                                    layer_overrides={"attention_bias": True})
    cfg, head = read_module(path)
    assert cfg.attention_bias
    assert torch.equal(head.layer.self_attn.qkv_proj.bias,
                       torch.cat([public[f"layers.0.self_attn.{p}_proj.bias"] for p in "qkv"]))


def test_eagle3_without_named_layers_takes_vllms_default_from_the_target_layer_count(tmp_path):
    public, _ = eagle3_public_tensors(SHAPE)
    path = write_speculators_eagle3(tmp_path / "e", public, SHAPE, aux_layer_ids=None)
    with pytest.raises(HeadsConfigError, match="pass target_num_layers"):
        read_any_layout(path)
    cfg, _ = read_any_layout(path, target_num_layers=12)
    assert cfg.feature_streams == (2, 6, 9)
    head = load_heads(path, torch.float32, CPU, target_num_layers=3)  # the tiny target: 2, 1, 0 in layer order
    assert head.config.feature_streams == (0, 1, 2)


def test_eagle3_authors_layout_reads_as_the_same_head(tmp_path):
    public, _ = eagle3_public_tensors(SHAPE, seed=5)
    spec_cfg, spec_state = read_any_layout(
        write_speculators_eagle3(tmp_path / "spec", public, SHAPE, aux_layer_ids=[0, 1, 2]))
    authors_path = write_eagle3_authors(tmp_path / "authors", public, SHAPE, aux_layer_ids=[0, 1, 2])
    assert (authors_path / "pytorch_model.bin").is_file()  # a torch pickle, read with weights_only
    cfg, state = read_any_layout(authors_path)

    assert cfg.target_name == ""  # the authors' config does not name the target
    assert cfg.to_json() == {**spec_cfg.to_json(), "target_name": ""}
    assert sorted(state) == sorted(spec_state)
    for name in state:
        assert torch.equal(state[name], spec_state[name]), name


def drop(name: str) -> Callable[[dict], None]:
    return lambda tensors: tensors.pop(name)


def put(name: str, tensor: torch.Tensor) -> Callable[[dict], None]:
    return lambda tensors: tensors.update({name: tensor})


def flip_one_t2d(tensors: dict) -> None:
    t2d = tensors["t2d"].clone()
    t2d[int(torch.arange(SHAPE.vocab)[~t2d][0])] = True  # a target id the draft vocabulary does not hold
    t2d[int(tensors["d2t"][0])] = False  # draft id 0's target (d2t[0] is its offset from 0)
    tensors["t2d"] = t2d


@pytest.mark.parametrize("fields, layer, mutate, message", [
    ({"norm_before_fc": True}, {}, None, "norm_before_fc is set"),
    ({"norm_before_residual": True}, {}, None, "norm_before_residual is set"),
    ({"embed_requires_grad": True}, {}, None, "embed_requires_grad is set"),
    ({"speculators_model_type": "dflash"}, {}, None, "'dflash'; Tandem reads eagle3 heads only"),
    ({"target_hidden_size": 128}, {}, None, "hidden size 64 differs from the target's 128"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2]}, {}, None, "names 2 target layers"),
    ({}, {"num_hidden_layers": 2}, None, "2 decoder layers"),
    ({}, {}, put("fc.bias", torch.zeros(SHAPE.hidden)), r"no place for: \['fc.bias'\]"),
    ({}, {}, put("layers.1.mlp.down_proj.weight", torch.zeros(1)), r"decoder layers \['1'\]"),
    ({}, {}, put("layers.0.self_attn.k_proj.weight", torch.zeros(3, 2 * SHAPE.hidden)),
     r"tensor layers.0.self_attn.k_proj.weight has shape \(3, 128\), expected \(32, 128\)"),
    ({}, {}, drop("lm_head.weight"), "tensor lm_head.weight is missing"),
    ({}, {}, put("d2t", torch.full((SHAPE.draft_vocab,), SHAPE.vocab)), "outside the target's vocabulary of 97"),
    ({}, {}, flip_one_t2d, "d2t and t2d disagree"),
    ({}, {}, drop("d2t"), "no d2t"),
])
def test_eagle3_variants_and_wrong_files_are_refused_naming_the_problem(tmp_path, fields, layer, mutate, message):
    public, _ = eagle3_public_tensors(SHAPE)
    if mutate is not None:
        mutate(public)
    path = write_speculators_eagle3(tmp_path / "e", public, SHAPE, aux_layer_ids=[0, 1, 2], layer_overrides=layer,
                                    **fields)
    with pytest.raises(HeadsConfigError, match=message):
        read_any_layout(path)


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.pop("norm_before_residual"), "does not say norm_before_residual"),
    (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), "'qwen3'; Tandem's EAGLE-3 layer is Llama's"),
    (lambda c: c["transformer_layer_config"].pop("intermediate_size"), "lacks 'intermediate_size'"),
])
def test_eagle3_configs_tandem_cannot_follow_are_refused(tmp_path, edit, message):
    public, _ = eagle3_public_tensors(SHAPE)
    path = write_speculators_eagle3(tmp_path / "e", public, SHAPE, aux_layer_ids=[0, 1, 2])
    config = json.loads((path / "config.json").read_text())
    edit(config)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(HeadsConfigError, match=message):
        read_any_layout(path)


# ----- any layout ---------------------------------------------------------------------------------------------
def test_a_directory_of_nothing_known_lists_what_it_found(tmp_path):
    path = tmp_path / "h"
    path.mkdir()
    (path / "weights.npz").write_bytes(b"")
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(HeadsConfigError, match=r"holds no heads Tandem can read \(found: config.json, weights.npz\)"):
        read_any_layout(path)
    with pytest.raises(HeadsConfigError, match="no heads at"):
        read_any_layout(tmp_path / "absent")
    with pytest.raises(HeadsConfigError, match="expected a directory"):
        read_any_layout(path / "weights.npz")


def test_tandems_own_layout_keeps_a_public_layouts_heads(tmp_path):
    heads = medusa_head_module(num_heads=2, num_layers=1, hidden=HIDDEN, vocab=VOCAB)
    cfg, module = read_module(write_medusa(tmp_path / "m", heads.state_dict(), num_heads=2, num_layers=1))
    save_heads(module, tmp_path / "tandem")
    again_cfg, again = read_module(tmp_path / "tandem")
    assert again_cfg == cfg
    x = torch.randn(3, HIDDEN)
    assert torch.equal(again(x), module(x))


def test_heads_for_another_target_are_refused(tmp_path):
    target = tiny_target()
    narrow = medusa_head_module(num_heads=2, num_layers=1, hidden=32, vocab=VOCAB)
    cfg, _ = read_any_layout(write_medusa(tmp_path / "narrow", narrow.state_dict(), num_heads=2, num_layers=1))
    with pytest.raises(HeadsConfigError, match=f"made for {TARGET_NAME} \\(hidden size 32"):
        cfg.check_target(target, "fingerprint-of-the-tiny-target", "under test")

    fitting = medusa_head_module(num_heads=2, num_layers=1, hidden=HIDDEN, vocab=VOCAB)
    cfg, _ = read_any_layout(write_medusa(tmp_path / "fits", fitting.state_dict(), num_heads=2, num_layers=1))
    cfg.check_target(target, "fingerprint-of-the-tiny-target", "under test")  # the same shape: accepted

    public, _ = eagle3_public_tensors(SHAPE)
    cfg, _ = read_any_layout(write_speculators_eagle3(tmp_path / "deep", public, SHAPE, aux_layer_ids=[2, 16, 29]))
    with pytest.raises(HeadsConfigError, match=r"read layers \[16, 29\]; this target has 3"):
        cfg.check_target(target, "fingerprint-of-the-tiny-target", "under test")
