"""Every row is fixed by its position (tandem/attention/sdpa.py): a token's KV and logits are bitwise the same
whether it was a prompt token, a decoded token, a verified draft or a node of a token tree.

This is what lets the prefix cache hold generated tokens' blocks (docs/DESIGN.md, "Prefix caching"): a later prompt
that holds those tokens computes exactly the KV the cached blocks hold. Decoded rows used to be computed row by row
over exactly their visible keys, which rounded otherwise (every decoded position of SmolLM2, bf16 and fp32).
"""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine import ForwardItem, ModelEngine
from tests.target_worker.test_engine import kv_of

# How a sequence's generated tokens arrive after its prompt: decode steps (1), verified chains of several lengths,
# runs that cross attention pieces (4 positions) and KV blocks (16 positions) anywhere.
RUNS = [1, 5, 3, 1, 8, 2, 1, 4, 16, 1, 7]


def load(model_dir, dtype: str) -> ModelEngine:
    config = EngineConfig(model_dir, dtype=dtype, kv_cache_tokens=4096, block_size=16)
    if not config.pack_weights:  # then the linear layers make no bitwise promise across run lengths either
        pytest.skip(f"{dtype} weights are not packed on this CPU (tandem/models/packed.py)")
    engine = ModelEngine.load(config)
    assert engine.rows_fixed_by_position
    return engine


def generated_then_whole(engine: ModelEngine, tokens: list[int], prompt_len: int) -> tuple[torch.Tensor, ...]:
    """The KV and logits of ``tokens[prompt_len:]`` fed in ``RUNS`` after the prompt, and of all of ``tokens``
    fed as one prompt run: ``[2, L, len, Hkv, D]`` twice, then ``[generated, vocab]`` twice."""
    engine.forward([ForwardItem("fed", tokens[:prompt_len], num_logits=1, prompt=True)])
    logits, at, i = [], prompt_len, 0
    while at < len(tokens):
        count = min(RUNS[i % len(RUNS)], len(tokens) - at)
        logits.extend(engine.forward([ForwardItem("fed", tokens[at:at + count], num_logits=count)]))
        at, i = at + count, i + 1
    whole = engine.forward([ForwardItem("whole", tokens, num_logits=len(tokens) - prompt_len, prompt=True)])[0]
    try:
        return kv_of(engine, "fed"), kv_of(engine, "whole"), torch.cat(logits), whole
    finally:
        engine.release("fed")
        engine.release("whole")


def assert_same_rows(engine: ModelEngine, prompt_len: int, generated: int) -> None:
    tokens = [(7 * i + 3) % engine.config.vocab_size for i in range(prompt_len + generated)]
    fed_kv, whole_kv, fed_logits, whole_logits = generated_then_whole(engine, tokens, prompt_len)
    differing = (fed_kv != whole_kv).flatten(3).any(-1).any(0).any(0)  # [len]: positions whose KV differs
    assert not differing.any(), f"KV differs at positions {differing.nonzero().flatten().tolist()[:8]}"
    assert torch.equal(fed_logits, whole_logits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("prompt_len", [1, 6, 37])
def test_decoded_and_verified_rows_are_the_rows_a_prompt_computes(tiny_qwen2_dir, dtype, prompt_len,
                                                                  every_linear_packed):
    assert_same_rows(load(tiny_qwen2_dir, dtype), prompt_len, generated=60)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_real_model_s_decoded_rows_are_its_prompt_rows(smollm2_dir, dtype):
    """SmolLM2 (3 query heads per KV head): where row-by-row decoding rounded otherwise at every position."""
    engine = load(smollm2_dir, dtype)
    cases = ((37, 45), (509, 12)) if dtype == "bfloat16" else ((37, 45),)  # (509: rows cross 512 keys)
    for prompt_len, generated in cases:
        assert_same_rows(engine, prompt_len, generated)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_tree_path_s_kv_is_the_kv_its_tokens_get_as_a_prompt(tiny_qwen2_dir, dtype, every_linear_packed):
    engine = load(tiny_qwen2_dir, dtype)
    prompt = [(5 * i + 1) % engine.config.vocab_size for i in range(21)]
    tokens = [11, 12, 13, 14, 15, 16, 17]
    parents = [-1, -1, 0, 1, 2, 4, 5]  # two branches; the deeper one (11 -> 13 -> 15 -> 16 -> 17) crosses a piece
    engine.forward([ForwardItem("tree", prompt, num_logits=1, prompt=True)])
    logits = engine.forward([ForwardItem("tree", tokens, num_logits=len(tokens), parents=parents)])[0]
    path = [0, 2, 4, 5, 6]
    engine.keep_path("tree", len(prompt), path)  # the kept path's KV moved to a chain's positions
    chain = [tokens[n] for n in path]
    whole = engine.forward([ForwardItem("whole", [*prompt, *chain], num_logits=len(chain), prompt=True)])[0]
    assert torch.equal(kv_of(engine, "tree"), kv_of(engine, "whole")[:, :, :len(prompt) + len(chain)])
    assert torch.equal(logits[path], whole)
