"""Decode and verify steps through ``StepGraphs``: what a CUDA graph replays, tested on a CPU with the eager
stand-in for capture (``EagerRecorder``: the same static buffers, padding and scratch block, replayed by running
the step again). The capture itself needs a GPU: the gpu-check measures it there."""

from __future__ import annotations

import contextlib
import types

import pytest
import torch

from tandem.config import EngineConfig
from tandem.engine import ForwardItem, ModelEngine
from tandem.errors import InvalidRequestError
from tandem.step_graphs import MAX_GRAPH_BATCH, CudaGraphRecorder, EagerRecorder, GraphShape

PROMPTS = [[5, 9, 13, 2, 7, 1, 4], [3, 3, 8], [11, 6, 2, 9, 9, 14, 1, 5, 7, 3, 12, 2, 6], [1, 2]]


def engines(model_dir, block_size=4):
    """Two engines over the same weights: one eager, one with step graphs."""
    cfg = EngineConfig(model_dir, dtype="float32", block_size=block_size, kv_cache_tokens=1024, prefix_caching=False)
    eager, graphed = ModelEngine.load(cfg), ModelEngine.load(cfg)
    recorder = EagerRecorder()
    graphed.use_step_graphs(recorder)
    return eager, graphed, recorder


def kv_of(engine, seq_id):
    """The K and V a sequence holds, [layers, len, Hkv, D] each."""
    cache = engine.kv_cache
    slots = cache.slots(seq_id, list(range(cache.length(seq_id))))
    key = cache.key.view(cache.key.shape[0], -1, *cache.key.shape[-2:])[:, slots]
    value = cache.value.view(cache.value.shape[0], -1, *cache.value.shape[-2:])[:, slots]
    return key, value


def test_decode_and_verify_steps_through_graphs_give_the_eager_logits_and_kv(tiny_qwen2_dir):
    eager, graphed, recorder = engines(tiny_qwen2_dir)
    for engine in (eager, graphed):
        for i, prompt in enumerate(PROMPTS):
            engine.forward([ForwardItem(i, prompt, prompt=True)])  # prompts run eagerly
    assert graphed.graphs.replays == 0
    steps = [
        [ForwardItem(i, [4 + i]) for i in range(3)],  # decode, 3 sequences: the 4-sequence graph
        [ForwardItem(i, [7 + i]) for i in range(3)],  # the same shape: replayed, not captured again
        [ForwardItem(i, [1, 2, 3, 4, 5], num_logits=5) for i in (0, 2)],  # verify of a 4-token chain
        [ForwardItem(3, [6])],  # one sequence alone
        [ForwardItem(i, [9, 8], num_logits=2) for i in range(4)],
    ]
    for items in steps:
        want = eager.forward(items)
        got = graphed.forward(items)
        for w, g in zip(want, got):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)
    assert graphed.graphs.replays == len(steps)
    assert recorder.recorded == graphed.graphs.captured == 4  # (4, 1), (2, 5), (1, 1), (4, 2): the window of one
    for i in range(len(PROMPTS)):
        for g, w in zip(kv_of(graphed, i), kv_of(eager, i)):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-4)
    # and what a graph computes next agrees too: a greedy continuation, step by step
    for _ in range(6):
        tokens = [int(logits[-1].argmax()) for logits in eager.forward([ForwardItem(i, [5]) for i in range(4)])]
        assert tokens == [int(logits[-1].argmax()) for logits in graphed.forward([ForwardItem(i, [5])
                                                                                   for i in range(4)])]


def test_padding_rows_write_only_the_scratch_block(tiny_qwen2_dir):
    """The rows that pad a batch to its graph's size write K/V, and must write it where no sequence reads."""
    _, graphed, _ = engines(tiny_qwen2_dir)
    for i, prompt in enumerate(PROMPTS):
        graphed.forward([ForwardItem(i, prompt, prompt=True)])
    scratch = graphed.graphs.scratch_block
    cache = graphed.kv_cache
    before_key, before_value = cache.key.clone(), cache.value.clone()
    graphed.forward([ForwardItem(0, [4, 4, 4], num_logits=3)])  # 1 sequence of 3 tokens: no padding rows
    # 3 sequences of 5 tokens in a 4-sequence graph: a padding row of 5 tokens, more than the scratch block's 4 slots
    graphed.forward([ForwardItem(i, [4] * 5, num_logits=5) for i in range(3)])
    changed = ((cache.key != before_key) | (cache.value != before_value)).flatten(3).any(-1).any(0)  # [blocks, slot]
    written = {(int(b), int(s)) for b, s in changed.nonzero()}
    own = {0: 8, 1: 5, 2: 5}  # tokens each sequence was given
    expected = {divmod(int(slot), cache.block_size) for seq, n in own.items()
                for slot in cache.slots(seq, list(range(cache.length(seq) - n, cache.length(seq))))}
    assert expected <= written  # the batches' own K/V
    assert {block for block, _ in written - expected} == {scratch}  # padding rows (and captures): scratch only
    assert cache.pool.refcount(scratch) == 1  # held for the engine's life: never handed to a sequence


def test_batches_a_graph_cannot_describe_run_eagerly(tiny_qwen2_dir):
    _, graphed, recorder = engines(tiny_qwen2_dir)
    for i, prompt in enumerate(PROMPTS):
        graphed.forward([ForwardItem(i, prompt, prompt=True)])
    eager_batches = [
        [ForwardItem(0, [1, 2]), ForwardItem(1, [3])],  # sequences bringing different numbers of tokens
        [ForwardItem(0, [1, 2, 3], parents=[-1, 0, 0], num_logits=3)],  # a speculation tree
        [ForwardItem(1, [1, 2], prompt=True)],  # prompt tokens
        [ForwardItem(2, list(range(1, 10)), num_logits=9)],  # more new tokens than a graph holds (8)
    ]
    for items in eager_batches:
        graphed.forward(items)
    assert graphed.graphs.replays == 0 and recorder.recorded == 0
    # a context longer than the KV pool's power-of-two window would need, or more sequences than a graph holds
    graphs = graphed.graphs
    assert graphs.max_window_blocks == 256 and graphs.min_window_blocks == 64  # 1,024 tokens of 4; 256 tokens
    assert MAX_GRAPH_BATCH == 64


def test_the_window_grows_in_powers_of_two_of_blocks_from_256_tokens(tiny_qwen2_dir):
    _, graphed, _ = engines(tiny_qwen2_dir, block_size=16)
    graphed.forward([ForwardItem("long", [1 + t % 90 for t in range(299)], prompt=True)])  # 299 tokens: 19 blocks
    items = [ForwardItem("long", [5])]
    batch_shape = graphed.graphs.shape_for(graphed_batch(graphed, items))
    assert batch_shape == GraphShape(batch=1, query_len=1, window_blocks=32)  # 300 tokens: 19 blocks, window 32


def graphed_batch(engine, items):
    """The ``ForwardBatch`` ``engine.forward(items)`` would compute (its slots allocated, then rolled back)."""
    lengths = [engine.seq_len(it.seq_id) for it in items]
    slots = engine.kv_cache.append_slots({it.seq_id: len(it.token_ids) for it in items})
    try:
        from tandem.engine import ForwardBatch

        return ForwardBatch(
            input_ids=torch.tensor([t for it in items for t in it.token_ids]),
            positions=torch.cat([it.positions(c) for it, c in zip(items, lengths)]),
            slot_mapping=torch.cat([slots[it.seq_id] for it in items]),
            block_tables=engine.kv_cache.block_table([it.seq_id for it in items]),
            query_lens=[len(it.token_ids) for it in items], context_lens=lengths,
            logit_rows=torch.tensor([0]), parents=torch.tensor([p for it in items for p in it.row_parents()]),
            prompt_runs=[it.prompt for it in items])
    finally:
        for it, length in zip(items, lengths):
            engine.kv_cache.rollback(it.seq_id, length)


def test_cuda_graphs_are_refused_where_they_cannot_run(tiny_qwen2_dir):
    with pytest.raises(InvalidRequestError, match="cuda graphs need a CUDA device"):
        EngineConfig(tiny_qwen2_dir, cuda_graphs=True)
    assert ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype="float32")).graphs is None  # off on a CPU


def test_cuda_graphs_default_to_on_for_one_rank_on_cuda_and_off_otherwise(tiny_qwen2_dir, monkeypatch):
    """Eager steps on a GPU are bound by kernel launches (an H200 ran 4.3-5.5x the tokens/s with graphs), so a
    one-rank CUDA engine graphs its steps unless told not to. The device is the one thing faked: no GPU here."""
    import tandem.config

    monkeypatch.setattr(tandem.config, "available_device", lambda device, *a: torch.device(device))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    on_cuda = dict(device="cuda", dtype="bfloat16")
    assert EngineConfig(tiny_qwen2_dir, **on_cuda).use_cuda_graphs is True
    assert EngineConfig(tiny_qwen2_dir, cuda_graphs=False, **on_cuda).use_cuda_graphs is False
    assert EngineConfig(tiny_qwen2_dir, tensor_parallel_size=2, **on_cuda).use_cuda_graphs is False
    with pytest.raises(InvalidRequestError, match="not captured across tensor-parallel ranks"):
        EngineConfig(tiny_qwen2_dir, tensor_parallel_size=2, cuda_graphs=True, **on_cuda)
    assert EngineConfig(tiny_qwen2_dir, dtype="float32").use_cuda_graphs is False


def test_a_captured_step_never_reads_the_device_from_the_host(tiny_qwen2_dir):
    """A CUDA graph replays kernels only: a step that reads a tensor's value on the host (``.item()``, ``.tolist()``,
    a Python ``if`` on a tensor) cannot be captured. With the model and its KV on the meta device, which holds no
    values, any such read fails loudly, so this test is the capture's stand-in for that rule on a CPU."""
    cpu = ModelEngine.load(EngineConfig(tiny_qwen2_dir, dtype="float32", block_size=4, kv_cache_tokens=1024))
    engine = ModelEngine.with_new_cache(cpu.model.to("meta"), cpu.kv_cache.num_blocks, 4, "sdpa")
    assert engine.kv_cache.key.device.type == "meta"
    recorder = EagerRecorder()
    engine.use_step_graphs(recorder)
    for items in ([ForwardItem(i, [5]) for i in range(3)],  # decode steps of new sequences: 3 in a graph of 4
                  [ForwardItem(i, [1, 2, 3, 4, 5], num_logits=5) for i in range(3)],  # a verify step's shape
                  [ForwardItem(i, [7]) for i in range(3)]):
        logits = engine.forward(items)
        assert all(part.device.type == "meta" for part in logits)
    assert engine.graphs.replays == 3 and recorder.recorded == 2


def test_a_step_that_cannot_be_captured_runs_eagerly_and_graphs_turn_off(tiny_qwen2_dir, caplog):
    """Graphs have not yet met a real GPU: a capture that fails there must cost speed, not requests."""
    eager, graphed, _ = engines(tiny_qwen2_dir)

    class Refusing:
        def record(self, step):
            raise RuntimeError("operation not permitted when stream is capturing")

    free = graphed.kv_cache.num_free_blocks
    graphed.use_step_graphs(Refusing())
    assert graphed.kv_cache.num_free_blocks == free  # the replaced graphs' scratch block went back
    items = [ForwardItem(i, [3, 5]) for i in range(2)]
    for engine in (eager, graphed):
        engine.forward([ForwardItem(i, PROMPTS[i], prompt=True) for i in range(2)])
    torch.testing.assert_close(graphed.forward(items)[0], eager.forward(items)[0])
    assert graphed.graphs.disabled == "RuntimeError: operation not permitted when stream is capturing"
    assert "every step runs eagerly from now on" in caplog.text
    assert graphed.graphs.captured == 0 and graphed.graphs.replays == 0
    assert graphed.forward([ForwardItem(0, [4])])[0].shape == (1, graphed.config.vocab_size)  # still serving


def test_where_flash_attn_is_installed_graphs_use_its_paged_kernel(tiny_qwen2_dir):
    """flash-attn reads each sequence's own length on the device: inside a graph it reads only the keys a sequence
    has, where the padded attention reads its whole window. The stand-in checks the kernel's argument contract."""
    from tandem.attention.flash import FlashAttention, FlashKVCacheGraphAttention
    from tests.test_attention_backends import FlashStandIn

    cfg = EngineConfig(tiny_qwen2_dir, dtype="float32", block_size=256, kv_cache_tokens=4096, prefix_caching=False)
    eager, graphed = ModelEngine.load(cfg), ModelEngine.load(cfg)
    flash = FlashStandIn()
    graphed.backend = FlashAttention(256, flash_module=flash, dtype=torch.float32)
    graphs = graphed.use_step_graphs(EagerRecorder())
    assert isinstance(graphs.attention, FlashKVCacheGraphAttention)
    for engine in (eager, graphed):
        engine.forward([ForwardItem(i, prompt, prompt=True) for i, prompt in enumerate(PROMPTS)])
    flash.calls.clear()
    for items in ([ForwardItem(i, [4 + i]) for i in range(3)],
                  [ForwardItem(i, [1, 2, 3, 4, 5], num_logits=5) for i in (0, 2, 3)]):
        for want, got in zip(eager.forward(items), graphed.forward(items)):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    assert graphs.replays == 2 and set(flash.calls) == {"kvcache"}


def test_warm_up_captures_the_common_shapes_first_and_times_replays_not_captures(tiny_qwen2_dir):
    """A capture mid-serving stalls every stream for two forwards, and a pass that captured is no price of a step:
    the cost fit (what adaptive k plans with) must not learn it."""
    from tandem.step_graphs import AHEAD_QUERY_LENS

    _, graphed, recorder = engines(tiny_qwen2_dir)  # blocks of 4 in a pool of 1,024 tokens
    graphed.warmup()
    windows = 3  # 256, 512 and 1,024 tokens: the pool holds no more
    assert recorder.recorded == graphed.graphs.captured == windows * len(AHEAD_QUERY_LENS) * 7  # batch 1..64
    assert graphed.graphs.replays >= 3  # warm-up's own decode and verify passes replayed what was captured
    # without warm-up, the first pass of a shape captures it, and is not observed; the next, replayed, is
    _, cold, recorder = engines(tiny_qwen2_dir)
    assert not cold.cost_fit.ready
    cold.forward([ForwardItem("new", [1] * 6, num_logits=6)])
    assert recorder.recorded == 1 and not cold.cost_fit.ready  # captured: not observed
    cold.forward([ForwardItem("new", [1] * 6, num_logits=6)])
    assert recorder.recorded == 1 and cold.cost_fit.ready  # replayed: observed


class FakeCuda:
    """The parts of ``torch.cuda`` a capture uses, with CUDA's notion of a current device (0 until changed):
    a stream made without a device is on the current one, as ``torch.cuda.graph``'s own capture stream is."""

    def __init__(self) -> None:
        self.current = 0
        self.replays: list[int] = []  # the current device at each replay (a replay launches on its stream)
        self.capturing: int | None = None  # the capture stream's device while a capture runs

    def device(self, device):
        fake = self

        class Current:
            def __enter__(self):
                self.before, fake.current = fake.current, torch.device(device).index
                return self

            def __exit__(self, *exc):
                fake.current = self.before

        return Current()

    def Stream(self, device=None):  # noqa: N802 - torch's name
        index = self.current if device is None else torch.device(device).index
        return types.SimpleNamespace(index=index, wait_stream=lambda other: None)

    def current_stream(self, device=None):
        return self.Stream(device)

    def stream(self, stream):
        return contextlib.nullcontext()

    def CUDAGraph(self):  # noqa: N802 - torch's name
        return types.SimpleNamespace(pool=lambda: (0, 1), replay=lambda: self.replays.append(self.current))

    @contextlib.contextmanager
    def graph(self, graph, pool=None, stream=None):
        capture = stream if stream is not None else self.Stream()
        self.capturing = capture.index
        yield
        self.capturing = None


def test_a_capture_on_a_second_gpu_records_there(monkeypatch):
    """torch.cuda.graph's own capture stream is on the current device: capturing for cuda:1 from cuda:0 left an
    empty graph (the step's kernels ran eagerly on cuda:1) whose every replay did nothing."""
    fake = FakeCuda()
    for name in ("device", "Stream", "current_stream", "stream", "CUDAGraph", "graph"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    recorder = CudaGraphRecorder(torch.device("cuda:1"))
    steps: list[tuple[int, int | None]] = []
    replay = recorder.record(lambda: steps.append((fake.current, fake.capturing)))
    assert steps == [(1, None), (1, 1)]  # the warm-up run, then the capture: on cuda:1, into a cuda:1 stream
    assert fake.current == 0  # and the thread's current device is left as it was
    replay()
    assert fake.replays == [1] and fake.current == 0


def test_timing_a_graphs_replays_writes_the_scratch_block_alone(tiny_qwen2_dir):
    """The gpu-check times a decode step's graph replayed back to back (``replay_seconds``): its rows are padding rows,
    so no sequence's KV moves, and the next real step still matches the eager engine's."""
    eager, graphed, _ = engines(tiny_qwen2_dir)
    for engine in (eager, graphed):
        for i, prompt in enumerate(PROMPTS[:2]):
            engine.forward([ForwardItem(i, prompt, prompt=True)])
        engine.forward([ForwardItem(i, [4 + i]) for i in range(2)])  # a graphed decode step on ``graphed``
    held = [kv_of(graphed, i) for i in range(2)]
    seconds = graphed.graphs.replay_seconds(GraphShape(2, 1, graphed.graphs.min_window_blocks), repeats=3)
    assert seconds > 0
    for i, (key, value) in enumerate(held):
        after = kv_of(graphed, i)
        assert torch.equal(after[0], key) and torch.equal(after[1], value)
    items = [ForwardItem(i, [9]) for i in range(2)]
    for want, got in zip(eager.forward(items), graphed.forward(items)):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
