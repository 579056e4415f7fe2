"""Generate the gRPC stubs from proto/ (never edited by hand, never committed).

``make setup`` runs this once (``python -m tandem.proto_build``); importing
``tandem.v1`` also runs it when the stubs are missing or older than their
.proto files, so a fresh editable checkout works without a separate step.
The stubs land in ``tandem/v1/`` because the protos declare ``package
tandem.v1``.
"""

from __future__ import annotations

import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent  # .../tandem
REPO_ROOT = PACKAGE_DIR.parent
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILES = ("common", "draft", "target", "generation")


def stale() -> bool:
    """Whether any stub is missing or older than its .proto."""
    for name in PROTO_FILES:
        proto = PROTO_ROOT / "tandem" / "v1" / f"{name}.proto"
        stub = PACKAGE_DIR / "v1" / f"{name}_pb2.py"
        if not stub.exists() or (proto.exists() and proto.stat().st_mtime > stub.stat().st_mtime):
            return True
    return False


def generate() -> None:
    from grpc_tools import protoc
    import grpc_tools

    if not PROTO_ROOT.is_dir():
        raise RuntimeError(f"cannot generate gRPC stubs: {PROTO_ROOT} not found (install from a source checkout)")
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={REPO_ROOT}",
        f"--grpc_python_out={REPO_ROOT}",
        f"--pyi_out={REPO_ROOT}",
        *(str(PROTO_ROOT / "tandem" / "v1" / f"{name}.proto") for name in PROTO_FILES),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed to generate the gRPC stubs (see its messages above)")


def ensure() -> None:
    if stale():
        generate()


if __name__ == "__main__":
    generate()
    print(f"generated stubs in {PACKAGE_DIR / 'v1'}", file=sys.stderr)
