"""One training run, start to finish: corpus, features, draft vocabulary, training, summary, heads on disk.

Every step that takes long resumes: finished feature shards are kept
(``work_dir/features-<key>``, the key naming the corpus, the target and the streams)
and training continues from its newest checkpoint (``work_dir/checkpoints``) with
``resume``. The heads are written last, whole or not at all, with their provenance
(``HeadsConfig.training``): the command, the seed, the corpus (sources, licences,
tokens), the time taken and the held-back accuracy.
"""

from __future__ import annotations

import dataclasses
import datetime
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tandem.config import EngineConfig, ModelConfig
from tandem.engine import FeatureSpec, ModelEngine
from tandem.errors import InvalidRequestError
from tandem.heads.config import HeadsConfig
from tandem.heads.fingerprint import target_fingerprint
from tandem.heads.store import Heads, is_tandem_layout, save_heads
from tandem.heads.train.checkpoints import CheckpointDir
from tandem.heads.train.compute_dtype import DtypeChoice, choose_compute_dtype
from tandem.heads.train.corpus import Corpus, CorpusSettings, build_corpus
from tandem.heads.train.eagle_train import EagleObjective
from tandem.heads.train.features import INDEX_FILE, extract_features, features_key
from tandem.heads.train.head_init import initial_heads, target_lm_head_rows
from tandem.heads.train.medusa_train import MedusaObjective
from tandem.heads.train.options import TrainOptions, feature_streams
from tandem.heads.train.shards import BatchPlan, FeatureShards
from tandem.heads.train.sources import debian_doc_files, site_packages_files, user_files
from tandem.heads.train.summary import Objective, accuracy, table
from tandem.heads.train.trainer import LoopSettings, train_loop
from tandem.heads.train.vocab import coverage, draft_vocabulary, target_to_draft
from tandem.model_convert import SILENT, Progress
from tandem.model_store import ProgressLine
from tandem.tokenizer import load_tokenizer

Log = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class TrainRequest:
    """Where a run reads and writes, and how it reports (nothing here changes the weights but the corpus)."""

    target_dir: Path
    target_name: str
    out: Path
    work_dir: Path
    corpus: tuple[Path, ...] = ()  # empty: the default corpus (tandem.heads.train.sources)
    device: str = "cpu"
    resume: bool = False
    resume_strict: bool = True  # False: checkpoints of a run asked differently are dropped, not refused
    command: str = ""
    seqs_per_forward: int | None = None  # None: 1 on a CPU (measured fastest there), 8 on a GPU


@dataclass(frozen=True, slots=True)
class TrainResult:
    out: Path
    config: HeadsConfig
    table: str


def train_heads(request: TrainRequest, options: TrainOptions, *, progress: bool = True,
                stop_after: int | None = None, log: Log = _stderr) -> TrainResult | None:
    """Run (or resume) one training; None when ``stop_after`` ended it early (tests, as an interrupted run)."""
    _check_out_dir(request.out)
    line = ProgressLine(f"{request.target_name}-{options.kind}") if progress else None
    try:
        result = _train(request, options, line or SILENT, stop_after, log)
    except BaseException as exc:
        if line is not None:
            line.close("stopped" if isinstance(exc, KeyboardInterrupt) else "failed")
        raise
    if line is not None:
        line.close("ready" if result is not None else "stopped")
    return result


def _train(request: TrainRequest, options: TrainOptions, report: Progress, stop_after: int | None,
           log: Log) -> TrainResult | None:
    started = time.perf_counter()
    device = torch.device(request.device)
    target = ModelConfig.from_dir(request.target_dir)
    draft_size = options.draft_vocab_for(target)  # flags that cannot work are refused before anything loads
    sources = user_files(request.corpus) if request.corpus else [*site_packages_files(), *debian_doc_files()]
    report.stage("loading")
    engine = _load_engine(request, options)
    fingerprint = target_fingerprint(engine.model)
    report.stage("corpus")
    corpus_settings = CorpusSettings(options.tokens, options.seq_len, options.seed, options.held_back)
    corpus = build_corpus(sources, load_tokenizer(request.target_dir), corpus_settings)
    spec = FeatureSpec(feature_streams(options.kind, target))
    features_dir = request.work_dir / f"features-{features_key(corpus, fingerprint, spec)}"
    if not (features_dir / INDEX_FILE).is_file():
        per_forward = request.seqs_per_forward or (8 if device.type == "cuda" else 1)
        tokens = corpus.summary["tokens"]
        log(f"features: {tokens['train'] + tokens['held_back']} corpus tokens through {request.target_name}, "
            f"shards in {features_dir} (finished shards are kept if this stops)")
        extracting = time.perf_counter()
        extract_features(engine, spec, corpus, features_dir, seqs_per_forward=per_forward, progress=report)
        log(f"features done in {time.perf_counter() - extracting:.0f} s")
    features_seconds = time.perf_counter() - started
    # The target's embedding table is all the training needs of it (EAGLE reads it; nothing else does).
    embed_tokens = engine.model.embed_tokens.weight.detach().to(device) if options.kind == "eagle" else None
    del engine  # its weights and KV pool: several GB a large target would otherwise hold through training

    shards = FeatureShards(features_dir)
    report.stage("vocabulary")
    label_counts = shards.counts("labels", target.vocab_size)
    d2t = draft_vocabulary(label_counts, shards.counts("tokens", target.vocab_size), draft_size)
    cfg = heads_config(options, target, d2t.numel(), spec.streams, fingerprint, request.target_name)
    module = initial_heads(cfg, target_lm_head_rows(request.target_dir, target, d2t), d2t, options.seed, device)
    t2d = target_to_draft(d2t, target.vocab_size).to(device)
    objective: Objective = (MedusaObjective(module, t2d) if options.kind == "medusa"  # type: ignore[arg-type]
                            else EagleObjective(module, t2d, embed_tokens, options.ttt_steps))  # type: ignore[arg-type]
    plan = BatchPlan(shards.train, options.batch_size, options.seed)
    report.stage("timing")
    dtype = choose_compute_dtype(options.train_dtype, device, module, objective, shards.batch(plan.batch(0)))
    use_bf16 = dtype.use_bf16
    log(f"training in {'bf16 autocast' if use_bf16 else 'float32'} ({dtype.reason})")

    report.stage("measuring")
    untrained = accuracy(objective, shards.held_back_batches(options.batch_size), device, use_bf16)
    run = {"options": options.to_json(), "features": features_dir.name, "device": device.type}
    settings = LoopSettings(options.steps, options.lr, options.warmup_steps, options.checkpoint_every, use_bf16, device)
    checkpoints = CheckpointDir(request.work_dir / "checkpoints")
    history = train_loop(module, objective, shards, plan,
                         settings, checkpoints, run, {"training_seconds": 0.0}, resume=request.resume,
                         strict=request.resume_strict, progress=report, stop_after=stop_after, log=log)
    if stop_after is not None and stop_after < options.steps:
        return None

    report.stage("measuring")
    module.eval()
    trained = accuracy(objective, shards.held_back_batches(options.batch_size), device, use_bf16)
    summary = table(trained, untrained)
    provenance = _provenance(request, options, corpus, cfg, label_counts, d2t, dtype, history, trained,
                             untrained, features_seconds, time.perf_counter() - started)
    module.config = dataclasses.replace(cfg, training=provenance)
    _write_heads(module, request.out)
    checkpoints.clear()  # the heads are out: checkpoints were only for resuming
    return TrainResult(request.out, module.config, summary)


def heads_config(options: TrainOptions, target: ModelConfig, draft_vocab: int, streams: tuple[int, ...],
                 fingerprint: str, target_name: str) -> HeadsConfig:
    common = dict(hidden_size=target.hidden_size, vocab_size=target.vocab_size, draft_vocab_size=draft_vocab,
                  feature_streams=streams, target_fingerprint=fingerprint, target_name=target_name)
    if options.kind == "medusa":
        return HeadsConfig(kind="medusa", num_heads=options.num_heads, num_res_layers=1, shared_lm_head=True,
                           **common)  # type: ignore[arg-type]
    return HeadsConfig(
        kind="eagle", num_attention_heads=target.num_heads, num_kv_heads=target.num_kv_heads,
        head_dim=target.head_dim, intermediate_size=options.eagle_intermediate_size_for(target),
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
        **common,  # type: ignore[arg-type]
    )


def _load_engine(request: TrainRequest, options: TrainOptions) -> ModelEngine:
    per_forward = request.seqs_per_forward or 8
    kv_tokens = max(16, per_forward * options.seq_len + 16)
    return ModelEngine.load(EngineConfig(request.target_dir, device=request.device, kv_cache_tokens=kv_tokens))


def _provenance(request: TrainRequest, options: TrainOptions, corpus: Corpus, cfg: HeadsConfig,
                label_counts: torch.Tensor, d2t: torch.Tensor, dtype: DtypeChoice, history: dict[str, Any],
                trained: list[dict[str, Any]], untrained: list[dict[str, Any]], features_seconds: float,
                total_seconds: float) -> dict[str, Any]:
    return {
        "tool": "tandem heads train",
        "command": request.command,
        "seed": options.seed,
        "options": options.to_json(),
        "finished": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": request.device,
        "compute_dtype": "bfloat16 autocast, fp32 master weights" if dtype.use_bf16 else "float32",
        "compute_dtype_choice": {"reason": dtype.reason,
                                 "seconds": {k: round(v, 3) for k, v in (dtype.seconds or {}).items()}},
        "seconds": {"features_and_setup": round(features_seconds, 1),
                    "training": round(history["training_seconds"], 1), "this_run": round(total_seconds, 1)},
        "corpus": corpus.summary,
        "draft_vocab": {"size": cfg.draft_vocab_size, "label_coverage": round(coverage(label_counts, d2t), 4)},
        "accuracy": {"measured_on": "held-back sequences, against the target's own greedy labels",
                     "trained": trained, "untrained": untrained},
        "loss": history["loss"],
    }


def _check_out_dir(out: Path) -> None:
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not is_tandem_layout(out))):
        raise InvalidRequestError(f"--out {out} exists and holds something other than heads: choose another directory")


def _write_heads(module: Heads, out: Path) -> None:
    """Write the heads beside ``out`` and rename them into place: there whole, or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    save_heads(module.to("cpu"), partial)
    if out.exists():
        old = out.parent / f".{out.name}.old"
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        shutil.rmtree(old)
    partial.rename(out)
