"""KV rollback is exact, and a ragged batch computes what each sequence would alone."""

from __future__ import annotations

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine import ForwardItem, ModelEngine
from tandem.errors import KVCacheExhaustedError


@pytest.fixture(params=["float32", "bfloat16"])
def engine(request, tiny_qwen2_dir) -> ModelEngine:
    return ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype=request.param, kv_cache_tokens=1024, block_size=4))


def greedy_steps(engine: ModelEngine, seq, first: int, n: int) -> tuple[list[int], list[torch.Tensor]]:
    tokens, logits, token = [], [], first
    for _ in range(n):
        row = engine.forward([ForwardItem(seq, [token])])[0]
        logits.append(row)
        token = int(row.argmax())
        tokens.append(token)
    return tokens, logits


def test_rollback_is_as_if_the_tokens_were_never_seen(engine):
    prompt = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46]  # 11 tokens: blocks of 4 end mid-block
    engine.forward([ForwardItem("a", prompt[:-1])])
    decoded, _ = greedy_steps(engine, "a", prompt[-1], 10)
    # Forget the K/V of the last 6 decoded tokens, then decode on from there.
    engine.rollback("a", engine.seq_len("a") - 6)
    again, again_logits = greedy_steps(engine, "a", decoded[3], 8)

    # The same calls on a cache that never saw those 6: prefill, 4 decode steps, then on.
    engine.forward([ForwardItem("b", prompt[:-1])])
    first_four, _ = greedy_steps(engine, "b", prompt[-1], 4)
    assert first_four == decoded[:4]
    expected, expected_logits = greedy_steps(engine, "b", decoded[3], 8)
    assert again == expected
    for got, want in zip(again_logits, expected_logits):
        assert torch.equal(got, want)


def test_ragged_batch_equals_each_sequence_alone(engine):
    prompts = {"x": [5, 6, 7], "y": list(range(10, 31)), "z": [42]}
    alone = {}
    for seq, ids in prompts.items():
        alone[seq] = engine.forward([ForwardItem(f"solo-{seq}", ids, num_logits=len(ids))])[0]
        engine.release(f"solo-{seq}")
    batched = engine.forward([ForwardItem(s, ids, num_logits=len(ids)) for s, ids in prompts.items()])
    for (seq, _), got in zip(prompts.items(), batched):
        assert_same(got, alone[seq], engine.dtype)
    # A mixed step: one decode, one 3-token verify, one long chunk, each against its own run.
    # bf16 is bitwise equal by construction (batch-invariant attention and linear layers);
    # fp32 matmuls (MKL) change kernels with the row count: equal within 1e-4.
    step = {"x": [8], "y": [31, 32, 33], "z": list(range(43, 63))}
    batched = engine.forward([ForwardItem(s, ids, num_logits=len(ids)) for s, ids in step.items()])
    for (seq, ids), got in zip(step.items(), batched):
        engine.forward([ForwardItem(f"solo-{seq}", prompts[seq], num_logits=0)])
        want = engine.forward([ForwardItem(f"solo-{seq}", ids, num_logits=len(ids))])[0]
        assert_same(got, want, engine.dtype)


def test_verify_rows_equal_one_token_decode_steps(engine):
    """k+1 tokens scored at once give the logits of k+1 decode steps (bitwise in bf16)."""
    ids = list(range(20, 60))
    engine.forward([ForwardItem("a", ids[:30])])
    steps = torch.cat([engine.forward([ForwardItem("a", [t])])[0] for t in ids[30:36]])
    engine.rollback("a", 30)
    verified = engine.forward([ForwardItem("a", ids[30:36], num_logits=6)])[0]
    assert_same(steps, verified, engine.dtype)


def assert_same(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:  # the tiny model's layers are too small to pack (MIN_PACKED_ELEMENTS): MKL, no bitwise promise
        assert (got - want).abs().max().item() <= 1e-4


def test_exhausted_pool_raises_and_leaves_sequences_untouched(tiny_qwen2_dir):
    engine = ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype="float32", kv_cache_tokens=16, block_size=4))
    engine.forward([ForwardItem("a", [1, 2, 3, 4, 5, 6])])
    with pytest.raises(KVCacheExhaustedError, match="KV cache exhausted"):
        engine.forward([ForwardItem("a", [7, 8]), ForwardItem("b", list(range(1, 10)))])
    assert engine.seq_len("a") == 6 and not engine.kv_cache.has_sequence("b")


def test_failed_forward_rolls_back_the_appended_tokens(tiny_qwen2_dir):
    engine = ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype="float32", kv_cache_tokens=64))
    engine.forward([ForwardItem("a", [1, 2, 3])])
    with pytest.raises(IndexError):
        engine.forward([ForwardItem("a", [4]), ForwardItem("b", [10_000])])  # b: token id past the vocabulary
    assert engine.seq_len("a") == 3 and not engine.kv_cache.has_sequence("b")


# ----- the kernels under the bf16 promise, on real shapes -------------------------
# The tiny model's matmuls are too small to show every kernel switch; these shapes are
# SmolLM2's gate/up and Qwen2-0.5B's fused q/k/v (with bias), where oneDNN's bf16 matmul
# rounds one row differently at 1, 2-3 and 4+ rows on some CPUs.

@pytest.mark.parametrize("in_features,out_features,bias", [(576, 3072, False), (896, 1152, True)])
def test_bf16_linear_row_does_not_depend_on_how_many_rows_share_the_call(in_features, out_features, bias):
    from tandem.models.layers import RowStableLinear

    torch.manual_seed(3)
    layer = RowStableLinear(in_features, out_features, bias=bias).to(torch.bfloat16)
    x = torch.randn(64, in_features).to(torch.bfloat16)  # [64, in]
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(8)])  # [8, out], one call per row
        for rows in (2, 3, 4, 5, 8, 17, 64):
            n = min(rows, 8)
            assert torch.equal(layer(x[:rows])[:n], alone[:n]), f"{rows} rows"


def test_bf16_prefill_block_does_not_depend_on_its_neighbours():
    from tandem.models.layers import RowBlocks, RowStableLinear

    torch.manual_seed(4)
    layer = RowStableLinear(576, 1536, bias=False).to(torch.bfloat16)
    chunk, short = torch.randn(20, 576).to(torch.bfloat16), torch.randn(5, 576).to(torch.bfloat16)
    with torch.inference_mode():
        alone = layer(chunk, RowBlocks.from_query_lens([20], 16))  # [20, out]
        mixed = layer(torch.cat((short[:1], chunk, short[1:])), RowBlocks.from_query_lens([1, 20, 4], 16))
        short_alone = layer(short)  # [5, out]
    assert torch.equal(mixed[1:21], alone)
    assert torch.equal(torch.cat((mixed[:1], mixed[21:])), short_alone)


def test_row_blocks_group_short_runs_and_isolate_prompt_chunks():
    from tandem.models.layers import RowBlocks

    blocks = RowBlocks.from_query_lens([1, 5, 40, 1, 17, 3, 1], max_short_run=16)
    assert blocks.sizes == (6, 40, 1, 17, 4)
    assert blocks.prefill == (False, True, False, True, False)


# The same promise through weights packed for oneDNN (tandem/models/packed.py): fp32 everywhere, bf16
# where the CPU multiplies it natively. Shapes: SmolLM2's gate/up, Qwen2-0.5B's q/k/v with bias,
# Qwen2.5-1.5B's down projection.
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("in_features,out_features,bias", [(576, 3072, False), (896, 1152, True), (8960, 1536, False)])
def test_packed_linear_row_does_not_depend_on_how_many_rows_share_the_call(in_features, out_features, bias, dtype):
    from tandem.config import native_cpu_bf16
    from tandem.models.layers import RowStableLinear
    from tandem.models.packed import pack_linear_weights

    if dtype == torch.bfloat16 and not native_cpu_bf16():
        pytest.skip("bf16 is packed only on a CPU with native bf16 (avx512_bf16 or AMX)")
    torch.manual_seed(5)
    layer = RowStableLinear(in_features, out_features, bias=bias).to(dtype)
    dense = layer.weight.detach().clone()
    assert pack_linear_weights(layer) == 1 and layer.weight is None  # the dense copy is gone
    small = RowStableLinear(64, 128).to(dtype)  # a test model's layer: oneDNN's cost per call would dominate
    assert pack_linear_weights(small) == 0 and small.packed_weight is None
    x = torch.randn(300, in_features).to(dtype)  # [300, in]: up to a prompt chunk's size
    with torch.inference_mode():
        alone = torch.cat([layer(x[i : i + 1]) for i in range(8)])  # [8, out], one call per row
        for rows in (2, 3, 4, 5, 9, 17, 64, 300):
            n = min(rows, 8)
            assert torch.equal(layer(x[:rows])[:n], alone[:n]), f"{rows} rows"
        reference = torch.nn.functional.linear(x[:8].float(), dense.float(),
                                               None if layer.bias is None else layer.bias.float())
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2 * reference.abs().max().item()
        assert (alone.float() - reference).abs().max().item() <= tolerance


def test_packed_weights_resolve_per_dtype_and_refuse_what_cannot_be_packed(tiny_qwen2_dir, monkeypatch):
    from tandem import config
    from tandem.errors import InvalidRequestError

    assert EngineConfig(tiny_qwen2_dir, dtype="float32").pack_weights
    assert not EngineConfig(tiny_qwen2_dir, dtype="float32", packed_weights="off").pack_weights
    monkeypatch.setattr(config, "native_cpu_bf16", lambda: True)
    assert EngineConfig(tiny_qwen2_dir, dtype="bfloat16").pack_weights  # multiplied natively: packed
    assert not EngineConfig(tiny_qwen2_dir, dtype="bfloat16", packed_weights="off").pack_weights
    monkeypatch.setattr(config, "native_cpu_bf16", lambda: False)
    assert not EngineConfig(tiny_qwen2_dir, dtype="bfloat16").pack_weights  # emulated: the dense kernels
    with pytest.raises(InvalidRequestError, match="packed weights were asked for, but the dtype is torch.bfloat16 "
                                                  "and this CPU has no native bf16"):
        EngineConfig(tiny_qwen2_dir, dtype="bfloat16", packed_weights="on")
    with pytest.raises(InvalidRequestError, match="packed weights must be one of auto, on, off, got 'yes'"):
        EngineConfig(tiny_qwen2_dir, dtype="float32", packed_weights="yes")


@pytest.mark.slow
@pytest.mark.parametrize("dtype,packed", [("bfloat16", "auto"), ("bfloat16", "off"), ("float32", "auto")])
def test_smollm2_token_is_bitwise_the_same_decoded_verified_or_batched(smollm2_dir, dtype, packed):
    """The promise on a real model: what the tiny model cannot show (see the shapes above). bf16 runs
    packed where the CPU multiplies it natively (auto) and on the dense kernels (off) elsewhere."""
    engine = ModelEngine.load(EngineConfig(smollm2_dir, dtype=dtype, kv_cache_tokens=1024, packed_weights=packed))
    prompt = list(range(1000, 1040))
    for seq in ("a", "b"):
        engine.forward([ForwardItem(seq, prompt, num_logits=0)])
    drafts = [1500, 1501, 1502, 1503, 1504]
    steps = torch.cat([engine.forward([ForwardItem("a", [t])])[0] for t in drafts])  # [5, vocab]
    engine.rollback("a", len(prompt))
    verified = engine.forward([ForwardItem("a", drafts, num_logits=5)])[0]
    assert torch.equal(verified, steps)
    engine.rollback("a", len(prompt))
    batched = engine.forward([
        ForwardItem("b", [7]), ForwardItem("a", drafts, num_logits=5), ForwardItem("c", list(range(2000, 2030))),
    ])
    assert torch.equal(batched[1], steps)


def test_warmup_prices_a_prompt_token_from_one_warm_long_pass(tiny_qwen2_dir, monkeypatch):
    """The warm-up's first prompt pass pays for touching the KV pages and is forgotten; the kept one is as
    long as the pool allows (up to WARMUP_PROMPT_TOKENS), so a pass's fixed part is spread as on long prompts."""
    import tandem.engine as engine_module
    from tandem.cost_fit import PromptTokenCost

    seen: list[tuple[int, float]] = []
    real = PromptTokenCost.observe

    def spy(self, prompt_tokens, extra_s):
        seen.append((prompt_tokens, extra_s))
        real(self, prompt_tokens, extra_s)

    monkeypatch.setattr(PromptTokenCost, "observe", spy)
    for pool, expected in ((4096, engine_module.WARMUP_PROMPT_TOKENS), (96, 96)):
        seen.clear()
        engine = ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype="float32", kv_cache_tokens=pool))
        engine.warmup()
        assert [n for n, _ in seen] == [expected, expected]  # two prompt passes, no other pass priced
        kept = max(0.0, seen[1][1])
        assert engine.prompt_cost.per_token_s == pytest.approx(kept / expected)  # the first one forgotten
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks  # the scratch sequence released
