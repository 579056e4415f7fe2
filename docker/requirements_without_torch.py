"""Print the runtime requirements of a Tandem wheel, less the ones that bring torch.

The coordinator holds no weights and imports no torch (tests/coordinator/test_no_torch.py), so
its image installs the wheel with ``--no-deps`` plus the requirements this prints. They come
from the wheel's own metadata, so they follow pyproject.toml without a second list to keep in
step; only the names below are left out. An extra cannot do this (extras only add), and moving
torch out of the default dependencies would change what ``pip install tandem`` means for
everyone else.

An optional group the coordinator image wants too (``tracing``: OpenTelemetry) is named with
``--extra``; its requirements are printed without their marker.

Usage: python requirements_without_torch.py [--extra NAME]... dist/tandem-*.whl > requirements.txt
Standard library only: it runs in the image's build stage before anything is installed.
"""

from __future__ import annotations

import re
import sys
import zipfile
from email.parser import Parser

# torch itself, and accelerate, which requires torch. transformers, safetensors and tokenizers
# stay: the coordinator loads the target's tokenizer through transformers (tokenizers-only mode).
WORKER_ONLY = frozenset({"torch", "accelerate"})

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")
_EXTRA = re.compile(r"""extra\s*==\s*["']([^"']+)["']""")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def coordinator_requirements(wheel: str, extras: frozenset[str] = frozenset()) -> list[str]:
    """The wheel's runtime requirements less torch's, with those of the optional groups named in ``extras``."""
    with zipfile.ZipFile(wheel) as z:
        metadata = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        if len(metadata) != 1:
            raise SystemExit(f"{wheel}: expected one .dist-info/METADATA, found {len(metadata)}")
        message = Parser().parsestr(z.read(metadata[0]).decode("utf-8"))
    kept = []
    for requirement in message.get_all("Requires-Dist") or []:
        spec, _, marker = requirement.partition(";")
        if "extra" in marker:  # optional groups (dev, bench, gpu) are not runtime requirements, unless asked for
            group = _EXTRA.search(marker)
            if group is None or canonical(group.group(1)) not in {canonical(e) for e in extras}:
                continue
            requirement = spec
        match = _NAME.match(spec)
        if match is None:
            raise SystemExit(f"{wheel}: cannot read the requirement {requirement!r}")
        if canonical(match.group(1)) not in WORKER_ONLY:
            kept.append(requirement.strip())
    return kept


def main(argv: list[str]) -> int:
    args, extras = argv[1:], set()
    while len(args) > 2 and args[0] == "--extra":
        extras.add(args[1])
        args = args[2:]
    if len(args) != 1 or not args[0].endswith(".whl"):
        print(__doc__.strip().splitlines()[-2], file=sys.stderr)
        return 2
    print("\n".join(coordinator_requirements(args[0], frozenset(extras))))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
