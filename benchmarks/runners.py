"""Running models for the benchmarks: our engine and transformers, greedy, batch 1.

Both sides are timed the same way: wall clock around one whole generation
call (prefill included), tokens counted from what came back. Forward
latency is the median of repeated forwards over one cached prefix, the KV
cache rolled back between repetitions so every one sees the same prefix.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import hf_cache_keyword, interleaved_medians, timed
from tandem import model_store
from tandem.config import EngineConfig
from tandem.engine import ForwardItem, ModelEngine
from tandem.inprocess import GenerationRequest, GenerationStats, SpeculativeGenerator
from tandem.sampling import SamplingParams

PROBE_SEQ = "benchmark-probe"


@dataclass(slots=True)
class RunOutput:
    """What one generation produced and how long it took."""

    token_ids: list[int]  # generated tokens only
    seconds: float  # wall clock of the whole call, prefill included
    stats: GenerationStats | None = None  # ours only: transformers does not expose acceptance
    first_token_s: float | None = None  # transformers, when asked: seconds to the first new token (prefill)
    draft_seconds: float | None = None  # heads methods: seconds the target's heads spent drafting in the run


# ----- loading -----------------------------------------------------------
def resolve_model_dir(spec: str, cache_dir: str | None = None) -> Path:
    """A prepared catalog name, a Hugging Face directory or a .gguf file -> a loadable directory."""
    root = model_store.cache_root_from(cache_dir, os.environ)
    return Path(model_store.resolve_model(spec, root, progress=True))


def engine_config(model_dir: Path, dtype: str, packed_weights: str = "auto",
                  draft_options: dict[str, Any] | None = None) -> EngineConfig:
    """How the benchmarks run our engine: the default KV pool and attention backend, on CPU.

    Prefix caching off: every run computes its own prompt, as transformers' ``generate`` does and as a
    request on a fresh server would. On, the methods that run one prompt back to back share one engine,
    and whichever ran second reused the first one's prompt (spec_bench measured target-only at 4.6x
    transformers' on an 805-token rag prompt that way). Prefix caching is measured by prefix_bench.

    ``draft_options`` (from ``tandem.cli.draft_flags.draft_engine_options``) make a draft lean, and
    give it its own dtype (``--draft-dtype``) in place of ``dtype``; ``packed_weights`` is
    ``EngineConfig``'s (fp32 weights packed for oneDNN unless "off").
    """
    return EngineConfig(model_dir, packed_weights=packed_weights, prefix_caching=False,
                        **{"dtype": dtype, **(draft_options or {})})


def load_hf_model(model_dir: Path, dtype: str) -> Any:
    """``AutoModelForCausalLM`` in ``dtype``, in eval mode."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
    return model.eval()


def set_assistant_tokens(assistant: Any, num_tokens: int) -> None:
    """Make transformers' assisted generation draft ``num_tokens`` per round (its default is 20)."""
    assistant.generation_config.num_assistant_tokens = num_tokens
    assistant.generation_config.num_assistant_tokens_schedule = "constant"


# ----- generation --------------------------------------------------------
def run_ours(
    generator: SpeculativeGenerator,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: frozenset[int] = frozenset(),
    k_max: int | None = None,
    adaptive_k: bool | None = None,
    sampling: SamplingParams | None = None,
) -> RunOutput:
    """One request through our speculation loop, greedy unless ``sampling`` says otherwise (k and adaptivity: the
    generator's unless given)."""
    request = GenerationRequest(
        list(prompt_ids), max_new_tokens, sampling or SamplingParams(), stop_ids, k_max=k_max, adaptive_k=adaptive_k
    )
    results, seconds = timed(lambda: generator.generate([request]))
    return RunOutput(results[0].token_ids, seconds, results[0].stats)


class FirstTokenClock:
    """A transformers streamer that notes when the first new token arrives.

    ``generate`` hands a streamer the prompt first, then the tokens as they
    come: the second ``put`` is the first token, the end of the prefill.
    """

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_at: float | None = None

    def put(self, value: Any) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_at = time.perf_counter()

    def end(self) -> None:
        """Nothing to flush."""


def run_hf(model: Any, prompt_ids: list[int], max_new_tokens: int, time_first_token: bool = False,
           **generate_kwargs: Any) -> RunOutput:
    """One ``model.generate`` call, greedy unless kwargs sample; extra kwargs (assistant, prompt lookup, eos...)
    pass through.

    ``time_first_token`` also records when the first token came (a streamer: one host copy per token), so
    the decoding phase can be timed apart from the prefill, as our ``GenerationStats`` do.
    """
    input_ids = torch.tensor([prompt_ids], dtype=torch.int64)  # [1, P]
    pad = model.generation_config.pad_token_id
    kwargs = {"pad_token_id": pad if pad is not None else model.generation_config.eos_token_id, "do_sample": False,
              **generate_kwargs}
    clock = FirstTokenClock() if time_first_token else None
    if clock is not None:
        kwargs["streamer"] = clock
    started = time.perf_counter()
    with torch.inference_mode():
        output, seconds = timed(
            lambda: model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=max_new_tokens,
                **kwargs,
            )
        )
    first = clock.first_token_at - started if clock is not None and clock.first_token_at is not None else None
    return RunOutput(output[0, len(prompt_ids) :].tolist(), seconds, first_token_s=first)


def identical_prefix(ours: list[int], theirs: list[int], stop_ids: frozenset[int]) -> tuple[bool, int]:
    """Whether ``theirs`` equals ``ours`` up to ours' first stop token; and how many tokens were compared.

    transformers' ``min_new_tokens`` forbids EOS, so past the point where our
    engine emits one the two runs legitimately differ.
    """
    length = next((i for i, t in enumerate(ours) if t in stop_ids), len(ours))
    return ours[:length] == theirs[:length], length


# ----- forward latency ---------------------------------------------------
@dataclass(slots=True)
class ForwardProbe:
    """One forward of a few new tokens over a cached prefix, and how to undo it."""

    step: Callable[[], Any]  # the timed forward
    undo: Callable[[], Any]  # roll the cache back to the prefix (untimed)
    close: Callable[[], Any]  # free the probe's cache


def probe_tokens(count: int) -> list[int]:
    """Deterministic ordinary token ids (below 21,000: inside every vocabulary we run)."""
    return [1000 + (i * 7919) % 20000 for i in range(count)]


def engine_probe(engine: ModelEngine, prefix_len: int, num_new: int) -> ForwardProbe:
    """Our engine: prefill a prefix, then forward ``num_new`` tokens (all with logits) on demand.

    Our engine's ``forward`` runs under ``torch.inference_mode`` itself.
    """
    seq_id = (PROBE_SEQ, num_new)  # one probe per size may be alive at once on an engine
    tokens = probe_tokens(prefix_len + num_new)
    engine.forward([ForwardItem(seq_id, tokens[:prefix_len], num_logits=1)])
    new = ForwardItem(seq_id, tokens[prefix_len:], num_logits=num_new)
    return ForwardProbe(lambda: engine.forward([new]), lambda: engine.rollback(seq_id, prefix_len),
                        lambda: engine.release(seq_id))


def hf_probe(model: Any, prefix_len: int, num_new: int) -> ForwardProbe:
    """The same for a transformers model with a ``DynamicCache``."""
    from transformers import DynamicCache

    tokens = torch.tensor([probe_tokens(prefix_len + num_new)], dtype=torch.int64)  # [1, prefix + new]
    new = tokens[:, prefix_len:]  # [1, num_new]
    cache = DynamicCache(config=model.config)
    held = {hf_cache_keyword(model): cache}
    with torch.inference_mode():
        model(input_ids=tokens[:, :prefix_len], use_cache=True, logits_to_keep=1, **held)

    def step() -> Any:
        with torch.inference_mode():
            return model(input_ids=new, use_cache=True, logits_to_keep=num_new, **held)

    # transformers 5 rejects crop(n > 0) (keep n); crop(-n) removes the n new tokens.
    return ForwardProbe(step, lambda: cache.crop(-num_new), lambda: None)


def forward_seconds(probes: Sequence[ForwardProbe], reps: int) -> list[float]:
    """Median seconds of each probe's forward, the probes taking turns; the probes are closed after."""
    try:
        return interleaved_medians([(p.step, p.undo) for p in probes], reps)
    finally:
        for p in probes:
            p.close()
