"""One command that proves Tandem's CUDA path: ``make gpu-check`` (``make gpu-check DEVICE=cpu``: tiny shapes).

For a machine with one NVIDIA GPU, PyTorch with CUDA, and no network: nothing is
downloaded. Random-weight checkpoints with real shapes (Qwen2.5-1.5B and 0.5B,
and tiny ones; ``benchmarks/random_models.py``) are built on the device, then:

Checks (each passes or fails on its own; the exit status is 1 if any failed):
- ``engine-vs-transformers``: our engine's logits against transformers' model on
  the same weights, prefill then decode, float32 / bfloat16 / float16, within
  ``LOGIT_TOLERANCE`` of the reference's largest logit; greedy tokens equal on
  random prompts (float32: the same math in another order, so no near-ties decide).
- ``speculative-greedy``: greedy output of draft, n-gram, hybrid and tree
  speculation equal to target-only, token for token (``Plan.exact_dtype``: the
  serving dtype on a CPU, float32 on CUDA, where cuBLAS may round a row apart by
  the batch's row count); draft and hybrid trees again under penalties and a logit
  bias. On CUDA the serving dtype's agreement is reported beside it.
- ``heads``: Medusa and EAGLE-3 heads (random, the target's shapes) on the device: greedy
  output equal to target-only (``Plan.exact_dtype``), each prompt twice, so that the second pass starts on the
  prefix cache (an EAGLE prompt on its head's cached rows too) and must reuse some of it.
- ``lossless``: the chi-square test of speculative sampling (chains, then trees)
  through the worker engines on the device, on the suite's six-token pair (tests/spec/losslessness.py).
- ``processes``: a target worker, a draft worker and a coordinator as real
  processes on the device (``tandem.cluster.LocalCluster``), one request streamed over gRPC; the workers
  as started by default (on CUDA: with CUDA graphs).
- ``tensor-parallel``: ``TensorParallelEngine`` with one rank (NCCL on CUDA, gloo on CPU)
  starts, and its logits equal the one-process engine's.
- ``attention``: the backend ``auto`` picks (flash-attn when installed, SDPA otherwise)
  against SDPA.
- ``kv-sizing`` (CUDA only): ``--gpu-memory-utilization 0.5`` sizes the KV pool so that the process
  then holds at most half the device, with no more than 256 MiB of that half unused besides the
  measured activation peak and the room kept free, and a long prompt runs in it.
- ``step-graphs``: decode and verify steps replayed as captured CUDA graphs
  (``--cuda-graphs``, tandem/step_graphs.py) against the eager engine, float32: greedy
  target-only and self-drafted output token for token, and each graph replayed. On a CPU the
  capture is the eager stand-in (``EagerRecorder``): the buffers, padding and scratch block alone.

Measurements (figures, never pass/fail):
- ``row-invariance``: for the first block's linear layers and the lm_head, in the serving
  dtype, whether each row of a call of 2, 4, 5, 8, 16, 40, 64 or 128 rows equals the row
  computed alone, bitwise, and the largest difference; and whether at 64 rows a row depends on
  its neighbours. What bf16 greedy equality rests on (``Plan.exact_dtype``), read directly;
- ``forward-cost``: seconds of a forward of 1, 2, 4, ..., 64 new tokens over a cached
  prefix: the curve that decides k and tree sizes on this device;
- ``decode``: tokens/s of plain greedy decoding, ours against transformers' ``generate``;
- ``self-speculation``: the speedup of speculation with the target as its own draft
  (acceptance near 1 whatever the random weights), fixed k.
- ``step-time``: where a graphed decode step's time goes, per token: wall, the forward's span on the
  device, and the step's graph replayed alone back to back (the device's own time); the gaps are the
  host's (sampling and bookkeeping; preparing the step's inputs).
- ``graphs``: on CUDA, tokens/s of greedy decoding (1 and 8 requests) and of self-speculation
  with CUDA graphs off and on, side by side.

Writes ``gpu_check.json`` and ``gpu_check.md`` (a table) to ``--out``. Needs, beyond
PyTorch (bring them as wheels; ``pip download`` them where there is network):
transformers, safetensors, tokenizers, accelerate (checkpoints and the reference),
numpy and scipy (chi-square), grpcio, grpcio-health-checking, grpcio-reflection,
protobuf (the processes), grpcio-tools (building Tandem's gRPC stubs when installing
it), and every other dependency in pyproject.toml; flash-attn is optional.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # run as a script: the benchmarks and tests packages live here
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    DEFAULT_RESULTS_DIR,
    hf_cache_keyword,
    markdown_table,
    write_json,
    write_markdown,
)
from benchmarks.random_models import save_random_model  # noqa: E402
from tandem.config import EngineConfig  # noqa: E402
from tandem.engine import ForwardItem, ModelEngine  # noqa: E402
from tandem.inprocess import GenerationRequest, SpeculativeGenerator  # noqa: E402
from tandem.models.layers import RowStableLinear  # noqa: E402
from tandem.sampling_params import SamplingParams  # noqa: E402
from tandem.spec.options import SpecOptions  # noqa: E402
from tandem.step_graphs import CudaGraphRecorder, EagerRecorder, GraphShape  # noqa: E402
from target_worker.engine import PrefillCall, TargetEngine  # noqa: E402

# |ours - transformers| <= tolerance * max |transformers' logit|: float32 differs by the order of
# operations only; bfloat16 and float16 round every op, and differences grow layer by layer.
LOGIT_TOLERANCE = {"float32": 1e-4, "bfloat16": 4e-2, "float16": 1e-2}
PROMPT_SCORE_TOLERANCE = 1e-3  # nats: a prompt token's log-probability (echo) against transformers' log-softmax, fp32
SIGNIFICANCE = 1e-3  # chi-square p-value below which the lossless check fails
# The lossless check's samples are seeded (sample i: this + i), so a run repeats, and a seeded token's noise is
# a hash, the same on every device. A fixed seed set is one draw of a test that a correct sampler fails once in
# 1/SIGNIFICANCE, and seeds 0..3999 are such a draw here: on a CPU they gave p = 0.0009 (chain) and 0.0015
# (tree), while 100000.. gave 0.87 / 0.91, 4000.. 0.23 / 0.03, exact draws at 100000.. and 200000.. 0.60 and
# 0.94, and unseeded draws 0.89 / 0.36 (benchmarks/README.md, "GPU check").
LOSSLESS_SEED_BASE = 100_000
FORWARD_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(slots=True)
class Plan:
    """What one run checks: model shapes, sizes of the work, by device."""

    device: str
    models: tuple[str, ...]  # shapes compared with transformers
    target: str  # the speculation pair
    draft: str
    dtypes: tuple[str, ...]
    serving_dtype: str
    # The dtype greedy equality is asserted in. On a CPU the serving dtype: packed oneDNN weights compute each
    # row alike whatever the batch (tandem/models/packed.py). On CUDA float32: cuBLAS may pick another kernel
    # (another split of the sum) for 40 rows than for 8, so bf16 rows can round apart by row count and flip
    # a near-tie, which says nothing of the speculation's rules; the serving dtype's agreement is measured.
    exact_dtype: str
    greedy_prompts: int
    new_tokens: int
    lossless_samples: int
    prefix: int  # cached tokens under the forward-cost curve
    repeats: int

    @classmethod
    def for_device(cls, device: str, quick: bool = False) -> Plan:
        if torch.device(device).type == "cuda":
            models = ("tiny",) if quick else ("tiny", "qwen2.5-0.5b", "qwen2.5-1.5b")
            target, draft = ("tiny", "tiny-draft") if quick else ("qwen2.5-1.5b", "qwen2.5-0.5b")
            return cls(device, models, target, draft, ("float32", "bfloat16", "float16"), "bfloat16", "float32",
                       greedy_prompts=4, new_tokens=32, lossless_samples=4000, prefix=512, repeats=5)
        return cls(device, ("tiny",), "tiny", "tiny-draft", ("float32", "bfloat16"), "bfloat16", "bfloat16",
                   greedy_prompts=2, new_tokens=12, lossless_samples=400, prefix=64, repeats=2)


@dataclass(slots=True)
class Report:
    checks: list[dict[str, Any]] = field(default_factory=list)
    measurements: dict[str, Any] = field(default_factory=dict)
    # Called after every check: a run stopped at its time limit (a lent GPU machine's is minutes) still
    # leaves what it had done.
    after_each: Callable[[Report], None] | None = None

    def check(self, name: str, subject: str, run: Callable[[], dict[str, Any]]) -> None:
        """Run one check; its failure (an AssertionError or any exception) is recorded, not raised."""
        started = time.perf_counter()
        try:
            details, passed = run(), True
        except Exception as exc:  # noqa: BLE001 - every check runs and reports
            details, passed = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc(limit=6)}, False
        self.checks.append({"check": name, "subject": subject, "passed": passed,
                            "seconds": round(time.perf_counter() - started, 2), **details})
        print(f"[{'PASS' if passed else 'FAIL'}] {name} ({subject}) {details.get('error', '')}", flush=True)
        if self.after_each is not None:
            self.after_each(self)

    @property
    def passed(self) -> bool:
        return all(c["passed"] for c in self.checks)


def synchronize(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free_memory(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def load(model_dir: Path, device: str, dtype: str, **kw: Any) -> ModelEngine:
    """An engine of eager steps unless ``cuda_graphs=True`` is passed (a CUDA engine's default is graphs on)."""
    kw.setdefault("cuda_graphs", False)
    return ModelEngine.load(EngineConfig(model_dir, dtype=dtype, device=device, kv_cache_tokens=8192, **kw))


def hf_model(model_dir: Path, device: str, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()


def hf_greedy(hf: Any, prompt: list[int], n: int, device: str) -> list[int]:
    """transformers' model's own argmax, ``n`` tokens after ``prompt``, its KV cache carried: no generation config.

    Not ``generate``: with ``min_new_tokens`` it masks the end-of-sequence id until n tokens are out, while ours
    (``GenerationRequest`` asks for exactly n) keeps it as any other token. On CUDA the tiny model's greedy text
    met that id, and the two parted there (the first GPU run, 2026-12-04) without any fault in the engine."""
    name = hf_cache_keyword(hf)
    out = hf(torch.tensor([prompt], device=device), use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    while len(tokens) < n:
        out = hf(torch.tensor([[tokens[-1]]], device=device), use_cache=True, **{name: getattr(out, name)})
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length,), generator=gen).tolist() for _ in range(count)]


# ----- checks ----------------------------------------------------------------------------------

def engine_vs_transformers(model_dir: Path, plan: Plan) -> dict[str, Any]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    (ids,) = random_prompts(1, 24, vocab, seed=1)
    prompts = random_prompts(plan.greedy_prompts, 12, vocab, seed=2)
    split = 16
    ours: dict[str, torch.Tensor] = {}
    for dtype in plan.dtypes:
        engine = load(model_dir, plan.device, dtype)
        rows = [engine.forward([ForwardItem("s", ids[:split], num_logits=split)])[0]]
        rows += [engine.forward([ForwardItem("s", [t])])[0] for t in ids[split:]]
        ours[dtype] = torch.cat(rows).float()
        if dtype == "float32":
            ours_greedy = [SpeculativeGenerator(engine).generate([GenerationRequest(p, plan.new_tokens, k_max=0)])[0]
                           .token_ids for p in prompts]
            # the prompt's own log-probabilities (completions' echo), scored on the device
            [scored] = TargetEngine(engine).run_batch([PrefillCall("scored", ids, SamplingParams(prompt_logprobs=1))])
            if isinstance(scored, BaseException):
                raise scored
            our_scores = torch.tensor([s.logprob for s in scored.prompt_logprobs])
        del engine
    free_memory(plan.device)
    hf = hf_model(model_dir, plan.device, "float32")  # one load; cast for the other dtypes
    worst: dict[str, float] = {}
    with torch.inference_mode():
        theirs = [hf_greedy(hf, p, plan.new_tokens, plan.device) for p in prompts]
        for dtype in plan.dtypes:
            ref = hf.to(getattr(torch, dtype))(torch.tensor([ids], device=plan.device)).logits[0].float()
            worst[dtype] = float((ours[dtype] - ref).abs().max() / ref.abs().max())
            if dtype == "float32":
                logp = torch.log_softmax(ref, -1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].cpu()
                score_error = float((our_scores - logp).abs().max())
    del hf
    free_memory(plan.device)
    assert ours_greedy == theirs, f"greedy tokens differ from transformers': {ours_greedy} vs {theirs}"
    for dtype, error in worst.items():
        assert error <= LOGIT_TOLERANCE[dtype], (
            f"{dtype}: logits differ by {error:.2e} of the largest, more than {LOGIT_TOLERANCE[dtype]:.0e}")
    assert score_error <= PROMPT_SCORE_TOLERANCE, (
        f"prompt log-probabilities differ from transformers' by {score_error:.2e} nats (fp32)")
    return {"max_relative_logit_error": worst, "greedy_tokens": plan.greedy_prompts * plan.new_tokens,
            "prompt_score_max_error_fp32": score_error}


def speculative_greedy(target_dir: Path, draft_dir: Path, plan: Plan) -> dict[str, Any]:
    target, draft = load(target_dir, plan.device, plan.exact_dtype), load(draft_dir, plan.device, plan.exact_dtype)
    vocab = target.config.vocab_size
    # Random prompts, and prompts that repeat themselves: n-gram lookup finds matches in those.
    prompts = random_prompts(plan.greedy_prompts, 16, vocab, seed=3)
    prompts += [p[:6] * 3 for p in random_prompts(plan.greedy_prompts, 6, vocab, seed=4)]
    requests = [GenerationRequest(p, plan.new_tokens) for p in prompts]
    expected = [r.token_ids for r in SpeculativeGenerator(target).generate(requests)]
    methods = {"draft": SpecOptions("draft", 4), "ngram": SpecOptions("ngram", 4), "hybrid": SpecOptions("hybrid", 4),
               "draft-tree": SpecOptions("draft", 4, adaptive_k=False, tree="on"),
               "hybrid-tree": SpecOptions("hybrid", 4, adaptive_k=False, tree="on")}
    accepted = {}
    for name, options in methods.items():
        results = SpeculativeGenerator(target, draft, options).generate(requests)
        got = [r.token_ids for r in results]
        assert got == expected, f"{name}: greedy output differs from target-only"
        accepted[name] = sum(r.stats.accepted for r in results)
    # Penalties and a logit bias: every verified row adjusted on the device for its own context.
    penalised = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3,
                               logit_bias=((7, 1.5),))
    requests = [GenerationRequest(p, plan.new_tokens, penalised) for p in prompts]
    expected = [r.token_ids for r in SpeculativeGenerator(target).generate(requests)]
    for name in ("draft", "hybrid-tree"):
        results = SpeculativeGenerator(target, draft, methods[name]).generate(requests)
        assert [r.token_ids for r in results] == expected, f"{name}, penalised: greedy output differs from target-only"
        accepted[f"{name}-penalised"] = sum(r.stats.accepted for r in results)
    report = {"dtype": plan.exact_dtype, "methods": [*methods, "draft-penalised", "hybrid-tree-penalised"],
              "accepted_tokens": accepted}
    if plan.exact_dtype != plan.serving_dtype:
        del target, draft
        free_memory(plan.device)
        report[f"{plan.serving_dtype}_agreement"] = serving_dtype_agreement(target_dir, draft_dir, plan, prompts,
                                                                            methods)
    return report


def serving_dtype_agreement(target_dir: Path, draft_dir: Path, plan: Plan, prompts: list[list[int]],
                            methods: dict[str, SpecOptions]) -> dict[str, Any]:
    """Measured, not asserted (see ``Plan.exact_dtype``): per method, the prompts whose greedy output in the
    serving dtype equals target-only's there, and where the first that differs parts from it."""
    target, draft = load(target_dir, plan.device, plan.serving_dtype), load(draft_dir, plan.device, plan.serving_dtype)
    requests = [GenerationRequest(p, plan.new_tokens) for p in prompts]
    expected = [r.token_ids for r in SpeculativeGenerator(target).generate(requests)]
    agreement = {}
    for name in ("draft", "hybrid-tree"):
        got = [r.token_ids for r in SpeculativeGenerator(target, draft, methods[name]).generate(requests)]
        parted = [next(i for i, (a, b) in enumerate(zip(g + [-1], e + [-1])) if a != b)
                  for g, e in zip(got, expected) if g != e]
        agreement[name] = {"equal": len(got) - len(parted), "prompts": len(got), "first_difference_at": parted}
    return agreement


def heads_greedy(target_dir: Path, plan: Plan) -> dict[str, Any]:
    from tandem.heads.serving import drafter_for
    from tests.heads.tiny_heads import tiny_heads  # random heads of the target's shapes, on its device

    uncached = load(target_dir, plan.device, plan.exact_dtype, prefix_caching=False)
    prompts = random_prompts(plan.greedy_prompts, 40, uncached.config.vocab_size, seed=5)
    requests = [GenerationRequest(p, plan.new_tokens) for p in prompts]
    expected = [r.token_ids for r in SpeculativeGenerator(uncached).generate(requests)]
    del uncached
    target = load(target_dir, plan.device, plan.exact_dtype, prefix_caching=True)
    drafted, reused = {}, {}
    for kind in ("medusa", "eagle"):
        generator = SpeculativeGenerator(target, options=SpecOptions(kind, 4, adaptive_k=False, heads_nodes=8),
                                         heads=drafter_for(tiny_heads(target, kind), target))
        for attempt in ("first", "cached"):  # the second pass finds every prompt's blocks cached
            results = generator.generate(requests)
            assert [r.token_ids for r in results] == expected, f"{kind} ({attempt}): greedy output differs"
            drafted[f"{kind} {attempt}"] = sum(r.stats.drafted for r in results)
            reused[f"{kind} {attempt}"] = sum(r.stats.prompt_tokens_reused for r in results)
        assert reused[f"{kind} cached"] > 0, f"{kind}: the second pass reused no cached prompt block"
        assert drafted[f"{kind} first"] > 0, f"{kind}: the heads proposed nothing"
    return {"drafted_tokens": drafted, "prompt_tokens_reused": reused}


def lossless(plan: Plan, work: Path) -> dict[str, Any]:
    """The suite's six-token pair (tests/spec/losslessness.py), made on the CPU so that its law is the same on every
    device, sampled on this one. Models drawn on the device were no test: the first GPU run's target put 0.99997 on
    one first token and its draft never had a token kept, so the rule was never exercised (2026-12-04)."""
    from tests.spec.losslessness import (
        PAIR_PROMPT,
        PAIR_TEMPERATURE,
        chi_square_pvalue,
        exact_two_token_distribution,
        save_six_token_pair,
    )

    target_dir, draft_dir = save_six_token_pair(work / "lossless")
    target, draft = load(target_dir, plan.device, "float32"), load(draft_dir, plan.device, "float32")
    vocab = target.config.vocab_size
    exact = exact_two_token_distribution(target, PAIR_PROMPT, PAIR_TEMPERATURE)
    pvalues, kept = {}, {}
    for tree in ("off", "on"):
        requests = [GenerationRequest(PAIR_PROMPT, 4, SamplingParams(PAIR_TEMPERATURE, seed=LOSSLESS_SEED_BASE + s,
                                                                     rejection_rule=True))
                    for s in range(plan.lossless_samples)]
        options = SpecOptions("draft", 2, adaptive_k=False, tree=tree, tree_width=2)
        results = SpeculativeGenerator(target, draft, options).generate(requests)
        pvalues[tree] = chi_square_pvalue([r.token_ids[1] * vocab + r.token_ids[2] for r in results], exact)
        accepted, drafted = sum(r.stats.accepted for r in results), sum(r.stats.drafted for r in results)
        # Both branches of the rule ran: some draft tokens kept, some rejected (and a token drawn from the residual).
        assert 0 < accepted < drafted, f"tree {tree}: {accepted} of {drafted} draft tokens kept: the rule is untested"
        kept[tree] = f"{accepted} of {drafted}"
    assert all(p > SIGNIFICANCE for p in pvalues.values()), f"chi-square p-values {pvalues} (below {SIGNIFICANCE})"
    return {"samples": plan.lossless_samples, "pvalue_chain": pvalues["off"], "pvalue_tree": pvalues["on"],
            "draft_tokens_kept": kept}


def processes(target_dir: Path, draft_dir: Path, plan: Plan, work: Path) -> dict[str, Any]:
    from tandem.client import TandemClient, build_request
    from tandem.cluster import ClusterSpec, LocalCluster

    spec = ClusterSpec(str(target_dir), str(draft_dir), dtype=plan.serving_dtype, kv_cache_tokens=4096,
                       worker_threads=1 if plan.device == "cpu" else None, metrics=False,
                       worker_args=("--device", plan.device), log_dir=work / "cluster")
    with LocalCluster(spec) as cluster, TandemClient(cluster.coordinator.address, timeout_s=120) as client:
        request = build_request([5, 6, 7, 8, 9], max_new_tokens=8, method="draft", ignore_eos=True,
                                sampling=SamplingParams(temperature=0.8, seed=1))
        chunks = list(client.stream(request))
    tokens = [t for chunk in chunks for t in chunk.token_ids]
    assert len(tokens) == 8, f"streamed {len(tokens)} tokens, asked for 8"
    return {"streamed_tokens": len(tokens), "messages": len(chunks)}


def tensor_parallel(model_dir: Path, plan: Plan) -> dict[str, Any]:
    from tandem.parallel.engine import TensorParallelEngine

    ids = list(range(3, 20))
    single = load(model_dir, plan.device, "float32")
    expected = single.forward([ForwardItem("s", ids, num_logits=4)])[0]
    engine = TensorParallelEngine.load(EngineConfig(model_dir, dtype="float32", device=plan.device,
                                                    kv_cache_tokens=2048, tensor_parallel_size=1))
    try:
        got = engine.forward([ForwardItem("s", ids, num_logits=4)])[0]
        backend = torch.distributed.get_backend(engine.ranks.context.compute)
    finally:
        engine.close()
    error = float((got - expected).abs().max())
    assert error <= 1e-4 * float(expected.abs().max()), f"one-rank logits differ by {error:.2e}"
    return {"backend": str(backend), "max_logit_error": error}


def attention(model_dir: Path, plan: Plan) -> dict[str, Any]:
    block = 256 if torch.device(plan.device).type == "cuda" else 16  # flash-attn's paged KV wants 256
    auto = load(model_dir, plan.device, plan.serving_dtype, block_size=block)
    sdpa = load(model_dir, plan.device, plan.serving_dtype, block_size=block, attention_backend="sdpa")
    ids = list(range(3, 40))
    a, b = (e.forward([ForwardItem("s", ids, num_logits=8)])[0] for e in (auto, sdpa))
    error = float((a - b).abs().max() / b.abs().max())
    assert error <= LOGIT_TOLERANCE[plan.serving_dtype], f"{auto.backend.name} against sdpa: {error:.2e}"
    return {"backend": auto.backend.name, "max_relative_logit_error": error}


def kv_sizing(model_dir: Path, plan: Plan) -> dict[str, Any]:
    """CUDA: ``--gpu-memory-utilization 0.5`` (tandem/kv_sizing.py) sizes the pool so that, once allocated, the
    process holds no more than half the device and leaves little of it unused besides the measured activation peak
    and the room kept free; and a prompt as long as the profile's runs in it."""
    from tandem.kv_sizing import HEADROOM_BYTES, PROFILE_TOKENS

    free_memory(plan.device)
    total = torch.cuda.mem_get_info()[1]
    engine = load(model_dir, plan.device, plan.serving_dtype, gpu_memory_utilization=0.5)
    free_memory(plan.device)
    in_use = total - torch.cuda.mem_get_info()[0]
    tokens, budget = engine.kv_cache.num_blocks * engine.kv_cache.block_size, engine.kv_budget
    prompt = min(PROFILE_TOKENS, engine.config.max_position_embeddings, tokens)
    engine.forward([ForwardItem("long", [3] * prompt, num_logits=1, prompt=True)])
    synchronize(plan.device)
    peak = torch.cuda.max_memory_allocated()
    del engine
    free_memory(plan.device)
    assert budget is not None and tokens == budget.tokens > 0, f"no pool sized from memory: {budget}"
    assert in_use <= 0.5 * total, f"{in_use / 2**30:.1f} GiB in use, more than half of {total / 2**30:.1f} GiB"
    unused = 0.5 * total - in_use - budget.activation_peak - HEADROOM_BYTES  # the pool's rounding to whole blocks
    assert unused <= 256 << 20, f"{unused / 2**20:.0f} MiB of the half left unused besides the measured peak and room"
    return {"pool_tokens": tokens, "in_use_gib": round(in_use / 2**30, 2), "total_gib": round(total / 2**30, 2),
            "activation_peak_gib": round(budget.activation_peak / 2**30, 2), "prompt_tokens": prompt,
            "peak_allocated_gib": round(peak / 2**30, 2)}


def graphed(model_dir: Path, plan: Plan, dtype: str) -> ModelEngine:
    """An engine whose decode and verify steps run as captured graphs (on a CPU, the eager stand-in for capture)."""
    if torch.device(plan.device).type == "cuda":
        return load(model_dir, plan.device, dtype, cuda_graphs=True)
    engine = load(model_dir, plan.device, dtype)
    engine.use_step_graphs(EagerRecorder())
    return engine


def self_drafted(target: ModelEngine, k: int = 4) -> SpeculativeGenerator:
    """Speculation with the target as its own draft (the same weights, a KV pool of its own), fixed k."""
    own_draft = ModelEngine.with_new_cache(target.model, target.kv_cache.num_blocks, target.kv_cache.block_size,
                                           target.backend.name)
    if target.graphs is not None:
        # As a draft worker started with --cuda-graphs: its decode steps graphed too, by a recorder of its own. The
        # H200 run of 2026-12-04 drafted eagerly here, and self-speculation with graphs "on" ran at 47 tokens/s
        # against plain graphed decoding's 184 (0.5B shapes): four eager draft steps per round.
        recorder = target.graphs.recorder
        own_draft.use_step_graphs(CudaGraphRecorder(recorder.device) if isinstance(recorder, CudaGraphRecorder)
                                  else EagerRecorder())
    return SpeculativeGenerator(target, own_draft, SpecOptions("draft", k, adaptive_k=False))


def step_graphs(model_dir: Path, plan: Plan) -> dict[str, Any]:
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(max(3, plan.greedy_prompts), 20, vocab, seed=8)
    requests = [GenerationRequest(p, plan.new_tokens, k_max=0) for p in prompts]
    # Its own k (k_max None): until 2026-12-04 this request asked k_max=0 and so drafted nothing, and no verify
    # step of 5 tokens ever ran here.
    speculated = [GenerationRequest(prompts[0], plan.new_tokens)]
    outputs, replays, drafted_tokens = {}, 0, {}
    for label in ("eager", "graphs"):
        engine = graphed(model_dir, plan, "float32") if label == "graphs" else load(model_dir, plan.device, "float32")
        plain = [r.token_ids for r in SpeculativeGenerator(engine).generate(requests)]  # batched decode steps
        generator = self_drafted(engine)
        results = generator.generate(speculated)  # verify steps of 5 tokens, and the draft's decode steps
        outputs[label] = (plain, [r.token_ids for r in results])
        drafted_tokens[label] = sum(r.stats.drafted for r in results)
        if engine.graphs is not None:
            replays, captured, disabled = engine.graphs.replays, engine.graphs.captured, engine.graphs.disabled
            draft_graphs = generator.draft.engine.graphs
            draft_replays, draft_disabled = draft_graphs.replays, draft_graphs.disabled
        del engine, generator
        free_memory(plan.device)
    assert outputs["graphs"][0] == outputs["eager"][0], "greedy decoding through graphs differs from eager"
    assert outputs["graphs"][1] == outputs["eager"][1], "self-speculation through graphs differs from eager"
    assert disabled is None and draft_disabled is None, (
        f"a capture failed, and graphs turned off: {disabled or draft_disabled}")
    assert replays >= plan.new_tokens, f"only {replays} steps ran as graphs"
    assert drafted_tokens["graphs"] > 0, "self-speculation drafted nothing: no verify step was tested"
    assert draft_replays > 0, "the draft's decode steps never ran as graphs"
    return {"graph_replays": replays, "graphs_captured": captured, "draft_graph_replays": draft_replays,
            "drafted_tokens": drafted_tokens["graphs"], "tokens": len(prompts) * plan.new_tokens}


# ----- measurements ----------------------------------------------------------------------------

def forward_cost(model_dir: Path, plan: Plan) -> dict[str, float]:
    engine = load(model_dir, plan.device, plan.serving_dtype)
    engine.forward([ForwardItem("p", [3] * plan.prefix, num_logits=1)])
    engine.warmup()
    costs = {}
    for n in FORWARD_SIZES:
        times = []
        for _ in range(plan.repeats):
            synchronize(plan.device)
            started = time.perf_counter()
            engine.forward([ForwardItem("p", [4] * n, num_logits=n)])
            synchronize(plan.device)
            times.append(time.perf_counter() - started)
            engine.rollback("p", plan.prefix)
        costs[str(n)] = round(statistics.median(times) * 1000, 3)  # ms
    return costs


ROW_COUNTS = (2, 4, 5, 8, 16, 40, 64, 128)  # a decode step's rows, a verify's (k + 1 per stream), batches of them


@torch.inference_mode()
def row_invariance(model_dir: Path, plan: Plan) -> dict[str, Any]:
    """What greedy equality in the serving dtype rests on (``Plan.exact_dtype``): whether a linear layer's row
    comes out bitwise the same in a call of any row count. For the first block's layers and the lm_head, per row
    count: how many give every row exactly as a call of that row alone does, and the largest difference (relative
    to the row's largest value). Then, at 64 rows, whether a row depends on which other rows share its call
    (were it not, padding every decode and verify call to one row count would make bf16 rows invariant)."""
    engine = load(model_dir, plan.device, plan.serving_dtype)
    layers = {name: m for name, m in engine.model.named_modules()
              if isinstance(m, RowStableLinear) and (name.startswith("layers.0.") or name == "lm_head")}
    generator = torch.Generator(device=plan.device).manual_seed(0)
    counts: dict[str, dict[str, Any]] = {}
    alike_at_64 = 0
    for layer in layers.values():
        x = torch.randn(max(ROW_COUNTS), layer.in_features, generator=generator, device=plan.device,
                        dtype=engine.dtype)  # [rows, in]
        alone = torch.cat([layer(x[i : i + 1]) for i in range(max(ROW_COUNTS))])  # [rows, out]
        for m in ROW_COUNTS:
            together = layer(x[:m])  # [m, out]
            entry = counts.setdefault(str(m), {"layers_equal": 0, "layers": 0, "max_relative_difference": 0.0})
            entry["layers"] += 1
            entry["layers_equal"] += int(torch.equal(together, alone[:m]))
            scale = alone[:m].float().abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
            difference = float(((together.float() - alone[:m].float()).abs() / scale).max())
            entry["max_relative_difference"] = max(entry["max_relative_difference"], difference)
        others = torch.randn(56, layer.in_features, generator=generator, device=plan.device, dtype=engine.dtype)
        first = layer(x[:64])[:8]  # [8, out]: rows 0..7 beside rows 8..63 of x
        second = layer(torch.cat((x[:8], others)))[:8]  # the same rows beside other rows
        alike_at_64 += int(torch.equal(first, second))
    return {"dtype": plan.serving_dtype, "by_row_count": counts,
            "rows_alike_beside_other_rows_at_64": f"{alike_at_64} of {len(layers)} layers"}


def decode_speed(model_dir: Path, plan: Plan) -> dict[str, float]:
    n = plan.new_tokens
    engine = load(model_dir, plan.device, plan.serving_dtype)
    engine.warmup()
    prompt = random_prompts(1, 16, engine.config.vocab_size, seed=5)[0]
    generator = SpeculativeGenerator(engine)
    request = GenerationRequest(prompt, n, k_max=0)
    generator.generate([request])  # warm
    synchronize(plan.device)
    started = time.perf_counter()
    generator.generate([request])
    synchronize(plan.device)
    ours = n / (time.perf_counter() - started)
    del generator, engine
    hf = hf_model(model_dir, plan.device, plan.serving_dtype)
    ids = torch.tensor([prompt], device=plan.device)
    with torch.inference_mode():
        hf.generate(ids, do_sample=False, max_new_tokens=4, min_new_tokens=4, pad_token_id=0)  # warm
        synchronize(plan.device)
        started = time.perf_counter()
        hf.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n, pad_token_id=0)
        synchronize(plan.device)
    theirs = n / (time.perf_counter() - started)
    del hf
    free_memory(plan.device)
    return {"tandem_tok_s": round(ours, 2), "transformers_tok_s": round(theirs, 2), "tokens": n}


def self_speculation(model_dir: Path, plan: Plan) -> dict[str, float]:
    target = load(model_dir, plan.device, plan.serving_dtype)
    target.warmup()
    prompt = random_prompts(1, 16, target.config.vocab_size, seed=6)[0]
    request = GenerationRequest(prompt, plan.new_tokens * 2)
    speeds, acceptance = {}, 0.0
    for name, generator in (("target_only", SpeculativeGenerator(target)), ("self_draft_k4", self_drafted(target))):
        generator.generate([request])  # warm
        synchronize(plan.device)
        started = time.perf_counter()
        (result,) = generator.generate([request])
        synchronize(plan.device)
        speeds[name] = len(result.token_ids) / (time.perf_counter() - started)
        if result.stats.drafted:
            acceptance = result.stats.accepted / result.stats.drafted
    return {**{f"{k}_tok_s": round(v, 2) for k, v in speeds.items()},
            "speedup": round(speeds["self_draft_k4"] / speeds["target_only"], 3), "acceptance": round(acceptance, 3)}


def graph_speed(model_dir: Path, plan: Plan) -> dict[str, float]:
    """Tokens/s with CUDA graphs off and on: greedy decoding of 1 and of 8 requests, and self-speculation."""
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    prompts = random_prompts(8, 16, vocab, seed=9)
    figures: dict[str, float] = {}
    for label in ("off", "on"):
        engine = graphed(model_dir, plan, plan.serving_dtype) if label == "on" else load(
            model_dir, plan.device, plan.serving_dtype)
        engine.warmup()
        runs = {"decode_1": (SpeculativeGenerator(engine), prompts[:1]),
                "decode_8": (SpeculativeGenerator(engine), prompts),
                "self_draft_k4": (self_drafted(engine), prompts[:1])}
        for name, (generator, batch) in runs.items():
            requests = [GenerationRequest(p, plan.new_tokens, k_max=0 if name.startswith("decode") else None)
                        for p in batch]
            generator.generate(requests)  # warm: every shape met here is captured now
            synchronize(plan.device)
            started = time.perf_counter()
            results = generator.generate(requests)
            synchronize(plan.device)
            figures[f"{name}_{label}_tok_s"] = round(sum(len(r.token_ids) for r in results)
                                                     / (time.perf_counter() - started), 2)
        del runs, engine
        free_memory(plan.device)
    for name in ("decode_1", "decode_8", "self_draft_k4"):
        figures[f"{name}_speedup"] = round(figures[f"{name}_on_tok_s"] / figures[f"{name}_off_tok_s"], 3)
    return figures


@contextmanager
def forward_spans(engine: ModelEngine) -> Iterator[list[float]]:
    """The seconds each forward of ``engine`` spans on its device while inside, as its step clock observes them
    (on CUDA: from the event before the step's first launch to the one after its last kernel; on a CPU, the call)."""
    spans: list[float] = []
    stop = engine.clock.stop

    def counted(mark: Any, observe: Callable[[float], None]) -> None:
        stop(mark, lambda seconds: (spans.append(seconds), observe(seconds)))

    engine.clock.stop = counted  # instance attribute: the benchmark's instrument, gone on exit
    try:
        yield spans
    finally:
        engine.clock.settle()  # (on CUDA the last spans arrive once their kernels have run)
        del engine.clock.stop


def step_time(model_dir: Path, plan: Plan) -> dict[str, float]:
    """Where a decode step's time goes, per token of greedy decoding of one request, graphs on (on a CPU, the eager
    stand-in): the wall time; the forward's span (``forward_spans``); and the decode step's graph replayed alone,
    back to back (the device's own time when nothing waits on the host). wall - forward: the verdict's sampling
    and the loop's bookkeeping; forward - replay: the host preparing the step's inputs inside the forward."""
    engine = graphed(model_dir, plan, plan.serving_dtype)
    engine.warmup()
    prompt = random_prompts(1, 16, engine.config.vocab_size, seed=10)[0]
    generator, n = SpeculativeGenerator(engine), plan.new_tokens * 2
    request = GenerationRequest(prompt, n, k_max=0)
    generator.generate([request])  # warm
    with forward_spans(engine) as spans:
        synchronize(plan.device)
        started = time.perf_counter()
        (result,) = generator.generate([request])
        synchronize(plan.device)
        wall = time.perf_counter() - started
    tokens = len(result.token_ids)
    replay = engine.graphs.replay_seconds(GraphShape(1, 1, engine.graphs.min_window_blocks), repeats=50)
    del generator, engine
    free_memory(plan.device)
    return {"wall_ms_per_token": round(wall / tokens * 1000, 3),
            "forward_ms_per_token": round(sum(spans) / tokens * 1000, 3),
            "decode_graph_replay_ms": round(replay * 1000, 3), "forwards": len(spans), "tokens": tokens}


# ----- the run ---------------------------------------------------------------------------------

def describe_device(device: str) -> dict[str, Any]:
    info: dict[str, Any] = {"device": device, "torch": torch.__version__, "python": platform.python_version()}
    if torch.device(device).type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    else:
        info["cpu"] = _cpu_name()
    try:
        import flash_attn  # type: ignore[import-not-found]

        info["flash_attn"] = flash_attn.__version__
    except ImportError:
        info["flash_attn"] = None
    return info


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def run(plan: Plan, work: Path, skip: frozenset[str] = frozenset(),
        after_each: Callable[[Report], None] | None = None) -> Report:
    """Every check and measurement of ``plan`` not in ``skip``; models are made under ``work``."""
    report = Report(after_each=after_each)
    dirs: dict[str, Path] = {}

    def model(shape: str) -> Path:
        if shape not in dirs:
            dirs[shape] = save_random_model(work / shape, shape, plan.device, seed=len(dirs))
        return dirs[shape]

    def wanted(name: str) -> bool:
        return name not in skip

    if wanted("engine-vs-transformers"):
        for shape in plan.models:
            report.check("engine-vs-transformers", shape, lambda s=shape: engine_vs_transformers(model(s), plan))
    pair = f"{plan.target} / {plan.draft}"
    if wanted("speculative-greedy"):
        report.check("speculative-greedy", pair,
                     lambda: speculative_greedy(model(plan.target), model(plan.draft), plan))
    if wanted("heads"):
        report.check("heads", plan.target, lambda: heads_greedy(model(plan.target), plan))
    if wanted("lossless"):
        report.check("lossless", "vocabulary of 6", lambda: lossless(plan, work))
    if wanted("processes"):
        report.check("processes", "tiny / tiny-draft",
                     lambda: processes(model("tiny"), model("tiny-draft"), plan, work))
    if wanted("tensor-parallel"):
        report.check("tensor-parallel", "tiny, 1 rank", lambda: tensor_parallel(model("tiny"), plan))
    if wanted("attention"):
        report.check("attention", plan.target, lambda: attention(model(plan.target), plan))
    if wanted("kv-sizing") and torch.device(plan.device).type == "cuda":  # a CPU has no device memory to size by
        report.check("kv-sizing", plan.target, lambda: kv_sizing(model(plan.target), plan))
    if wanted("step-graphs"):
        report.check("step-graphs", plan.draft, lambda: step_graphs(model(plan.draft), plan))
    measured = [s for s in plan.models if s.startswith("qwen")] or list(plan.models)
    measures: list[tuple[str, Callable[[Path, Plan], dict[str, Any]]]] = [
        ("row-invariance", row_invariance), ("forward-cost", forward_cost), ("decode", decode_speed),
        ("self-speculation", self_speculation), ("step-time", step_time)]
    if torch.device(plan.device).type == "cuda":  # a CPU replays the eager stand-in: nothing to time
        measures.append(("graphs", graph_speed))
    for name, measure in measures:
        if wanted(name):
            for shape in measured:
                report.check(f"measure {name}", shape,
                             lambda s=shape, m=measure, n=name: _measured(report, n, s, m(model(s), plan)))
            free_memory(plan.device)
    return report


def _measured(report: Report, name: str, shape: str, figures: dict[str, Any]) -> dict[str, Any]:
    report.measurements.setdefault(name, {})[shape] = figures
    return {}


def tables(report: Report, device: dict[str, Any]) -> str:
    parts = [f"Device: {device.get('gpu') or device.get('cpu')} ({device['device']}), torch {device['torch']}, "
             f"flash-attn {device['flash_attn'] or 'absent'}.", "",
             markdown_table(report.checks, ["check", "subject", "passed", "seconds", "error"])]
    costs = report.measurements.get("forward-cost", {})
    if costs:
        rows = [{"model": shape, **{f"{n} tok (ms)": ms for n, ms in figures.items()}}
                for shape, figures in costs.items()]
        parts += ["", "Forward cost over a cached prefix:", "",
                  markdown_table(rows, ["model", *(f"{n} tok (ms)" for n in FORWARD_SIZES)])]
    invariance = report.measurements.get("row-invariance", {})
    if invariance:
        rows = []
        for shape, figures in invariance.items():
            for m, e in figures["by_row_count"].items():
                rows.append({"model": shape, "rows": m, **e,
                             "max_relative_difference": f"{e['max_relative_difference']:.1e}"})  # (tiny values)
        alike = ", ".join(f"{shape}: {f['rows_alike_beside_other_rows_at_64']}" for shape, f in invariance.items())
        dtype = next(iter(invariance.values()))["dtype"]
        columns = ["model", "rows", "layers_equal", "layers", "max_relative_difference"]
        parts += ["", f"Linear layers' rows against the same rows computed alone ({dtype}):", "",
                  markdown_table(rows, columns),
                  "", f"At 64 rows, rows alike beside other rows: {alike}."]
    for name in ("decode", "self-speculation", "step-time", "graphs"):
        figures = report.measurements.get(name, {})
        if figures:
            rows = [{"model": shape, **f} for shape, f in figures.items()]
            parts += ["", f"{name}:", "", markdown_table(rows, ["model", *next(iter(figures.values()))])]
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (tiny shapes only)")
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR, help="where gpu_check.json/.md go")
    parser.add_argument("--quick", action="store_true", help="on CUDA: tiny shapes only (a smoke run)")
    parser.add_argument("--skip", default="", help="comma-separated checks or measurements to leave out")
    args = parser.parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: run with --device cpu (make gpu-check DEVICE=cpu)")
    plan = Plan.for_device(args.device, args.quick)
    device = describe_device(args.device)
    started = time.perf_counter()

    def save(report: Report, complete: bool = False) -> None:
        """The results so far (``complete`` False: the run is still going, or was stopped before its end)."""
        payload = {"device": device, "settings": {"device": args.device, "quick": args.quick, "skip": args.skip},
                   "complete": complete, "passed": report.passed, "seconds": round(time.perf_counter() - started, 1),
                   "checks": [{k: v for k, v in c.items() if k != "trace"} for c in report.checks],
                   "measurements": report.measurements}
        write_json(args.out, "gpu_check", payload)
        title = "GPU check" if complete else "GPU check (incomplete: the run had not ended when this was written)"
        write_markdown(args.out, "gpu_check", title, tables(report, device))

    with tempfile.TemporaryDirectory(prefix="tandem-gpu-check-") as work:
        report = run(plan, Path(work), frozenset(s for s in args.skip.split(",") if s), after_each=save)
    save(report, complete=True)
    print(tables(report, device))
    for failed in (c for c in report.checks if not c["passed"]):
        print(f"\n{failed['check']} ({failed['subject']}):\n{failed.get('trace', failed['error'])}", file=sys.stderr)
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
