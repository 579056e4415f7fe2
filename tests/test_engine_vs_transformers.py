"""Our engine against transformers' own model on the same weights: logits and greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tandem.config import EngineConfig
from tandem.engine import ForwardItem, ModelEngine
from tandem.inprocess import GenerationRequest, SpeculativeGenerator
from tandem.sampling import SamplingParams

# fp32: the same math in a different order (fused q/k/v and gate/up matmuls, paged gathers).
# bf16: both sides round every op to 8 mantissa bits; differences grow layer by layer.
TOLERANCE = {torch.float32: 2e-4, torch.bfloat16: 0.25}
TOLERANCE_SMOLLM2 = {torch.float32: 2e-3, torch.bfloat16: 1.0}


def hf_logits(model_dir: Path, dtype: torch.dtype, ids: list[int]) -> torch.Tensor:
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    with torch.inference_mode():
        return hf(torch.tensor([ids])).logits[0].float()  # [T, vocab]


def prefill_and_decode_logits(engine: ModelEngine, ids: list[int], split: int) -> torch.Tensor:
    """Logits for every position: a prefill of ``ids[:split]`` then one token at a time."""
    rows = [engine.forward([ForwardItem("s", ids[:split], num_logits=split)])[0]]
    rows += [engine.forward([ForwardItem("s", [t])])[0] for t in ids[split:]]
    engine.release("s")
    return torch.cat(rows)


@pytest.mark.parametrize("family", ["tiny_llama_dir", "tiny_qwen2_dir"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiny_models_match_transformers(family, dtype, request):
    model_dir = request.getfixturevalue(family)
    ids = torch.randint(3, 97, (24,), generator=torch.Generator().manual_seed(0)).tolist()
    engine = ModelEngine.load(EngineConfig(model_dir,
                                           dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]))
    ours = prefill_and_decode_logits(engine, ids, split=10)
    ref = hf_logits(model_dir, dtype, ids)
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < TOLERANCE[dtype]
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def hf_greedy(model_dir: Path, dtype: torch.dtype, prompt: list[int], n: int) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
    with torch.inference_mode():
        # No min_new_tokens: it would mask EOS and pick another token where the model wants to stop.
        out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def our_greedy(engine: ModelEngine, prompt: list[int], n: int, stop_ids: frozenset[int] = frozenset()) -> list[int]:
    req = GenerationRequest(prompt, max_new_tokens=n, sampling=SamplingParams(), stop_token_ids=stop_ids, k_max=0)
    return SpeculativeGenerator(engine).generate([req])[0].token_ids


def test_tiny_qwen2_greedy_64_tokens_identical(tiny_qwen2_dir):
    prompt = [5, 17, 33, 2 + 40, 61, 8]
    engine = ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype="float32"))
    assert our_greedy(engine, prompt, 64) == hf_greedy(tiny_qwen2_dir, torch.float32, prompt, 64)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_smollm2_logits_match_transformers(smollm2_dir, dtype):
    from tandem.tokenizer import load_tokenizer

    ids = load_tokenizer(smollm2_dir).encode("The capital of France is Paris. The capital of Germany is")
    engine = ModelEngine.load(EngineConfig(smollm2_dir,
                                           dtype={torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]))
    ours = prefill_and_decode_logits(engine, ids, split=len(ids) - 4)
    ref = hf_logits(smollm2_dir, dtype, ids)
    assert (ours - ref).abs().max().item() < TOLERANCE_SMOLLM2[dtype]
    assert torch.equal(ours[-4:].argmax(-1), ref[-4:].argmax(-1))


@pytest.mark.slow
def test_smollm2_greedy_64_tokens_identical(smollm2_dir):
    from tandem.tokenizer import encode_prompt, load_tokenizer

    prompt = encode_prompt(load_tokenizer(smollm2_dir), "Write a long story about a lighthouse keeper.", chat=True)
    engine = ModelEngine.load(EngineConfig(smollm2_dir, dtype="float32"))
    ours = our_greedy(engine, prompt, 64, frozenset(engine.config.eos_token_ids))
    assert len(ours) == 64  # a prompt that really runs 64 tokens
    assert ours == hf_greedy(smollm2_dir, torch.float32, prompt, 64)
