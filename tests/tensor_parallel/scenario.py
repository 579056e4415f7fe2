"""One fixed workload, run by a test in a process of its own as rank 0 of N (or alone, as one rank).

It records what a test compares between one rank and N: the logits of a prefill, a
batched decode step and a verify; the logits after a rollback next to those of a
sequence that never saw the rolled-back tokens; and greedy tokens through the
target worker's own engine (``TargetEngine``: Prefill, then Verify rounds whose
drafts are partly wrong, so its KV rollback runs too).
"""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.config import EngineConfig
from tandem.engine import ForwardItem
from tandem.parallel.engine import load_engine
from tandem.sampling import SamplingParams
from target_worker.engine import PrefillCall, ReleaseCall, TargetEngine, VerifyCall

PROMPT_A = [5, 17, 33, 8, 61, 2, 40, 12, 9, 77, 3]
PROMPT_B = [11, 4, 90, 23, 56]


def run(model_dir: Path, tensor_parallel_size: int, dtype: str, out_path: Path, greedy_tokens: int = 24,
        prompts: list[list[int]] | None = None) -> None:
    """Record the workload into ``out_path`` (``greedy``: one token list per prompt, ``PROMPT_A`` by default)."""
    torch.manual_seed(0)
    cfg = EngineConfig(model_dir, dtype=dtype, block_size=4, kv_cache_tokens=2048, num_threads=1,
                       tensor_parallel_size=tensor_parallel_size)
    engine = load_engine(cfg)
    try:
        out = _record(engine, greedy_tokens, prompts or [PROMPT_A])
    finally:
        engine.close()
    torch.save(out, out_path)


def _record(engine, greedy_tokens: int, prompts: list[list[int]]) -> dict:
    out: dict = {}
    prefill = engine.forward([ForwardItem("a", PROMPT_A, len(PROMPT_A)), ForwardItem("b", PROMPT_B, 2)])
    out["prefill"] = torch.cat(prefill)
    decode = engine.forward([ForwardItem("a", [7]), ForwardItem("b", [8])])
    out["decode"] = torch.cat(decode)
    verify = engine.forward([ForwardItem("a", [1, 2, 3, 4], 4)])  # a "verify" of 3 drafts, then 2 rejected
    out["verify"] = verify[0]
    engine.rollback("a", len(PROMPT_A) + 1 + 2)
    after = engine.forward([ForwardItem("a", [50, 51], 2)])
    fresh = engine.forward([ForwardItem("c", [*PROMPT_A, 7, 1, 2, 50, 51], 2)])
    out["after_rollback"], out["fresh"] = after[0], fresh[0]
    for seq in ("a", "b", "c"):
        engine.release(seq)

    target = TargetEngine(engine)
    out["greedy"] = [_greedy(target, prompt, greedy_tokens) for prompt in prompts]
    return out


def _greedy(target: TargetEngine, prompt: list[int], num_tokens: int) -> list[int]:
    [first] = target.run_batch([PrefillCall("g", list(prompt), SamplingParams())])
    tokens = [first]
    while len(tokens) < num_tokens:
        history = target.sequences["g"].history
        drafts = [tokens[-1], 3, tokens[-1]]  # mostly wrong: exercises rollback of rejected KV
        [verdict] = target.run_batch([VerifyCall("g", len(history), drafts, [])])
        tokens += [*drafts[: verdict.num_accepted], verdict.next_token]
    target.run_batch([ReleaseCall("g")])
    return tokens[:num_tokens]
