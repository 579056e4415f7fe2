"""Run the target once over the corpus and keep, per token, what the heads learn from.

Per token ``t`` of a sequence: the input token ``x_t``, the target's own label ``y_t``
(the argmax of its logits at ``t``: what this target would say next, so the heads learn
the target rather than the text; ``NO_LABEL`` before the sequence's ``learn_from``, in
a conversation's prompt) and the feature the heads read (``FeatureSpec``; bf16).
The forward is Tandem's engine (``ModelEngine.forward_with_features``), so the features
have exactly the numerics the heads will see when serving.

Shards (``train-00000.safetensors``, ``held_back-00000.safetensors``) hold whole
sequences, about ``SHARD_TOKENS`` tokens each: ``tokens`` ``[N]`` int32, ``labels``
``[N]`` int32, ``features`` ``[N, F]`` bf16 and ``lengths`` ``[S]`` int32 (the sequences'
lengths, in order). Each is written under a temporary name and renamed when complete,
so a run that stops keeps every finished shard and the next one skips them.
``index.json``, written last, lists them.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from tandem.engine import FeatureSpec, ForwardItem, ModelEngine
from tandem.heads.train.corpus import Corpus
from tandem.model_convert import SILENT, Progress

SHARD_TOKENS = 16384  # ~150 MB of EAGLE features on a 1536-wide target: bounded memory either side
SPLITS = ("train", "held_back")
NO_LABEL = -1  # the label of a position the heads do not learn: a prompt's (and, in a batch, padding)
INDEX_FILE = "index.json"


@dataclass(frozen=True, slots=True)
class ShardPlan:
    split: str
    number: int
    sequences: tuple[int, ...]  # indices into the split's sequences

    @property
    def file_name(self) -> str:
        return f"{self.split}-{self.number:05d}.safetensors"


def features_key(corpus: Corpus, fingerprint: str, spec: FeatureSpec) -> str:
    """Names one set of features: the exact sequences, the target, the streams."""
    text = f"{corpus.digest()}|{fingerprint}|{','.join(map(str, spec.streams))}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def plan_shards(split: str, sequences: Sequence[Sequence[int]], shard_tokens: int = SHARD_TOKENS) -> list[ShardPlan]:
    """Consecutive sequences grouped until a group holds ``shard_tokens`` tokens."""
    plans: list[ShardPlan] = []
    group: list[int] = []
    held = 0
    for index, seq in enumerate(sequences):
        group.append(index)
        held += len(seq)
        if held >= shard_tokens:
            plans.append(ShardPlan(split, len(plans), tuple(group)))
            group, held = [], 0
    if group:
        plans.append(ShardPlan(split, len(plans), tuple(group)))
    return plans


def extract_features(
    engine: ModelEngine,
    spec: FeatureSpec,
    corpus: Corpus,
    directory: Path,
    *,
    seqs_per_forward: int = 2,
    shard_tokens: int = SHARD_TOKENS,
    progress: Progress = SILENT,
) -> Path:
    """Write every shard ``directory`` lacks, then ``index.json``; returns ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    splits = {"train": corpus.train, "held_back": corpus.held_back}
    learn_from = {"train": corpus.train_learn_from, "held_back": corpus.held_back_learn_from}
    plans = [plan for split in SPLITS for plan in plan_shards(split, splits[split], shard_tokens)]
    missing = [plan for plan in plans if not (directory / plan.file_name).is_file()]
    progress.stage("features", sum(len(splits[p.split][i]) for p in missing for i in p.sequences), "token")
    for plan in missing:
        sequences = [splits[plan.split][i] for i in plan.sequences]
        starts = [learn_from[plan.split][i] for i in plan.sequences]
        tensors = _run_shard(engine, spec, sequences, starts, seqs_per_forward, progress)
        partial = directory / f".{plan.file_name}.partial"
        save_file(tensors, str(partial))
        os.replace(partial, directory / plan.file_name)
    index = {
        "streams": list(spec.streams),
        "shards": [{"file": p.file_name, "split": p.split,
                    "lengths": [len(splits[p.split][i]) for i in p.sequences]} for p in plans],
    }
    (directory / INDEX_FILE).write_text(json.dumps(index) + "\n")
    return directory


def _run_shard(engine: ModelEngine, spec: FeatureSpec, sequences: list[list[int]], learn_from: list[int],
               per_forward: int, progress: Progress) -> dict[str, torch.Tensor]:
    tokens, labels, features = [], [], []
    for start in range(0, len(sequences), per_forward):
        group = sequences[start: start + per_forward]
        group_learn_from = learn_from[start: start + per_forward]
        items = [ForwardItem(("heads-train", i), seq, num_logits=len(seq), features=True)
                 for i, seq in enumerate(group)]
        try:
            logits, feats = engine.forward_with_features(items, spec)  # [n, vocab] float32, [n, F] per item
        finally:
            for item in items:
                if engine.kv_cache.has_sequence(item.seq_id):
                    engine.release(item.seq_id)
        for seq, first, item_logits, item_feats in zip(group, group_learn_from, logits, feats):
            tokens.append(torch.tensor(seq, dtype=torch.int32))
            seq_labels = item_logits.argmax(dim=-1).to("cpu", torch.int32)  # [n]
            seq_labels[:first] = NO_LABEL
            labels.append(seq_labels)
            features.append(item_feats.to("cpu", torch.bfloat16))  # type: ignore[union-attr]
        progress.advance(sum(map(len, group)))
    return {
        "tokens": torch.cat(tokens),  # [N] int32
        "labels": torch.cat(labels),  # [N] int32, NO_LABEL in prompts
        "features": torch.cat(features).contiguous(),  # [N, F] bf16
        "lengths": torch.tensor([len(s) for s in sequences], dtype=torch.int32),  # [S]
    }
