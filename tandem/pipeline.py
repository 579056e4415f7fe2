"""In-process assembly: a target engine, its tokenizer, and the proposer a method asks for.

``SpecConfig`` is validated before anything is loaded, so bad flags fail in
milliseconds; the draft's tokenizer is compared with the target's before the
draft's weights are read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.config import EngineConfig
from tandem.engine import ModelEngine
from tandem.errors import InvalidRequestError
from tandem.spec.adaptive import MAX_K, CostModel
from tandem.spec.draft_model import DraftModelProposer, early_exit_proposer
from tandem.spec.generator import SpeculativeGenerator
from tandem.spec.hybrid import HybridProposer
from tandem.spec.ngram import NgramProposer
from tandem.spec.proposal import Proposer
from tandem.tokenizer import load_tokenizer, stop_token_ids, tokenizer_fingerprint

METHODS = ("none", "draft", "ngram", "hybrid", "early-exit", "auto")


@dataclass(slots=True)
class SpecConfig:
    """Which proposer, and how many tokens it may draft per round."""

    method: str = "auto"  # auto: the draft model when one is given, else n-gram lookup
    k: int = 4
    adaptive_k: bool = True
    early_exit_layers: int | None = None  # default: a quarter of the target's layers
    ngram_min: int = 1
    ngram_max: int = 4

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise InvalidRequestError(f"unknown method {self.method!r}; choose one of {', '.join(METHODS)}")
        if not 0 <= self.k <= MAX_K:
            raise InvalidRequestError(f"k (draft tokens per round) must be in 0..{MAX_K}, got {self.k}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise InvalidRequestError(f"n-gram sizes need 1 <= min <= max, got {self.ngram_min}..{self.ngram_max}")
        if self.early_exit_layers is not None and self.early_exit_layers < 1:
            raise InvalidRequestError(f"early-exit layers must be >= 1, got {self.early_exit_layers}")

    def resolved_method(self, has_draft: bool) -> str:
        if self.method == "auto":
            return "draft" if has_draft else "ngram"
        if self.method in ("draft", "hybrid") and not has_draft:
            raise InvalidRequestError(f"method {self.method!r} needs a draft model (--draft MODEL)")
        return self.method


@dataclass(slots=True)
class LocalPipeline:
    """Everything needed to generate in process."""

    target: ModelEngine
    tokenizer: Any
    stop_ids: frozenset[int]
    proposer: Proposer | None
    method: str

    def generator(self, costs: CostModel | None = None) -> SpeculativeGenerator:
        return SpeculativeGenerator(self.target, self.proposer, costs)

    @classmethod
    def load(
        cls,
        target_cfg: EngineConfig,
        spec: SpecConfig,
        draft_cfg: EngineConfig | None = None,
    ) -> LocalPipeline:
        method = spec.resolved_method(draft_cfg is not None)
        tokenizer = load_tokenizer(target_cfg.model_dir)
        if method in ("draft", "hybrid"):
            assert draft_cfg is not None
            check_same_tokenizer(tokenizer, target_cfg.model_dir, draft_cfg.model_dir)
        target = ModelEngine.load(target_cfg)
        target.warmup()
        proposer = build_proposer(method, spec, target, draft_cfg)
        return cls(target, tokenizer, stop_token_ids(target_cfg.model_dir, tokenizer, target.config), proposer, method)


def check_same_tokenizer(target_tokenizer: Any, target_dir: Path, draft_dir: Path) -> None:
    draft_tokenizer = load_tokenizer(draft_dir)
    if tokenizer_fingerprint(draft_tokenizer) != tokenizer_fingerprint(target_tokenizer):
        raise InvalidRequestError(
            f"the draft model's tokenizer ({draft_dir}) differs from the target's ({target_dir}): "
            "speculative decoding needs both to map text to the same token ids"
        )


def build_proposer(
    method: str, spec: SpecConfig, target: ModelEngine, draft_cfg: EngineConfig | None
) -> Proposer | None:
    if method == "none" or spec.k == 0:
        return None
    if method == "ngram":
        return NgramProposer(spec.ngram_min, spec.ngram_max)
    if method == "early-exit":
        layers = spec.early_exit_layers or max(1, target.config.num_layers // 4)
        proposer = early_exit_proposer(target, layers)
        proposer.engine.warmup()
        return proposer
    assert draft_cfg is not None
    draft = ModelEngine.load(draft_cfg)
    draft.warmup()
    if draft.config.vocab_size != target.config.vocab_size:
        raise InvalidRequestError(
            f"draft vocabulary ({draft.config.vocab_size}) differs from the target's ({target.config.vocab_size})"
        )
    if method == "hybrid":
        return HybridProposer(DraftModelProposer(draft), min_match=min(3, spec.ngram_max), max_n=spec.ngram_max)
    return DraftModelProposer(draft)
