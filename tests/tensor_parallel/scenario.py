"""One fixed workload, run by a test in a process of its own as rank 0 of N (or alone, as one rank).

It records what a test compares between one rank and N: the logits of a prefill, a
batched decode step and a verify; the logits after a rollback next to those of a
sequence that never saw the rolled-back tokens; the logits of a speculation tree, and
after keeping one of its paths (its K/V moved on every rank) next to those of a
sequence fed just that path; greedy tokens through the
target worker's own engine (``TargetEngine``: Prefill, then batched Verify rounds whose
drafts are partly wrong, so its KV rollback runs too); and a prompt's own
log-probabilities (``prompt_logprobs``: every row's logits, gathered over ranks).
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
TREE = [-1, 0, 1, 0, 3, 4, 1]  # 0-1-2, 0-3-4-5, 1-6
TREE_TOKENS = [30, 31, 32, 40, 41, 42, 50]
KEPT_PATH = [0, 3, 4]  # rows 3 and 4 move to depths 1 and 2


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
    _record_tree(engine, out)
    for seq in ("a", "b", "c", "d"):
        engine.release(seq)

    target = TargetEngine(engine)
    out["greedy"] = _greedy(target, prompts, greedy_tokens)
    [scored] = target.run_batch([PrefillCall("s", PROMPT_A, SamplingParams(prompt_logprobs=2))])  # echo's scores
    out["prompt_scores"] = torch.tensor([s.logprob for s in scored.prompt_logprobs])
    out["prompt_top_ids"] = [s.top_ids for s in scored.prompt_logprobs]
    target.run_batch([ReleaseCall("s")])
    return out


def _record_tree(engine, out: dict) -> None:
    """A tree on "b" (PROMPT_B + [8] cached) batched with a decode step, one path kept, a step on;
    "d" is fed the same tokens as a chain."""
    base = engine.seq_len("b")
    tree, _ = engine.forward([ForwardItem("b", TREE_TOKENS, len(TREE), TREE), ForwardItem("c", [60])])
    out["tree"] = tree
    engine.keep_path("b", base, KEPT_PATH)
    out["after_keep_path"] = engine.forward([ForwardItem("b", [61], 1)])[0]
    engine.forward([ForwardItem("d", [*PROMPT_B, 8], 0)])
    engine.forward([ForwardItem("d", [TREE_TOKENS[r] for r in KEPT_PATH], 0)])
    out["chain_of_path"] = engine.forward([ForwardItem("d", [61], 1)])[0]


def _greedy(target: TargetEngine, prompts: list[list[int]], num_tokens: int) -> list[list[int]]:
    """Each prompt's first ``num_tokens`` greedy tokens; their Verify calls go in one batch per step, as a
    worker batches its requests (on real models this is most of the scenario's time: one step per token)."""
    tokens: dict[str, list[int]] = {}
    for i, prompt in enumerate(prompts):
        [first] = target.run_batch([PrefillCall(f"g{i}", list(prompt), SamplingParams())])
        tokens[f"g{i}"] = [first.next_token]
    while live := [seq for seq, done in tokens.items() if len(done) < num_tokens]:
        # mostly wrong drafts: exercises the rollback of rejected KV
        calls = [VerifyCall(seq, len(target.sequences[seq].history), [tokens[seq][-1], 3, tokens[seq][-1]], [])
                 for seq in live]
        for call, verdict in zip(calls, target.run_batch(calls)):
            tokens[call.seq_id] += [*call.draft_tokens[: verdict.num_accepted], verdict.next_token]
    target.run_batch([ReleaseCall(seq) for seq in tokens])
    return [done[:num_tokens] for done in tokens.values()]
