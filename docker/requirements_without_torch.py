"""Print the runtime requirements of a Tandem wheel, less the ones that bring torch.

The coordinator holds no weights and imports no torch (tests/coordinator/test_no_torch.py), so
its image installs the wheel with ``--no-deps`` plus the requirements this prints. They come
from the wheel's own metadata, so they follow pyproject.toml without a second list to keep in
step; only the names below are left out. An extra cannot do this (extras only add), and moving
torch out of the default dependencies would change what ``pip install tandem`` means for
everyone else.

Usage: python requirements_without_torch.py dist/tandem-*.whl > requirements.txt
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


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def coordinator_requirements(wheel: str) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        metadata = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        if len(metadata) != 1:
            raise SystemExit(f"{wheel}: expected one .dist-info/METADATA, found {len(metadata)}")
        message = Parser().parsestr(z.read(metadata[0]).decode("utf-8"))
    kept = []
    for requirement in message.get_all("Requires-Dist") or []:
        spec, _, marker = requirement.partition(";")
        if "extra" in marker:  # optional groups (dev, bench, gpu) are not runtime requirements
            continue
        match = _NAME.match(spec)
        if match is None:
            raise SystemExit(f"{wheel}: cannot read the requirement {requirement!r}")
        if canonical(match.group(1)) not in WORKER_ONLY:
            kept.append(requirement.strip())
    return kept


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].endswith(".whl"):
        print(__doc__.strip().splitlines()[-2], file=sys.stderr)
        return 2
    print("\n".join(coordinator_requirements(argv[1])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
