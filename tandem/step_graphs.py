"""CUDA graphs of decode and verify steps: a small batch's forward replayed as one launch.

A decode or verify step of a small batch on a GPU is bound by kernel launches, not by the GPU: eager
PyTorch launches a dozen kernels per layer from Python, each a few microseconds of host time, for work
that takes the GPU about as long. gpt-fast and vLLM capture such steps as CUDA graphs and replay them.
``StepGraphs`` does that for the batches whose shape can be fixed in advance: every sequence brings the
same number ``q`` of new tokens as a chain (a decode step: 1; a verify step of a k-token chain: k + 1),
none of them prompt tokens, and no hidden states are asked for. Other batches (prompts, trees, mixed q,
heads' features) run eagerly, as before.

One graph per ``GraphShape``: the batch size rounded up to a power of two (at most ``MAX_GRAPH_BATCH``),
q (at most ``MAX_GRAPH_QUERY_LEN``), and the context window rounded up to a power-of-two number of blocks
(at least ``MIN_WINDOW_TOKENS``). Inside, attention is ``PaddedPagedAttention``, whose shapes depend on
those alone (or, where flash-attn is installed, its paged kernel, which reads each sequence's length on the
device). The common shapes are captured at warm-up (``capture_ahead``), any other the first time it is met
(two forwards' time, once; that pass is not timed into the engine's cost fit). A graph reads its
inputs from one device buffer that each step fills with one host-to-device copy: token ids, positions, KV
slots, lengths and block tables. The rows that pad a batch up to its graph's size write their K/V into a
scratch block the graphs hold for the engine's life, and are never read back; the real rows' K/V land in
their own slots exactly as an eager step writes them.

The recorder is passed in: ``CudaGraphRecorder`` on a GPU; ``EagerRecorder`` (each replay runs the same
step again, over the same buffers) lets a CPU test everything but the capture itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from tandem.attention.base import AttentionMetadata
from tandem.attention.flash import FlashAttention, FlashKVCacheGraphAttention
from tandem.attention.padded import PaddedPagedAttention

if TYPE_CHECKING:
    from tandem.engine import ForwardBatch, ModelEngine

log = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 64  # sequences; larger batches have enough work per launch to run eagerly
MAX_GRAPH_QUERY_LEN = 8  # new tokens per sequence: decode (1) and verify chains up to k = 7
MIN_WINDOW_TOKENS = 256  # the smallest context window a graph reads
MAX_GRAPHS = 256  # a bound on what capture costs in memory; shapes past it run eagerly
# Captured at warm-up (``capture_ahead``), so that serving seldom stops to capture: every batch size and tokens per
# sequence a graph takes, in windows up to this many tokens (one window where flash-attn reads lengths itself).
AHEAD_QUERY_LENS = tuple(range(1, MAX_GRAPH_QUERY_LEN + 1))
AHEAD_WINDOW_TOKENS = 1024


@dataclass(frozen=True, slots=True)
class GraphShape:
    batch: int  # sequences, a power of two
    query_len: int  # new tokens per sequence
    window_blocks: int  # KV blocks each sequence's attention reads, a power of two


class GraphRecorder(Protocol):
    def record(self, step: Callable[[], None]) -> Callable[[], None]:
        """Capture ``step`` and return what replays it."""


class CudaGraphRecorder:
    """Captures on a CUDA device; every graph allocates from one shared memory pool (they replay one at a
    time, and their outputs are copied into buffers of their own, outside the pool)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool: tuple[int, int] | None = None
        self._capture_stream: torch.cuda.Stream | None = None

    def record(self, step: Callable[[], None]) -> Callable[[], None]:
        # Everything on the engine's device, made current: torch.cuda.graph's own capture stream is made on
        # the current device, which for a worker on cuda:1 is still cuda:0 (and the current device is a
        # thread's own: the model thread's is never set). Captured there, the step's kernels would run
        # eagerly on cuda:1 outside the capture, leaving an empty graph whose every replay does nothing
        # (torch only warns). A replay launches on the current device's stream: it is made current too.
        with torch.cuda.device(self.device):
            if self._capture_stream is None:
                self._capture_stream = torch.cuda.Stream(self.device)
            # One eager run on a side stream first, as PyTorch's capture docs ask: lazy initialisation (cuBLAS
            # workspaces, the caching allocator's first blocks) must not happen inside a capture.
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                step()
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=self._capture_stream):
                step()
        self.pool = graph.pool()
        device = self.device

        def replay() -> None:
            with torch.cuda.device(device):
                graph.replay()

        return replay


class EagerRecorder:
    """A CPU's stand-in for capture: a replay runs the step again over the same buffers. What a CUDA graph
    adds beyond this (no host work on replay) cannot be tested without a GPU."""

    def __init__(self) -> None:
        self.recorded = 0

    def record(self, step: Callable[[], None]) -> Callable[[], None]:
        step()
        self.recorded += 1
        return step


@dataclass(slots=True)
class _Graph:
    """One captured shape: its input buffer (views into ``inputs``), its output, and its replay."""

    inputs: torch.Tensor  # [B*q*3 + B + B*M] int64 on the device: one host-to-device copy per step
    input_ids: torch.Tensor  # [B*q]
    positions: torch.Tensor  # [B*q]
    slot_mapping: torch.Tensor  # [B*q]
    seq_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, M]
    out: torch.Tensor  # [B*q, hidden]: the final hidden states
    replay: Callable[[], None] = lambda: None


def _next_power_of_two(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class StepGraphs:
    """The captured steps of one ``ModelEngine`` (its model, KV pool and layers)."""

    def __init__(self, engine: ModelEngine, recorder: GraphRecorder) -> None:
        self.engine = engine
        self.recorder = recorder
        self.attention = graph_attention(engine.backend)
        cache = engine.kv_cache
        self.block_size = cache.block_size
        # Held for the engine's life: the padding rows' K/V go here. Every slot of it is scratch.
        self.scratch_block = cache.pool.allocate()
        self.min_window_blocks = max(1, -(-MIN_WINDOW_TOKENS // self.block_size))
        self.max_window_blocks = _next_power_of_two(cache.num_blocks)
        if isinstance(self.attention, FlashKVCacheGraphAttention):
            # flash reads each sequence's own length: one window, the widest, serves every context
            self.min_window_blocks = self.max_window_blocks
        self._graphs: dict[GraphShape, _Graph] = {}
        self.replays = 0  # steps that ran as a graph (the gpu-check reports it)
        self.disabled: str | None = None  # why graphs are off after a failed capture; None: on

    @property
    def captured(self) -> int:
        return len(self._graphs)

    def shape_for(self, batch: ForwardBatch) -> GraphShape | None:
        """The graph a batch runs as, or None: it runs eagerly (see the module doc for which batches fit)."""
        if self.disabled is not None:
            return None
        query_lens = batch.query_lens
        q, sequences = query_lens[0], len(query_lens)
        if sequences > MAX_GRAPH_BATCH or q > MAX_GRAPH_QUERY_LEN or any(n != q for n in query_lens):
            return None
        if any(batch.prompt_runs) or not _is_chain(batch.parents, q):
            return None
        longest = max(batch.context_lens) + q
        window = max(self.min_window_blocks, _next_power_of_two(-(-longest // self.block_size)))
        if window > self.max_window_blocks:
            return None
        shape = GraphShape(_next_power_of_two(sequences), q, window)
        if shape not in self._graphs and len(self._graphs) >= MAX_GRAPHS:
            return None
        return shape

    def capture_ahead(self) -> int:
        """Capture the common shapes now (``AHEAD_QUERY_LENS`` x every batch size x windows up to
        ``AHEAD_WINDOW_TOKENS``): at warm-up, before any request waits on a capture. Returns how many it captured."""
        before = len(self._graphs)
        windows = [self.min_window_blocks]
        while windows[-1] * 2 <= self.max_window_blocks and windows[-1] * 2 * self.block_size <= AHEAD_WINDOW_TOKENS:
            windows.append(windows[-1] * 2)
        for shape in (GraphShape(1 << i, q, window) for window in windows for q in AHEAD_QUERY_LENS
                      for i in range(MAX_GRAPH_BATCH.bit_length())):
            if self.disabled is not None or len(self._graphs) >= MAX_GRAPHS:
                break
            if shape not in self._graphs:
                self._try_capture(shape)
        return len(self._graphs) - before

    def _try_capture(self, shape: GraphShape) -> _Graph | None:
        """``_capture``, or None with graphs turned off for good if it fails (a step the GPU cannot capture)."""
        try:
            return self._capture(shape)
        except Exception as exc:  # noqa: BLE001 - a step the GPU cannot capture still runs, eagerly
            self.disabled = f"{type(exc).__name__}: {exc}"
            log.warning("capturing a CUDA graph of %s failed (%s); every step runs eagerly from now on", shape,
                        self.disabled)
            return None

    def run(self, batch: ForwardBatch, shape: GraphShape) -> torch.Tensor | None:  # -> [T, hidden], the batch's rows
        """The batch's final hidden states, through its shape's graph (captured now if it is new); None if the capture
        failed: the caller computes the batch eagerly, and no graph is tried again (``disabled`` says why)."""
        graph = self._graphs.get(shape) or self._try_capture(shape)
        if graph is None:
            return None
        graph.inputs.copy_(self._host_inputs(batch, shape), non_blocking=False)
        graph.replay()
        self.replays += 1
        return graph.out[: len(batch.input_ids)]

    @torch.inference_mode()  # as the engine's forward: its buffers are inference tensors
    def replay_seconds(self, shape: GraphShape, repeats: int) -> float:
        """Seconds one replay of ``shape``'s graph (captured now if new) takes back to back: the device's time for
        the step when no launch waits on the host (the gpu-check's measure). Every row is a padding row, so the
        replays write the scratch block alone; padded attention reads the whole window whatever the lengths, so the
        time is a real step's (flash-attn's kernel reads lengths: there it is a short context's)."""
        graph = self._graphs.get(shape) or self._try_capture(shape)
        if graph is None:
            raise RuntimeError(f"no graph of {shape}: {self.disabled}")
        device = self.engine.device
        graph.inputs.copy_(self._scratch_inputs(shape))  # every row on the scratch block: nothing real overwritten
        graph.replay()  # warm
        if device.type != "cuda":
            started = time.perf_counter()
            for _ in range(repeats):
                graph.replay()
            return (time.perf_counter() - started) / repeats
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.device(device):
            begin.record()
            for _ in range(repeats):
                graph.replay()
            end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1000 / repeats

    def _scratch_inputs(self, shape: GraphShape) -> torch.Tensor:  # -> [inputs] int64 on the host
        """Inputs of ``shape`` whose every row is a padding row: KV written to the scratch block alone."""
        b, q, m = shape.batch, shape.query_len, shape.window_blocks
        slots = (self.scratch_block * self.block_size + torch.arange(q, dtype=torch.int64) % self.block_size).repeat(b)
        return torch.cat((torch.zeros(b * q, dtype=torch.int64), torch.zeros(b * q, dtype=torch.int64), slots,
                          torch.full((b,), q, dtype=torch.int64),
                          torch.full((b * m,), self.scratch_block, dtype=torch.int64)))

    def _host_inputs(self, batch: ForwardBatch, shape: GraphShape) -> torch.Tensor:  # -> [inputs] int64 on the host
        """A step's inputs laid out as its graph's buffer: the batch's rows, then the padding rows'."""
        b, q, m = shape.batch, shape.query_len, shape.window_blocks
        sequences, tokens = len(batch.query_lens), len(batch.input_ids)
        # [q]: every padding row writes into the scratch block, wrapping round it when q is more than a block
        # holds (several rows on one slot: whichever lands last, nobody reads it)
        scratch_slots = self.scratch_block * self.block_size + torch.arange(q, dtype=torch.int64) % self.block_size
        input_ids = torch.zeros(b * q, dtype=torch.int64)
        input_ids[:tokens] = batch.input_ids
        positions = torch.zeros(b * q, dtype=torch.int64)
        positions[:tokens] = batch.positions
        slots = scratch_slots.repeat(b)  # [B*q]
        slots[:tokens] = batch.slot_mapping
        seq_lens = torch.full((b,), q, dtype=torch.int64)
        seq_lens[:sequences] = torch.tensor([c + q for c in batch.context_lens], dtype=torch.int64)
        tables = torch.full((b, m), self.scratch_block, dtype=torch.int64)
        width = min(m, batch.block_tables.shape[1])
        tables[:sequences, :width] = batch.block_tables[:, :width]
        return torch.cat((input_ids, positions, slots, seq_lens, tables.reshape(-1)))

    def _capture(self, shape: GraphShape) -> _Graph:
        engine = self.engine
        b, q, m = shape.batch, shape.query_len, shape.window_blocks
        tokens = b * q
        inputs = torch.zeros(3 * tokens + b + b * m, dtype=torch.int64, device=engine.device)
        input_ids, positions, slots, seq_lens, tables = inputs.split([tokens, tokens, tokens, b, b * m])
        tables = tables.view(b, m)
        graph = _Graph(inputs, input_ids, positions, slots, seq_lens, tables,
                       torch.empty(tokens, engine.config.hidden_size, dtype=engine.dtype, device=engine.device))
        # Until the first real step fills it, the buffer describes padding only: capture writes scratch K/V.
        inputs.copy_(self._host_inputs(_empty_batch(), shape))
        meta = AttentionMetadata(
            query_lens=[q] * b, context_lens=[0] * b, cu_seqlens_q=seq_lens, cu_seqlens_k=seq_lens,  # (unread)
            seq_lens_k=seq_lens, slot_mapping=slots, block_tables=tables, block_size=self.block_size,
            tree_parents=[None] * b, prompt_runs=[False] * b,
        )

        def step() -> None:
            hidden = engine.model.hidden_states(input_ids, positions, engine.kv_cache, meta, self.attention,
                                                engine.num_layers)
            graph.out.copy_(hidden.final)

        with torch.inference_mode():
            graph.replay = self.recorder.record(step)
        self._graphs[shape] = graph
        return graph


def graph_attention(backend: object) -> PaddedPagedAttention | FlashKVCacheGraphAttention:
    """flash-attn's paged kernel where the engine has it (it reads only each sequence's own keys), else the padded
    attention (each sequence's whole window, masked)."""
    if isinstance(backend, FlashAttention):
        return FlashKVCacheGraphAttention(backend.flash)
    return PaddedPagedAttention()


def _is_chain(parents: torch.Tensor, query_len: int) -> bool:
    """Whether ``ForwardBatch.parents`` ``[T]`` describes chains of ``query_len`` rows each (row i's parent i - 1)."""
    chain = torch.arange(query_len, dtype=parents.dtype) - 1  # [q]
    return bool((parents.view(-1, query_len) == chain).all())


def _empty_batch() -> ForwardBatch:
    """A batch of no sequences: the buffer of a graph about to be captured is all padding."""
    from tandem.engine import ForwardBatch

    empty = torch.zeros(0, dtype=torch.int64)
    return ForwardBatch(input_ids=empty, positions=empty, slot_mapping=empty,
                        block_tables=torch.zeros(0, 0, dtype=torch.int32), query_lens=[], context_lens=[],
                        logit_rows=empty, parents=empty, prompt_runs=[])
