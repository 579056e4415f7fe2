"""Generate the gRPC stubs from proto/ (never edited by hand, never committed).

Stubs are made when the package is built: ``setup.py`` calls :func:`generate`
from its ``build_py`` step, into the wheel for ``pip install .`` and into the
source tree for ``pip install -e .`` (what ``make setup`` runs). Nothing
generates them at import time, so processes started together never race to
write them. After editing a .proto in a checkout, regenerate explicitly::

    python -m tandem.proto_build

The stubs land in ``tandem/v1/`` because the protos declare ``package
tandem.v1``. This module imports only the standard library at import time
(``setup.py`` loads it by path, before Tandem's dependencies exist).
"""

from __future__ import annotations

import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent  # .../tandem
REPO_ROOT = PACKAGE_DIR.parent
PROTO_ROOT = REPO_ROOT / "proto"
PROTO_FILES = ("common", "draft", "target", "generation")
STUB_SUFFIXES = ("_pb2.py", "_pb2_grpc.py")


def stub_names() -> list[str]:
    """File names of every generated Python stub, as they sit in ``tandem/v1/``."""
    return [f"{name}{suffix}" for name in PROTO_FILES for suffix in STUB_SUFFIXES]


def generated_files(out_root: Path) -> list[Path]:
    """Every file :func:`generate` writes under ``out_root`` (stubs and their .pyi)."""
    stub_dir = out_root / "tandem" / "v1"
    return [stub_dir / name for name in stub_names()] + [stub_dir / f"{name}_pb2.pyi" for name in PROTO_FILES]


def stale_stubs(stub_dir: Path = PACKAGE_DIR / "v1", proto_root: Path = PROTO_ROOT) -> list[str]:
    """Stubs in ``stub_dir`` that are missing, or older than their .proto when ``proto_root`` exists.

    An installed wheel has no proto/ beside it; there only missing files count.
    """
    result = []
    for name in PROTO_FILES:
        proto = proto_root / "tandem" / "v1" / f"{name}.proto"
        for suffix in STUB_SUFFIXES:
            stub = stub_dir / f"{name}{suffix}"
            if not stub.is_file() or (proto.is_file() and proto.stat().st_mtime > stub.stat().st_mtime):
                result.append(stub.name)
    return result


def generate(out_root: Path = REPO_ROOT, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Run protoc on ``proto_root/tandem/v1/*.proto``, writing ``out_root/tandem/v1/*_pb2*.py[i]``.

    Returns the files written (:func:`generated_files`). ``out_root`` is the directory that holds the
    ``tandem`` package: the checkout, or a build's staging directory.
    """
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError:
        raise RuntimeError(
            "generating the gRPC stubs needs grpcio-tools: pip install -e '.[dev]' (make setup-dev)"
        ) from None

    protos = [proto_root / "tandem" / "v1" / f"{name}.proto" for name in PROTO_FILES]
    missing = [str(p) for p in protos if not p.is_file()]
    if missing:
        raise RuntimeError(f"cannot generate gRPC stubs: {', '.join(missing)} not found (need a source checkout)")
    (out_root / "tandem" / "v1").mkdir(parents=True, exist_ok=True)
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--pyi_out={out_root}",
        *(str(p) for p in protos),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError("protoc failed to generate the gRPC stubs (see its messages above)")
    return generated_files(out_root)


if __name__ == "__main__":
    generate()
    print(f"generated stubs in {PACKAGE_DIR / 'v1'}", file=sys.stderr)
