"""`tandem demo`: the whole system for one prompt: start it, stream an answer, stop it.

Starts target and draft workers and a coordinator as local processes (as
`tandem up` does), sends the prompt through the public gRPC API, streams the
answer, prints the request's statistics, and shuts everything down.
"""

from __future__ import annotations

import argparse
import os
import sys

from tandem.cli.generate import DEFAULT_TARGET, resolve_or_prepare

DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="start the system locally, stream one answer, stop", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT, help="the prompt (default: a coding question)")
    p.add_argument("--target", default=DEFAULT_TARGET, help="target model (default: %(default)s)")
    p.add_argument("--draft", default="qwen-coder-0.5b", help="draft model (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--cache-dir", default=None)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tandem import model_store
    from tandem.client import TandemClient, build_request
    from tandem.cluster import ClusterSpec, LocalCluster

    root = model_store.cache_root_from(args.cache_dir, os.environ)
    for model in (args.target, args.draft):
        resolve_or_prepare(model, root)
    print("starting target worker, draft worker and coordinator...", file=sys.stderr)
    with LocalCluster(ClusterSpec(target=args.target, draft=args.draft, cache_dir=args.cache_dir)) as cluster:
        print(f"serving on {cluster.coordinator.address}; asking: {args.prompt}\n", file=sys.stderr)
        last = None
        with TandemClient(cluster.coordinator.address) as client:
            for chunk in client.stream(build_request(args.prompt, chat=True, max_new_tokens=args.max_new_tokens)):
                print(chunk.text, end="", flush=True)
                last = chunk
        print()
        if last is not None:
            s = last.stats
            print(f"\n[{s.generated_tokens} tokens at {s.tokens_per_s:.2f} tok/s, method {s.method}: "
                  f"{s.accepted}/{s.drafted} draft tokens accepted over {s.rounds} rounds, "
                  f"first token after {s.time_to_first_token_s:.2f}s]", file=sys.stderr)
    return 0
