"""What "identical" means with prefix caching and chunked prefill on: greedy output against both off.

In one process, target-only greedy decoding (the output every speculation method reproduces) of
prompts that share a long preamble (a system prompt, then different Spec-Bench questions, through
the chat template), three ways:

- off:     prefix caching off, every prompt computed whole, one at a time;
- cached:  prefix caching on, one prompt at a time: every prompt after the first starts on the
           preamble's cached blocks and computes only its question (its KV rows computed in another
           run, with another attention shape, than in ``off``);
- chunked: prefix caching off, --chunk tokens per chunk: each prompt arrives while another
           sequence is decoding on the target, so it is computed a chunk per batch step beside
           that sequence's rows (driven through TargetEngine.run_batch, as a worker's batcher does).

With --heads (Medusa or EAGLE heads of the target), two more ways, speculating with them:

- heads-cached:  prefix caching on, one prompt at a time: an EAGLE prompt starts on the blocks
                 both the target's cache and its head's hold;
- heads-chunked: as chunked, each prompt's sequence drafting with the heads (every round verifies
                 their proposal): its chunks go to the heads as they are computed.

Per prompt: whether its tokens equal ``off``'s, and where they first differ. fp32 is expected to be
identical on these prompts (the rule the tests hold, tests/target_worker/test_prefix_and_chunks.py);
bf16 is what this measures. Writes prefix_exactness.{json,md} into --out.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/prefix_exactness.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

from benchmarks.common import (  # noqa: E402
    DEFAULT_RESULTS_DIR,
    DEFAULT_SPEC_BENCH,
    load_spec_bench,
    machine_info,
    machine_line,
    markdown_table,
    write_json,
    write_markdown,
)

NAME = "prefix_exactness"
PREAMBLE = ("You are a careful assistant. Answer in plain prose, cite no sources you cannot name, keep code in "
            "fenced blocks, and say when you are unsure. ")
COLUMNS = ["dtype", "way", "prompts", "reused_tokens", "identical", "identical_tokens", "first_difference"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="prefix_exactness.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="qwen-coder-1.5b", help="target model (default: %(default)s)")
    p.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"], choices=("bfloat16", "float32"))
    p.add_argument("--prompts", type=int, default=6, help="questions after the shared preamble (default: %(default)s)")
    p.add_argument("--preamble-repeats", type=int, default=12,
                   help="the preamble sentence this many times: the shared prefix (default: %(default)s, ~350 tokens)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--chunk", type=int, default=5,
                   help="prefill chunk for the chunked way (default: %(default)s, about what auto picks on a "
                        "2-core CPU for Qwen2.5-Coder-1.5B)")
    p.add_argument("--heads", default=None, metavar="PATH|NAME",
                   help="speculation heads of the target: adds the heads-cached and heads-chunked ways")
    p.add_argument("--cache-dir", default=None, help="model cache root (default: $TANDEM_HOME or ~/.cache/tandem)")
    p.add_argument("--out", type=Path, default=DEFAULT_RESULTS_DIR)
    return p


def compare(reference: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    firsts = [next((i for i, (a, b) in enumerate(zip(r, o)) if a != b), None) for r, o in zip(reference, other)]
    same = sum(a == b for r, o in zip(reference, other) for a, b in zip(r, o))
    return {"prompts": len(reference), "identical": sum(r == o for r, o in zip(reference, other)),
            "identical_tokens": f"{same}/{sum(len(r) for r in reference)}",
            "first_difference": ",".join("-" if f is None else str(f) for f in firsts)}


def chunked_beside_a_stream(model_dir: Path, dtype: str, prompts: list[list[int]], args: argparse.Namespace,
                            heads: Path | None = None) -> tuple[list[list[int]], int]:
    """Greedy decoding of each prompt, prefilled in chunks while another sequence decodes (see the module doc);
    with ``heads``, each prompt's sequence drafts with them, every round verifying their proposal."""
    from tandem.config import EngineConfig
    from tandem.engine import ModelEngine
    from tandem.heads.serving import load_drafter
    from tandem.rpc.batcher import Unfinished
    from tandem.sampling import SamplingParams
    from target_worker.engine import PrefillCall, Proposed, ReleaseCall, TargetEngine, VerifyCall

    engine = ModelEngine.load(EngineConfig(model_dir, dtype=dtype, prefix_caching=False))
    drafter = None if heads is None else load_drafter(heads, engine)
    target = TargetEngine(engine, drafter=drafter, prefill_chunk_tokens=args.chunk)
    greedy = SamplingParams()
    nodes = 0 if drafter is None else 8  # proposal nodes a round

    def step(calls: list) -> list:
        results = target.run_batch(calls)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise failed[0]
        return results

    outputs, chunked_steps = [], 0
    for i, prompt in enumerate(prompts):
        step([PrefillCall("stream", prompts[(i + 1) % len(prompts)][:32], greedy)])  # a sequence that runs
        call, result = PrefillCall("p", prompt, greedy, propose=nodes), Unfinished()
        while isinstance(result, Unfinished):
            result, _ = step([call, VerifyCall("stream", len(target.sequences["stream"].history), [], [])])
            chunked_steps += 1
        history = target.sequences["p"].history
        while len(history) - len(prompt) < args.max_new_tokens:
            proposal = result.proposal if isinstance(result, Proposed) else None
            drafts, parents = (proposal.tokens, proposal.parents) if proposal is not None else ([], [])
            (result,) = step([VerifyCall("p", len(history), drafts, [], parents, propose=nodes)])
        step([ReleaseCall("p"), ReleaseCall("stream")])
        outputs.append(history[len(prompt):len(prompt) + args.max_new_tokens])
    if chunked_steps <= len(prompts):
        raise SystemExit(f"no prompt was chunked ({chunked_steps} steps for {len(prompts)} prompts): lower --chunk")
    return outputs, 0


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from benchmarks.runners import resolve_model_dir
    from tandem.config import EngineConfig
    from tandem.engine import ModelEngine
    from tandem.inprocess import GenerationRequest, SpeculativeGenerator
    from tandem.tokenizer import encode_messages, load_tokenizer

    model_dir = resolve_model_dir(args.target, args.cache_dir)
    tokenizer = load_tokenizer(model_dir)
    questions = [p.text for p in load_spec_bench(DEFAULT_SPEC_BENCH)][: args.prompts]
    system = PREAMBLE * args.preamble_repeats
    prompts = [encode_messages(tokenizer, [{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    heads_dir = None
    if args.heads is not None:
        from tandem import model_store
        from tandem.heads.locate import resolve_heads

        heads_dir = resolve_heads(args.heads, model_store.cache_root_from(args.cache_dir, os.environ))
    rows = []
    for dtype in args.dtypes:
        def generate(caching: bool, together: bool, chunk: int = 0, dtype: str = dtype,
                     heads: Path | None = None) -> tuple[list[list[int]], int]:
            """Each prompt's tokens, and the prompt tokens taken from the cache (with ``heads``: speculating)."""
            from tandem.heads.serving import load_drafter
            from tandem.spec.options import SpecOptions

            engine = ModelEngine.load(EngineConfig(model_dir, dtype=dtype, prefix_caching=caching))
            drafter = None if heads is None else load_drafter(heads, engine)
            options = None if drafter is None else SpecOptions(drafter.kind, 4)
            gen = SpeculativeGenerator(engine, options=options, heads=drafter, prefill_chunk_tokens=chunk)
            requests = [GenerationRequest(p, args.max_new_tokens) for p in prompts]
            results = gen.generate(requests) if together else [gen.generate([r])[0] for r in requests]
            return [r.token_ids for r in results], sum(r.stats.prompt_tokens_reused for r in results)

        off, _ = generate(caching=False, together=False)
        ways = [("cached", lambda: generate(caching=True, together=False)),
                ("chunked", lambda dtype=dtype: chunked_beside_a_stream(model_dir, dtype, prompts, args))]
        if heads_dir is not None:
            ways += [("heads-cached", lambda: generate(caching=True, together=False, heads=heads_dir)),
                     ("heads-chunked", lambda dtype=dtype: chunked_beside_a_stream(model_dir, dtype, prompts, args,
                                                                                    heads_dir))]
        for way, ran in ways:
            tokens, reused = ran()
            rows.append({"dtype": dtype, "way": way, "reused_tokens": reused, **compare(off, tokens)})
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    info = machine_info()
    rows = run(args)
    payload = {"machine": info, "settings": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    write_json(args.out, NAME, payload)
    body = "\n".join([machine_line(info), "", markdown_table(rows, COLUMNS), "",
                      "first_difference: per prompt, the first token index that differs from `off` (- : none)."])
    write_markdown(args.out, NAME, "Greedy output with prefix caching and chunked prefill, against both off", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
