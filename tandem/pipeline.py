"""In-process assembly: a target engine, its tokenizer, and the draft engine a method asks for.

Options are validated before anything is loaded, so bad flags fail in
milliseconds; the draft's tokenizer is compared with the target's before the
draft's weights are read.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from draft_worker.engine import early_exit_engine
from tandem.config import EngineConfig
from tandem.engine import ModelEngine
from tandem.errors import InvalidRequestError
from tandem.heads.drafters import HeadDrafter
from tandem.heads.serving import load_drafter
from tandem.inprocess import SpeculativeGenerator
from tandem.spec.adaptive import CostModel
from tandem.spec.options import SpecOptions, heads_fallback, resolve_method
from tandem.structured_output import StructuredOutput
from tandem.tokenizer import check_same_tokenizer, load_tokenizer, stop_token_ids


@dataclass(slots=True)
class LocalPipeline:
    """Everything needed to generate in process."""

    target: ModelEngine
    draft: ModelEngine | None  # the draft model, or the target's first layers for early-exit
    tokenizer: Any
    stop_ids: frozenset[int]
    options: SpecOptions
    heads: HeadDrafter | None = None  # the target's speculation heads (methods medusa, eagle)
    structured: StructuredOutput | None = None  # the target's tokenizer for llguidance (response formats)

    @property
    def method(self) -> str:
        return self.options.method

    def generator(self, costs: CostModel | None = None, options: SpecOptions | None = None) -> SpeculativeGenerator:
        return SpeculativeGenerator(self.target, self.draft, options or self.options, costs, heads=self.heads,
                                    structured=self.structured)

    @classmethod
    def load(cls, target_cfg: EngineConfig, method: str, options: SpecOptions | None = None,
             draft_cfg: EngineConfig | None = None, early_exit_layers: int | None = None,
             heads_path: Path | None = None) -> LocalPipeline:
        """Load what ``method`` (``auto`` resolved here) needs; ``options`` gives k and the rest.

        ``heads_path``: the target's speculation heads (any known layout), loaded and checked against it."""
        target = heads = None
        if heads_path is not None:  # the heads' kind decides what auto means: load them first
            target = ModelEngine.load(target_cfg)
            heads = load_drafter(heads_path, target)
        requested = method
        method = resolve_method(method, draft_cfg is not None, heads=heads.kind if heads is not None else "")
        base = options or SpecOptions("none")
        # auto with heads and a draft both there (or options already resolved from auto so): hybrid rounds while
        # the heads do not pay
        chosen_as = "auto" if base.heads_fallback == "hybrid" else requested
        options = dataclasses.replace(base, method=method,
                                      heads_fallback=heads_fallback(chosen_as, method, draft_cfg is not None))
        if early_exit_layers is not None and early_exit_layers < 1:
            raise InvalidRequestError(f"early-exit layers must be >= 1, got {early_exit_layers}")
        tokenizer = load_tokenizer(target_cfg.model_dir)
        if method in ("draft", "hybrid") or options.draft_between_heads:
            assert draft_cfg is not None
            check_same_tokenizer(tokenizer, target_cfg.model_dir, draft_cfg.model_dir)
        target = target or ModelEngine.load(target_cfg)
        target.warmup()
        draft = None
        if options.uses_draft:
            if method == "early-exit":
                draft = early_exit_engine(target, early_exit_layers or max(1, target.config.num_layers // 4))
            else:
                assert draft_cfg is not None
                draft = ModelEngine.load(draft_cfg)
            draft.warmup()
        return cls(target, draft, tokenizer, stop_token_ids(target_cfg.model_dir, tokenizer, target.config), options,
                   heads, StructuredOutput(target_cfg.model_dir, target.config))


