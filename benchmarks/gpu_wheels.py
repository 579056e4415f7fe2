"""Wheels a GPU machine without network lacks for the GPU check, fetched here into .whl/ (git-ignored).

A lent GPU machine has PyTorch with CUDA, transformers, numpy, scipy and tqdm, but no
network: what else Tandem imports on the check's path comes as wheels, at the versions
installed here (the ones the suite passes with), built for its Python. The generated gRPC
stubs (tandem/v1/*_pb2*.py, git-ignored too) travel as they are, made fresh here first.

Then, on the GPU machine, from a copy of this checkout that carries .whl and tandem/v1:

    bash benchmarks/gpu_check_device.sh

Measured without a GPU (a Python 3.12 environment holding only what such a machine's image
lists, transformers 5.17, grpcio 1.71, protobuf 5.29): without these wheels the coordinator
could not start (no redis package) and the stubs need protobuf >= the version that made them;
with them, `--device cpu --quick` passed every check. On an H200 (2026-12-04) these wheels, llguidance
among them since that run, were all the full check needed beside the image's packages.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from importlib import metadata
from pathlib import Path

_REPO_ROOT = Path(__file__).resolve().parents[1]
if str(_REPO_ROOT) not in sys.path:  # `python benchmarks/gpu_wheels.py` from anywhere
    sys.path.insert(0, str(_REPO_ROOT))

# Imported on the check's path (its worker and coordinator processes too) and absent from, or older on,
# the GPU machines' image: gRPC and the protobuf runtime the stubs were generated for, gRPC's health and
# reflection services (every Tandem server registers them), redis (the coordinator imports its client), and
# llguidance (a target worker's warm-up prepares structured output with it: without it the first GPU run's target
# worker exited while starting, 2026-12-04).
PACKAGES = ("grpcio", "protobuf", "grpcio-health-checking", "grpcio-reflection", "redis", "llguidance")
# Tandem's other dependencies (pyproject.toml) that the lent machines' image holds (its package list, 2026-11-17).
ON_THE_IMAGE = ("torch", "transformers", "safetensors", "accelerate", "tokenizers", "prometheus-client", "aiohttp",
                "tqdm")
# Dependencies the check never imports, so none travels: Kubernetes discovery and GGUF checkpoints load them lazily
# (the H200 run of 2026-12-04 passed every check without either).
NOT_ON_THE_CHECKS_PATH = ("kubernetes", "gguf")
# pip matches a platform tag exactly: llguidance's wheel is manylinux_2_31 (the image's glibc is newer: Ubuntu 24.04).
PLATFORMS = ("manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64")


def pins(packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """``name==version`` of each package as installed here."""
    try:
        return [f"{name}=={metadata.version(name)}" for name in packages]
    except metadata.PackageNotFoundError as exc:
        raise SystemExit(f"{exc.name} is not installed here: run `make setup` first") from None


def download_command(requirements: list[str], python_version: str, dest: Path) -> list[str]:
    """pip's command for binary wheels of exactly ``requirements`` for CPython ``python_version`` on x86-64 Linux."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    return [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
            "--python-version", python_version, "--implementation", "cp", *platforms, "-d", str(dest),
            *requirements]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--python-version", default="3.12", help="the GPU machine's Python (default: 3.12)")
    parser.add_argument("--dest", type=Path, default=_REPO_ROOT / ".whl", help="where the wheels go (default: .whl)")
    args = parser.parse_args(argv)
    from tandem.proto_build import generate, stale_stubs

    if stale_stubs():
        generate()  # the stubs travel as they are: they must match proto/
    args.dest.mkdir(parents=True, exist_ok=True)
    for old in args.dest.glob("*.whl"):
        old.unlink()  # one version of each: two would stop the install there
    requirements = pins()
    subprocess.run(download_command(requirements, args.python_version, args.dest), check=True)
    wheels = sorted(p.name for p in args.dest.glob("*.whl"))
    print(f"{len(wheels)} wheels in {args.dest}: {', '.join(wheels)}")
    print("carry .whl and tandem/v1; there: bash benchmarks/gpu_check_device.sh")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
