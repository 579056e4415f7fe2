"""Configuration: one slotted dataclass per concern, validated in ``__post_init__``.

``ModelConfig`` is what a checkpoint's config.json says about its architecture;
``EngineConfig`` is how a worker runs that model (dtype, device, KV pool size,
attention backend). Both are read once, in ``main``, never at import time.

This module imports no torch at module level: the coordinator (which holds no
weights and runs in a slim image without torch) validates its configuration
here too. Only ``EngineConfig``, which only model-side processes build,
imports torch, when it resolves its device and dtype.
"""

from __future__ import annotations

import importlib.util
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.errors import InvalidRequestError, UnsupportedArchitectureError
from tandem.rpc.leases import DEFAULT_IDLE_TTL_S, DEFAULT_LEASE_S, MAX_IDLE_TTL_S, MAX_LEASE_S, MIN_LEASE_S
from tandem.rpc.room_waits import HOLD_S, ROOM_HOLD_S
from tandem.tracing import INSTALL_HINT, check_endpoint

if TYPE_CHECKING:
    import torch

    from tandem.rpc.auth import BearerAuth
    from tandem.rpc.tls import ClientTLS, ServerTLS

# model_type in config.json -> our family name. Qwen2 is Llama plus q/k/v biases.
SUPPORTED_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2"}
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

MAX_MODEL_NAME_CHARS = 256  # a served model name (OpenAI's model ids are short; a label value stays sane)

DTYPES = ("bfloat16", "float32", "float16")
DISCOVERY_MODES = ("static", "file", "dns", "kubernetes")  # names of torch dtypes
# How the coordinator picks a new request's replicas (coordinator/prefix_routing.py): prefix (the replica likely to
# hold the prompt's first blocks, within a bound on load) or load (most free KV, shortest queue).
PLACEMENT_MODES = ("prefix", "load")
# How a target's KV pool is shared where it runs short: fcfs (oldest sequences first; a request's priority must be
# 0, as vLLM's default refuses others) or priority (vLLM's: lower GenerateRequest.priority first, then fcfs).
SCHEDULING_POLICIES = ("fcfs", "priority")
ATTENTION_BACKENDS = ("auto", "sdpa", "flash", "reference")
QUANTIZATIONS = ("auto", "none", "int8")
# Linear weights reordered once for oneDNN (tandem/models/packed.py): row-invariant and cheap per extra
# row. auto: wherever they can be (fp32 on a CPU with oneDNN, bf16 where the CPU multiplies bf16
# natively); on: refuse to start otherwise.
PACKED_WEIGHTS = ("auto", "on", "off")
PACKED_WEIGHTS_HELP = ("linear weights reordered once for oneDNN (fp32 on a CPU, and bf16 on a CPU that multiplies "
                       "it natively), so that a forward of several tokens (verification, batches) costs little more "
                       "than one and every token's result is bitwise independent of the batch; auto: wherever it "
                       "applies, on: refuse to start where it cannot (default: %(default)s)")
# A draft's numbers only steer proposals the target checks, so drafts run lean by default:
# int8 weights and a head over the 32768 most common ids (measured on the Qwen 0.5B draft,
# bf16, one decode step: 53 ms full, 31 ms int8, 22 ms int8 with the cut head). "auto" is
# int8 unless the draft runs in fp32, where the int8 kernel has no fast path: a lean fp32
# draft step cost 1.46x a Qwen 1.5B target step (spec_bench, Intel Xeon), a dense one 0.32x.
# With dtype auto as well, a CPU draft runs bf16 + int8 wherever oneDNN runs bf16 (EngineConfig
# _resolve_dtype), even when the target runs fp32: a draft's dtype is its own business.
# On CUDA "auto" is "none": torch's CUDA kernel for int8 weights (_weight_int8pack_mm) runs a thread
# per output element over uncoalesced weight reads, where bf16 goes to cuBLAS; ask for int8 to have it.
DEFAULT_DRAFT_QUANTIZATION = "auto"
DEFAULT_DRAFT_VOCAB_LIMIT = 32768
MAX_GRPC_MESSAGE_BYTES = 2**31 - 1  # gRPC's message length is a signed 32-bit int


DEFAULT_KV_CACHE_TOKENS = 16384  # a worker's KV pool unless --kv-cache-tokens or --gpu-memory-utilization says


@dataclass(slots=True, frozen=True)
class ModelConfig:
    """Architecture hyperparameters of a decoder-only transformer."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    rope_scaling: dict[str, Any] | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise InvalidRequestError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise InvalidRequestError(f"model config: {name} must be positive")

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Read a Hugging Face config.json dict; refuse architectures we do not implement."""
        model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedArchitectureError(
                f"unsupported architecture {archs or model_type!r}: Tandem's engine implements "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_type {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        if cfg.get("use_sliding_window"):
            raise UnsupportedArchitectureError("sliding-window attention is not supported yet")
        # transformers 5 nests rope settings in rope_parameters; 4.x used top-level keys.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedArchitectureError(
                f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(f"unsupported hidden_act {cfg.get('hidden_act')!r}; only silu")
        num_heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // num_heads)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases; Llama only when attention_bias says so.
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    @classmethod
    def from_dir(cls, model_dir: Path) -> ModelConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise InvalidRequestError(f"{model_dir} has no config.json: not a Hugging Face model directory")
        return cls.from_hf_dict(json.loads(path.read_text()))


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 where the hardware multiplies it natively, else fp16 (GPUs) or fp32 (CPUs).

    A CPU with avx512_bf16 or AMX runs bf16 about 3x faster than fp32. Without them
    oneDNN still runs bf16, but emulated, bound by arithmetic: on an Intel Xeon with
    AVX-512 only, Qwen2.5-Coder-1.5B decoded at 1.26 tokens/s in bf16 against 1.86 in
    fp32, and verifying 5 tokens cost 2.95x a step against 0.95-1.2x in fp32 with
    packed weights (``tandem/models/packed.py``, which also makes fp32 row-invariant).
    """
    import torch

    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and native_cpu_bf16():
        return torch.bfloat16
    return torch.float32


def native_cpu_bf16() -> bool:
    """The CPU multiplies bf16 in hardware (avx512_bf16 or AMX), so oneDNN's bf16 kernels are fast."""
    import torch

    try:
        return cpu_runs_bf16() and bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:  # older builds lack the probes: assume the common case, emulated
        return False


def cpu_runs_bf16() -> bool:
    """oneDNN runs bf16 on this CPU, natively or emulated (AVX-512)."""
    import torch

    try:
        return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # older builds lack the probe
        return False


# The devices Tandem runs on: CPUs and NVIDIA GPUs (``cuda`` is the current one, ``cuda:N`` the N-th).
DEVICE_NAME = re.compile(r"(cpu|cuda)(:[0-9]+)?")


def check_device_name(text: str, flag: str = "device") -> None:
    """Refuse a device Tandem does not run on, naming ``flag``; imports no torch (`tandem up` checks its workers'
    ``--device`` with this before any process starts, and asks torch only about CUDA)."""
    if not DEVICE_NAME.fullmatch(text):
        raise InvalidRequestError(f"{flag} must be cpu, cuda or cuda:N, got {text!r} (Tandem runs on CPUs and "
                                  "NVIDIA GPUs)")


def available_device(text: str, flag: str = "device") -> torch.device:
    """``text`` as a torch device Tandem runs on (cpu, cuda, cuda:N) and this machine has; else an error naming
    ``flag`` (a worker's ``--device`` is refused here, not as a traceback from torch or a CUDA call)."""
    check_device_name(text, flag)
    import torch  # model-side only: see the module docstring

    device = torch.device(text)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU only"
            raise InvalidRequestError(f"{flag} {text} was asked for but CUDA is not available here (torch "
                                      f"{torch.__version__}, built for {build})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InvalidRequestError(f"{flag} {text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


@dataclass(slots=True)
class EngineConfig:
    """How one worker runs one model."""

    model_dir: Path
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS
    attention_backend: str = "auto"
    # CUDA: size the KV pool to this fraction of the device's memory instead (tandem/kv_sizing.py; kv_cache_tokens
    # is then not used).
    gpu_memory_utilization: float | None = None
    num_threads: int | None = None
    # Draft models only (see tandem/models/quantize.py): a target's logits define the output.
    quantization: str = "none"  # none | int8 (weight-only, per output channel) | auto (int8 unless fp32)
    vocab_limit: int | None = None  # score only the first N token ids
    # Processes (ranks) the model is split over, one device each (tandem/parallel): targets only.
    tensor_parallel_size: int = 1
    # How long a rank may be late inside a forward pass before the worker takes it for dead and exits
    # (tandem/parallel/ranks.py); a tensor-parallel worker's first CUDA steps may want more.
    rank_timeout_s: float = 30.0
    packed_weights: str = "auto"  # auto | on | off (see PACKED_WEIGHTS)
    # Keep the KV of committed full blocks after their sequence ends and reuse it for prompts that
    # start the same way (tandem/block_pool.py); off: every prompt is computed from its first token.
    prefix_caching: bool = True
    # Decode and verify steps of small batches replayed as captured CUDA graphs (tandem/step_graphs.py). None (auto):
    # on for a one-rank engine on CUDA, where eager steps are bound by kernel launches (an H200 gave 4.3-5.5x the
    # tokens/s with them; benchmarks/README.md, GPU check); True: asked for, refused where they cannot run.
    cuda_graphs: bool | None = None
    resolved_dtype: torch.dtype = field(init=False)
    use_cuda_graphs: bool = field(init=False)  # cuda_graphs resolved for this device and rank count
    pack_weights: bool = field(init=False)  # packed_weights resolved for this dtype and device

    def __post_init__(self) -> None:
        self.model_dir = Path(self.model_dir)
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be auto or one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise InvalidRequestError(
                f"attention backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention_backend!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise InvalidRequestError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.vocab_limit is not None and self.vocab_limit < 1:
            raise InvalidRequestError(f"vocab limit must be a positive number of token ids, got {self.vocab_limit}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_tokens < self.block_size:
            raise InvalidRequestError(f"kv_cache_tokens ({self.kv_cache_tokens}) must hold at least one block")
        import torch  # model-side only: see the module docstring

        device = available_device(self.device)
        if self.dtype == "float16" and device.type == "cpu":
            raise InvalidRequestError("float16 is for GPUs; use bfloat16 or float32 on a CPU")
        self.resolved_dtype = self._resolve_dtype(device)
        if self.quantization == "auto":  # see DEFAULT_DRAFT_QUANTIZATION
            lean = self.resolved_dtype != torch.float32 and device.type == "cpu"
            self.quantization = "int8" if lean else "none"
        self.pack_weights = self._resolve_packing(device)
        self._check_tensor_parallel(device)
        if self.cuda_graphs and device.type != "cuda":
            raise InvalidRequestError(f"cuda graphs need a CUDA device, and this worker runs on {self.device}: "
                                      "leave --cuda-graphs off (a CPU step has no kernel launches to save)")
        if self.cuda_graphs and self.tensor_parallel_size > 1:
            raise InvalidRequestError("cuda graphs are not captured across tensor-parallel ranks yet: "
                                      "use --cuda-graphs with --tensor-parallel-size 1")
        one_rank_on_cuda = device.type == "cuda" and self.tensor_parallel_size == 1
        self._check_memory_utilization(device)
        self.use_cuda_graphs = one_rank_on_cuda if self.cuda_graphs is None else self.cuda_graphs

    def _check_memory_utilization(self, device: torch.device) -> None:
        fraction = self.gpu_memory_utilization
        if fraction is None:
            return
        if not 0 < fraction <= 1:  # NaN too
            raise InvalidRequestError(f"--gpu-memory-utilization must be a fraction in (0, 1], got {fraction}")
        if device.type != "cuda":
            raise InvalidRequestError(f"--gpu-memory-utilization sizes the KV pool from a GPU's memory, and this "
                                      f"worker runs on {self.device}: give --kv-cache-tokens instead")
        if self.tensor_parallel_size > 1:
            raise InvalidRequestError("--gpu-memory-utilization is not yet measured per tensor-parallel rank: give "
                                      "--kv-cache-tokens with --tensor-parallel-size > 1")

    @property
    def cache_salt(self) -> bytes:
        """What besides the tokens decides a KV block's content: the root of the prefix cache's hash chains."""
        return f"{self.model_dir.resolve()}|{self.resolved_dtype}|{self.quantization}|{self.vocab_limit}".encode()

    def _resolve_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.quantization == "auto" and device.type == "cpu" and cpu_runs_bf16():
            # A draft left to choose: int8 weights in bf16 are its fastest form on any CPU that runs
            # bf16 at all (the int8 kernel works row by row, emulated bf16 or not). Measured on an
            # Intel Xeon without avx512_bf16: a Qwen2.5-Coder-0.5B step 75 ms so, 176-203 ms in fp32.
            return torch.bfloat16
        return default_dtype(device)

    def _resolve_packing(self, device: torch.device) -> bool:
        if self.packed_weights not in PACKED_WEIGHTS:
            raise InvalidRequestError(
                f"packed weights must be one of {', '.join(PACKED_WEIGHTS)}, got {self.packed_weights!r}"
            )
        if self.packed_weights == "off":
            return False
        import torch

        from tandem.models.packed import packing_supported

        dtype = self.resolved_dtype
        problem = (f"the dtype is {dtype} (packing is for float32, and bfloat16 on a CPU that multiplies it)"
                   if dtype not in (torch.float32, torch.bfloat16)
                   else f"the device is {device.type} (packing is for CPUs)" if device.type != "cpu"
                   else "this PyTorch has no oneDNN" if not packing_supported()
                   else "the dtype is torch.bfloat16 and this CPU has no native bf16 (avx512_bf16 or AMX), so "
                        "oneDNN would emulate it" if dtype == torch.bfloat16 and not native_cpu_bf16() else None)
        if problem and self.packed_weights == "on":
            raise InvalidRequestError(f"packed weights were asked for, but {problem}")
        return problem is None

    def _check_tensor_parallel(self, device: torch.device) -> None:
        n = self.tensor_parallel_size
        if n < 1:
            raise InvalidRequestError(f"tensor-parallel size must be at least 1, got {n}")
        if not self.rank_timeout_s > 0:
            raise InvalidRequestError(f"rank timeout must be a positive number of seconds, got {self.rank_timeout_s}")
        if n == 1:
            return
        if self.quantization != "none" or self.vocab_limit is not None:
            raise InvalidRequestError("tensor parallelism is for targets: it cannot be combined with a draft's "
                                      "quantization or vocabulary limit")
        if device.type not in ("cpu", "cuda") or device.index is not None:
            raise InvalidRequestError(f"tensor parallelism runs on device cpu (gloo) or cuda (NCCL, rank r on "
                                      f"cuda:r), not {self.device!r}")
        import torch

        if device.type == "cuda" and torch.cuda.device_count() < n:
            raise InvalidRequestError(f"tensor-parallel size {n} needs {n} CUDA devices, "
                                      f"{torch.cuda.device_count()} are visible")

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_tokens // self.block_size


# Seconds a server's calls in flight get to finish after SIGTERM (--drain-grace).
DEFAULT_DRAIN_GRACE_S = 10.0


def check_tracing(endpoint: str | None) -> None:
    """``--otlp-traces-endpoint``: a collector's URL, with OpenTelemetry installed; checked before any model loads."""
    if endpoint is None:
        return
    check_endpoint(endpoint)
    missing = [name for name in ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.grpc") if _missing(name)]
    if missing:
        raise InvalidRequestError(f"--otlp-traces-endpoint needs {', '.join(missing)}, not installed: {INSTALL_HINT}")


def _missing(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # (a parent package is missing)
        return True


def check_drain_grace_flag(seconds: float) -> None:
    """``--drain-grace``: a number of seconds >= 0 (a server's, and what ``tandem up`` gives its coordinator)."""
    if not seconds >= 0:  # (NaN too)
        raise InvalidRequestError(f"--drain-grace must be a number of seconds >= 0, got {seconds}")


@dataclass(slots=True)
class ServerOptions:
    host: str = "0.0.0.0"
    port: int = 0  # 0: any free port (printed once bound)
    metrics_port: int | None = None  # Prometheus /metrics; None disables, 0 picks a free port
    drain_grace_s: float = DEFAULT_DRAIN_GRACE_S
    tls: ServerTLS | None = None  # validated by ServerTLS itself (tandem/rpc/tls.py); None: plaintext
    # A client's connection older than this is asked to reconnect (gRPC's GOAWAY, HTTP's "Connection: close"), its
    # calls in flight finishing on it: behind a Kubernetes Service, which balances connections and not calls, a
    # client's next connection may reach another replica. None: never (tandem.rpc.connection_age).
    max_connection_age_s: float | None = None
    # An OTLP/gRPC collector for this server's spans (tandem.tracing): a request's on a coordinator, its calls' on a
    # worker. None: no tracing.
    otlp_traces_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise InvalidRequestError(f"port must be in 0..65535, got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise InvalidRequestError(f"--metrics-port must be in 0..65535 (0: any free port), got {self.metrics_port}")
        check_drain_grace_flag(self.drain_grace_s)
        if self.max_connection_age_s is not None and not self.max_connection_age_s > 0:
            raise InvalidRequestError(f"--max-connection-age must be a positive number of seconds (0 or unset: "
                                      f"never), got {self.max_connection_age_s}")
        check_tracing(self.otlp_traces_endpoint)


@dataclass(slots=True)
class WorkerConfig:
    """A draft or target worker: its model, its server, and its batching budget."""

    engine: EngineConfig
    server: ServerOptions
    model_name: str
    token_budget: int = 2048  # most tokens in one batched forward pass
    # While a sequence that called recently has not called again, wait for it up to this many
    # forward passes (the fitted intercept), so batches fill (tandem.rpc.batcher); None: the role's.
    gather_fraction: float | None = None
    # A coordinator unheard for lease_s (no call, no Info heartbeat: crashed, OOM-killed, cut off) loses
    # its sequences here; any sequence idle for idle_ttl_s is freed too (0: never). tandem.rpc.leases.
    lease_s: float = DEFAULT_LEASE_S
    idle_ttl_s: float = DEFAULT_IDLE_TTL_S
    heads: Path | None = None  # a target's speculation heads (tandem/heads): a directory in any known layout
    # A target's chunked prefill (tandem/rpc/prefill_chunks.py): tokens per chunk of a long prompt while other
    # streams run; None: sized from the measured step cost; 0: prompts always computed whole.
    prefill_chunk_tokens: int | None = None
    # The prefix cache keeps the full blocks of the target's generated text too (a target's own, a draft's of
    # what the target verified: target_worker/engine.py, draft_worker/engine.py); False: prompt blocks only.
    cache_generated: bool = True
    # A target's new prompt that shares a long prefix with one being computed waits for it, then reuses it from the
    # prefix cache (target_worker/shared_prompts.py); False: every prompt is computed as it arrives.
    shared_prompt_wait: bool = True
    # A file that workers sharing these cores lock while they load and warm up, so that each one's timings
    # (row padding, the fitted forward cost) are taken alone (tandem.rpc.startup_lock); None: no lock.
    startup_lock: Path | None = None

    def __post_init__(self) -> None:
        if self.startup_lock is not None:
            self.startup_lock = Path(self.startup_lock)
            if not self.startup_lock.parent.is_dir():
                raise InvalidRequestError(f"--startup-lock {self.startup_lock}: its directory does not exist")
        if self.heads is not None:
            self.heads = Path(self.heads)
            if not self.heads.exists():
                raise InvalidRequestError(f"--heads {self.heads}: no such file or directory")
        if self.token_budget <= 0:
            raise InvalidRequestError(f"token budget must be positive, got {self.token_budget}")
        if self.prefill_chunk_tokens is not None and self.prefill_chunk_tokens < 0:
            raise InvalidRequestError(
                f"prefill chunk must be >= 0 tokens (0: no chunking), got {self.prefill_chunk_tokens}")
        if self.gather_fraction is not None and not 0 <= self.gather_fraction <= 64:
            raise InvalidRequestError(f"gather fraction must be in 0..64 forward passes, got {self.gather_fraction}")
        if not MIN_LEASE_S <= self.lease_s <= MAX_LEASE_S:
            raise InvalidRequestError(f"--sequence-lease must be in {MIN_LEASE_S:g}..{MAX_LEASE_S:g} seconds "
                                      f"(a coordinator renews it every third of it), got {self.lease_s:g}")
        if self.idle_ttl_s and not self.lease_s <= self.idle_ttl_s <= MAX_IDLE_TTL_S:
            raise InvalidRequestError(f"--sequence-idle-ttl must be 0 (never) or in {self.lease_s:g} (the lease)"
                                      f"..{MAX_IDLE_TTL_S:g} seconds, got {self.idle_ttl_s:g}")


def check_log_stats_interval(seconds: float) -> None:
    """``--log-stats-interval``: 0 (no stats lines) or 1..3600 seconds."""
    if not (seconds == 0 or 1 <= seconds <= 3600):  # (NaN fails too)
        raise InvalidRequestError(f"--log-stats-interval must be 0 (no stats lines) or 1..3600 seconds, got {seconds}")


def check_served_model_names(names: tuple[str, ...]) -> None:
    """``--served-model-name``: names a client may call the model by, each non-empty, without surrounding space,
    given once (a request names one; replies and metrics use the first)."""
    for name in names:
        if not name or name != name.strip():
            raise InvalidRequestError(f"--served-model-name must be non-empty names without spaces around them, "
                                      f"got {name!r}")
        if len(name) > MAX_MODEL_NAME_CHARS:
            raise InvalidRequestError(f"--served-model-name {name[:40]!r}... is longer than "
                                      f"{MAX_MODEL_NAME_CHARS} characters")
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise InvalidRequestError(f"--served-model-name gives {repeated[0]!r} more than once")


def read_chat_template(path: Path) -> str:
    """A ``--chat-template`` file's text, or an error naming the file and why."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"--chat-template {path}: cannot read it ({exc})") from None
    if not text.strip():
        raise InvalidRequestError(f"--chat-template {path}: the file is empty")
    return text


def check_room_hold_flag(seconds: float) -> None:
    """``--room-hold``: 0 (a Prefill refused for room is refused at once) up to what a target holds, ``HOLD_S``."""
    if not 0 <= seconds <= HOLD_S:  # (NaN fails too)
        raise InvalidRequestError(f"--room-hold must be in 0..{HOLD_S:g} seconds (0: refused at once), got {seconds}")


@dataclass(slots=True)
class CoordinatorConfig:
    """The coordinator: where its workers are, and its defaults for requests that leave things unset."""

    server: ServerOptions
    tokenizer_dir: Path  # the target model's directory: the coordinator loads only its tokenizer
    target_addrs: list[str] = field(default_factory=list)
    draft_addrs: list[str] = field(default_factory=list)
    # How workers are found (coordinator/discovery): static (the address lists), file (workers_file, re-read
    # when it changes), dns (the headless Services' records), kubernetes (their EndpointSlices).
    discovery: str = "static"
    workers_file: Path | None = None
    target_service: str | None = None
    draft_service: str | None = None  # None: no draft fleet (n-gram or plain decoding)
    target_port: int | None = None  # dns: default 50052/50053; kubernetes: default the slice's port
    draft_port: int | None = None
    namespace: str | None = None  # kubernetes: default the pod's own namespace
    kubeconfig: str | None = None  # kubernetes: default in-cluster config, else $KUBECONFIG
    dns_interval_s: float = 5.0
    default_max_new_tokens: int = 256
    default_k: int = 4
    pipelining: bool = True
    # An adaptive request's draft model stops where its own probabilities say the target will likely turn it down
    # (tandem.spec.adaptive.stop_below); False: it drafts every token of the round's k (a draft whose top
    # probabilities do not track acceptance, such as one trained apart from the target, may do better so).
    draft_stops: bool = True
    call_timeout_s: float = 60.0  # deadline of every internal call
    info_poll_s: float = 1.0  # how often worker capacity is refreshed for routing
    ngram_min: int = 1
    ngram_max: int = 4
    # The continuation cache shared by every coordinator (redis:// or rediss://); None: in-process only.
    redis_url: str | None = None
    continuation_cache: bool = True  # False: n-gram proposals from the request's own text only
    max_moves: int = 3  # times one request may move to another replica of a role after a fault
    move_wait_s: float = 30.0  # how long a moving request waits for a healthy target replica
    placement: str = "prefix"  # PLACEMENT_MODES
    scheduling_policy: str = "fcfs"  # SCHEDULING_POLICIES
    # How long a Prefill refused for room asks its target to hold it until room frees, admitted in the step that
    # frees it whoever frees it (first come, first served across coordinators); 0: refused at once, asked again.
    room_hold_s: float = ROOM_HOLD_S
    # Security and limits (README "Security", "Bad input"). TLS files and tokens are validated where
    # they are read (ClientTLS, BearerAuth), before this is built.
    worker_tls: ClientTLS | None = None  # TLS (mutual with a client certificate) to every worker; None: plaintext
    auth: BearerAuth | None = None  # tokens tandem.v1.Generation requires; None: open
    max_request_bytes: int = 4 * 1024 * 1024  # largest request message; gRPC refuses more (RESOURCE_EXHAUSTED)
    max_prompt_tokens: int | None = None  # None: the model's context
    max_new_tokens_limit: int | None = None  # None: whatever fits the context
    max_concurrent_per_client: int = 0  # 0: unlimited
    expose_worker_addresses: bool = False  # False: replies name replicas target-0, draft-1...
    http_port: int | None = None  # the OpenAI-compatible HTTP API (coordinator/http); None: off, 0: any free port
    chat_template: Path | None = None  # a Jinja chat template file used instead of the tokenizer's own
    # The model's names in both APIs (--served-model-name), the first in every reply; (): its target workers' name.
    served_model_names: tuple[str, ...] = ()
    log_stats_interval_s: float = 10.0  # seconds between the stats lines of the log (coordinator/stats_log); 0: none
    log_requests: bool = False  # a log line per request as it ends (coordinator/request_log)

    def __post_init__(self) -> None:
        self.tokenizer_dir = Path(self.tokenizer_dir)
        self.served_model_names = tuple(self.served_model_names)
        check_served_model_names(self.served_model_names)
        check_log_stats_interval(self.log_stats_interval_s)
        if self.chat_template is not None:
            self.chat_template = Path(self.chat_template)
            self.chat_template_text()  # read now: a bad file is refused at start-up, named
        if not 1024 <= self.max_request_bytes <= MAX_GRPC_MESSAGE_BYTES:
            raise InvalidRequestError(f"--max-request-bytes must be in 1024..{MAX_GRPC_MESSAGE_BYTES}, "
                                      f"got {self.max_request_bytes}")
        for flag, value in (("--max-prompt-tokens", self.max_prompt_tokens),
                            ("--max-new-tokens-limit", self.max_new_tokens_limit)):
            if value is not None and value < 1:
                raise InvalidRequestError(f"{flag} must be a positive number of tokens, got {value}")
        if self.max_new_tokens_limit is not None and self.default_max_new_tokens > self.max_new_tokens_limit:
            raise InvalidRequestError(f"the default max new tokens ({self.default_max_new_tokens}, --max-new-tokens) "
                                      f"exceeds --max-new-tokens-limit ({self.max_new_tokens_limit})")
        if self.max_concurrent_per_client < 0:
            raise InvalidRequestError(f"--max-concurrent-per-client must be >= 0 (0: unlimited), "
                                      f"got {self.max_concurrent_per_client}")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise InvalidRequestError(f"--http-port must be in 0..65535 (0: any free port), got {self.http_port}")
        if self.http_port and self.http_port == self.server.port:
            raise InvalidRequestError(f"--http-port {self.http_port} is the gRPC --port too: give each its own")
        self._check_discovery()
        if self.default_max_new_tokens <= 0:
            raise InvalidRequestError("default max new tokens must be positive")
        if self.default_k < 0:
            raise InvalidRequestError(f"default k must be >= 0, got {self.default_k}")
        if self.max_moves < 0:
            raise InvalidRequestError(f"--max-moves must be >= 0, got {self.max_moves}")
        if self.placement not in PLACEMENT_MODES:
            raise InvalidRequestError(f"--placement must be one of {', '.join(PLACEMENT_MODES)}, "
                                      f"got {self.placement!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise InvalidRequestError(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                                      f"got {self.scheduling_policy!r}")
        check_room_hold_flag(self.room_hold_s)
        if self.call_timeout_s <= 0 or self.info_poll_s <= 0 or self.move_wait_s < 0:
            raise InvalidRequestError("timeouts and poll intervals must be positive")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidRequestError(f"n-gram sizes need 1 <= min <= max, got {self.ngram_min}..{self.ngram_max}")
        if self.redis_url and not self.continuation_cache:
            raise InvalidRequestError("--redis-url shares the continuation cache, "
                                      "which --no-continuation-cache turns off")
        if self.redis_url:
            from tandem.spec.shared_cache import parse_redis_url

            parse_redis_url(self.redis_url)  # a malformed URL is refused at start, naming what is wrong

    def chat_template_text(self) -> str | None:
        """The ``--chat-template`` file's template; None without one."""
        return None if self.chat_template is None else read_chat_template(self.chat_template)

    def _check_discovery(self) -> None:
        from tandem.workers_file import check_address

        if self.discovery not in DISCOVERY_MODES:
            raise InvalidRequestError(f"--discovery must be one of {', '.join(DISCOVERY_MODES)}, "
                                      f"got {self.discovery!r}")
        given = {"--target-addr/--draft-addr": bool(self.target_addrs or self.draft_addrs),
                 "--workers-file": self.workers_file is not None,
                 "--target-service/--draft-service": bool(self.target_service or self.draft_service),
                 "--namespace": self.namespace is not None, "--kubeconfig": self.kubeconfig is not None,
                 "--target-port/--draft-port": self.target_port is not None or self.draft_port is not None}
        allowed = {"static": {"--target-addr/--draft-addr"}, "file": {"--workers-file"},
                   "dns": {"--target-service/--draft-service", "--target-port/--draft-port"},
                   "kubernetes": {"--target-service/--draft-service", "--target-port/--draft-port",
                                  "--namespace", "--kubeconfig"}}[self.discovery]
        stray = [flag for flag, present in given.items() if present and flag not in allowed]
        if stray:
            raise InvalidRequestError(f"{stray[0]} does not apply to --discovery {self.discovery}")
        if self.discovery == "static":
            if not self.target_addrs:
                raise InvalidRequestError("the coordinator needs at least one target worker address (--target-addr), "
                                          "or another --discovery")
            for addr in [*self.target_addrs, *self.draft_addrs]:
                check_address(addr)
        elif self.discovery == "file":
            if self.workers_file is None:
                raise InvalidRequestError("--discovery file needs --workers-file PATH")
            self.workers_file = Path(self.workers_file)
        else:
            if not self.target_service:
                raise InvalidRequestError(f"--discovery {self.discovery} needs --target-service (the target "
                                          "workers' headless Service name)")
            for name, port in (("--target-port", self.target_port), ("--draft-port", self.draft_port)):
                if port is not None and not 0 < port <= 65535:
                    raise InvalidRequestError(f"{name} must be in 1..65535, got {port}")
            if self.dns_interval_s <= 0:
                raise InvalidRequestError("the DNS re-resolve interval must be positive")
