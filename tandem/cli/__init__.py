"""The `tandem` command: one subcommand per thing a person does.

Each subcommand lives in its own module with a ``register(subparsers)`` that
adds its parser and sets ``func``; flags and environment are read here, once.
"""

from __future__ import annotations

import argparse
import sys

from tandem.errors import TandemError


def build_parser() -> argparse.ArgumentParser:
    from tandem.cli import bench, demo, generate, heads, models, run_batch, scale, serve, up

    parser = argparse.ArgumentParser(
        prog="tandem",
        description="Tandem: speculative decoding with a draft model (or n-gram lookup) "
        "proposing tokens and a target model verifying them, output identical to the target alone.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    models.register(sub)
    heads.register(sub)
    generate.register(sub)
    run_batch.register(sub)
    serve.register(sub)
    up.register(sub)
    scale.register(sub)
    demo.register(sub)
    bench.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    if args.command == "bench":  # the benchmark parses its own flags (--help included)
        args.bench_args = [*extra, *args.bench_args]
    try:
        return int(args.func(args) or 0)
    except TandemError as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
