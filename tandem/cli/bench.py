"""`tandem bench`: the speculative-decoding benchmark (benchmarks/spec_bench.py) with its flags.

Needs a source checkout (the benchmarks live beside the package) and the
bench extras: `pip install -e '.[bench]'`. `tandem bench --help` shows the
benchmark's own flags.
"""

from __future__ import annotations

import argparse
import sys

from tandem.proto_build import REPO_ROOT


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run the side-by-side speculative decoding benchmark", add_help=False,
                       description=__doc__)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if not (REPO_ROOT / "benchmarks" / "spec_bench.py").is_file():
        print("tandem bench needs a source checkout with benchmarks/", file=sys.stderr)
        return 2
    sys.path.insert(0, str(REPO_ROOT))
    from benchmarks import spec_bench

    return int(spec_bench.main(args.bench_args) or 0)
