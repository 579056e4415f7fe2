"""The split, in one process (no collectives run): reading a rank's slices from the checkpoint equals
cutting the whole loaded model down to that rank, and the per-rank shapes are the ones promised."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.config import ModelConfig
from tandem.models import load_model
from tandem.models.tensor_parallel import ParallelModel, Shard, local_kv_heads, parallelize, part_range

CPU = torch.device("cpu")


def load(model_dir: Path, shard: Shard):
    cfg = ModelConfig.from_dir(model_dir)
    return load_model(model_dir, cfg, torch.float32, CPU, ParallelModel(shard, None)), cfg


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # tied and untied lm_head, q/k/v biases
@pytest.mark.parametrize("rank", [0, 1])
def test_sliced_loading_equals_cutting_the_loaded_model(family: str, rank: int, tiny_llama_dir, tiny_qwen2_dir):
    model_dir = tiny_llama_dir if family == "llama" else tiny_qwen2_dir
    shard = Shard(rank, 2)
    sliced, cfg = load(model_dir, shard)
    whole, _ = load(model_dir, Shard())
    cut = parallelize(whole, ParallelModel(shard, None))
    cut_params = dict(cut.named_parameters())
    for name, param in sliced.named_parameters():
        torch.testing.assert_close(param, cut_params[name], rtol=0, atol=0, msg=name)
    attn = sliced.layers[0].self_attn
    assert (attn.num_heads, attn.num_kv_heads) == (cfg.num_heads // 2, cfg.num_kv_heads // 2)
    assert local_kv_heads(sliced) == cfg.num_kv_heads // 2
    start, stop = part_range(cfg.vocab_size, shard)  # 97 ids: 49 on rank 0, 48 on rank 1
    assert sliced.lm_head.weight.shape[0] == stop - start == (49 if rank == 0 else 48)
    assert sliced.embed_tokens.weight.shape[0] == cfg.vocab_size  # the embedding stays whole
    if cfg.tie_word_embeddings:  # the head is a view of the embedding's rows, not a copy
        assert sliced.lm_head.weight.data_ptr() == sliced.embed_tokens.weight[start].data_ptr()


def test_a_whole_model_keeps_its_tied_head_as_the_embedding(tiny_llama_dir):
    model, _ = load(tiny_llama_dir, Shard())
    assert model.lm_head.weight is model.embed_tokens.weight
