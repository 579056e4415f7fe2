"""Target-only outputs, computed in process: what every "nothing lost" and "greedy identical" test compares with.

Session-scoped fixtures (tests/conftest.py) call these once per model and dtype, so a reference is
computed once per test run however many tests compare with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def target_only(model_dir: Path, prompts: Sequence[str | list[int]], *, dtype: str = "bfloat16",
                max_new_tokens: int = 40, chat: bool = True, ignore_eos: bool = False, sampling=None) -> dict:
    """Greedy target-only token ids for each prompt (text with the chat template, or token ids as given),
    keyed by the prompt (a tuple for token-id prompts); ``sampling``: other ``SamplingParams`` (penalties)."""
    from tandem.config import EngineConfig
    from tandem.engine import ModelEngine
    from tandem.inprocess import GenerationRequest, SpeculativeGenerator
    from tandem.tokenizer import encode_prompt, load_tokenizer, stop_token_ids

    tokenizer = load_tokenizer(model_dir)
    engine = ModelEngine.load(EngineConfig(model_dir, dtype=dtype, prefix_caching=False))  # the cache-off reference
    stops = frozenset() if ignore_eos else stop_token_ids(model_dir, tokenizer, engine.config)
    requests = [GenerationRequest(list(p) if not isinstance(p, str) else encode_prompt(tokenizer, p, chat=chat),
                                  max_new_tokens, stop_token_ids=stops, **({} if sampling is None else
                                                                            {"sampling": sampling}))
                for p in prompts]
    structured = None
    if sampling is not None and sampling.structured:
        from tandem.structured_output import StructuredOutput

        structured = StructuredOutput(model_dir, engine.config)
    results = SpeculativeGenerator(engine, structured=structured).generate(requests)
    return {(p if isinstance(p, str) else tuple(p)): r.token_ids for p, r in zip(prompts, results)}
