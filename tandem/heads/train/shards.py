"""Reading feature shards back as training batches, in an order fixed by the seed and the step.

Step ``s`` always gets the same sequences (``BatchPlan.batch``): epoch ``s // per_epoch``
visits the train shards in a seeded order and each shard's sequences in a seeded order,
so a resumed run needs no saved data-loader state and reads at most two shards at a time
(memory stays bounded however large the corpus).
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from tandem.errors import InvalidRequestError
from tandem.heads.train.features import INDEX_FILE, NO_LABEL


@dataclass(frozen=True, slots=True)
class Shard:
    path: Path
    split: str
    lengths: tuple[int, ...]

    @property
    def offsets(self) -> list[int]:  # where each sequence starts in the shard's flat tensors
        out, total = [], 0
        for n in self.lengths:
            out.append(total)
            total += n
        return out


@dataclass(slots=True)
class Batch:
    tokens: torch.Tensor  # [B, N] int64, target ids, 0 past a sequence's end
    labels: torch.Tensor  # [B, N] int64, the target's argmax at each position; NO_LABEL past the end and in prompts
    features: torch.Tensor  # [B, N, F] bf16, zeros past the end
    lengths: torch.Tensor  # [B] int64

    def to(self, device: torch.device) -> Batch:
        return Batch(self.tokens.to(device), self.labels.to(device), self.features.to(device), self.lengths.to(device))

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


class FeatureShards:
    """The shards of one features directory, by split, with a small cache of loaded ones."""

    def __init__(self, directory: Path, cached: int = 2) -> None:
        try:
            index = json.loads((directory / INDEX_FILE).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidRequestError(f"no complete features in {directory}: {exc}") from None
        self.directory = directory
        self.streams = tuple(index["streams"])
        shards = [Shard(directory / s["file"], s["split"], tuple(s["lengths"])) for s in index["shards"]]
        self.train = [s for s in shards if s.split == "train"]
        self.held_back = [s for s in shards if s.split == "held_back"]
        self._cached = cached
        self._loaded: OrderedDict[Path, dict[str, torch.Tensor]] = OrderedDict()

    def load(self, shard: Shard) -> dict[str, torch.Tensor]:
        if shard.path in self._loaded:
            self._loaded.move_to_end(shard.path)
            return self._loaded[shard.path]
        tensors = load_file(str(shard.path))
        self._loaded[shard.path] = tensors
        while len(self._loaded) > self._cached:
            self._loaded.popitem(last=False)
        return tensors

    def counts(self, name: str, vocab_size: int) -> torch.Tensor:  # [vocab] int64
        """How often each id occurs as ``labels`` (those to learn) or ``tokens`` in the train split."""
        total = torch.zeros(vocab_size, dtype=torch.int64)
        for shard in self.train:
            with safe_open(str(shard.path), framework="pt") as f:  # that tensor only, not the features
                ids = f.get_tensor(name).long()
            ids = ids[ids >= 0]  # labels of prompt positions are NO_LABEL
            total += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
        return total

    def batch(self, refs: Sequence[tuple[int, int]], split: str = "train") -> Batch:
        """The sequences ``(shard index, sequence index)`` of a split, padded to the longest."""
        shards = self.train if split == "train" else self.held_back
        pieces = []
        for shard_index, seq_index in refs:
            shard = shards[shard_index]
            tensors = self.load(shard)
            start, length = shard.offsets[seq_index], shard.lengths[seq_index]
            pieces.append({k: tensors[k][start: start + length] for k in ("tokens", "labels", "features")})
        width = max(p["tokens"].shape[0] for p in pieces)
        feature_size = pieces[0]["features"].shape[1]
        tokens = torch.zeros(len(pieces), width, dtype=torch.int64)
        labels = torch.full((len(pieces), width), NO_LABEL, dtype=torch.int64)
        features = torch.zeros(len(pieces), width, feature_size, dtype=torch.bfloat16)
        for row, piece in enumerate(pieces):
            n = piece["tokens"].shape[0]
            tokens[row, :n] = piece["tokens"]
            labels[row, :n] = piece["labels"]
            features[row, :n] = piece["features"]
        lengths = torch.tensor([p["tokens"].shape[0] for p in pieces], dtype=torch.int64)
        return Batch(tokens, labels, features, lengths)

    def held_back_batches(self, batch_size: int) -> Iterator[Batch]:
        refs = [(i, j) for i, shard in enumerate(self.held_back) for j in range(len(shard.lengths))]
        for start in range(0, len(refs), batch_size):
            yield self.batch(refs[start: start + batch_size], "held_back")


class BatchPlan:
    """Which train sequences step ``s`` reads: fixed by the seed, whatever ran before."""

    def __init__(self, shards: Sequence[Shard], batch_size: int, seed: int) -> None:
        self.sizes = [len(s.lengths) for s in shards]
        total = sum(self.sizes)
        if total == 0:
            raise InvalidRequestError("no training sequences: the corpus is too small")
        self.batch_size = min(batch_size, total)
        self.per_epoch = total // self.batch_size
        self.seed = seed
        self._epoch: tuple[int, list[tuple[int, int]]] | None = None

    def order(self, epoch: int) -> list[tuple[int, int]]:
        if self._epoch is None or self._epoch[0] != epoch:
            rng = random.Random(f"heads-train:{self.seed}:{epoch}")
            shard_order = list(range(len(self.sizes)))
            rng.shuffle(shard_order)
            refs = []
            for shard in shard_order:
                seqs = list(range(self.sizes[shard]))
                rng.shuffle(seqs)
                refs.extend((shard, s) for s in seqs)
            self._epoch = (epoch, refs)
        return self._epoch[1]

    def batch(self, step: int) -> list[tuple[int, int]]:
        epoch, index = divmod(step, self.per_epoch)
        start = index * self.batch_size
        return self.order(epoch)[start: start + self.batch_size]
