"""Build hook: generate the gRPC stubs (tandem/v1/*_pb2*.py) from proto/ while building.

All metadata lives in pyproject.toml; this file only adds the protoc step,
with grpcio-tools from ``[build-system].requires``:

* a wheel (``pip install .``): the stubs are written into the build directory,
  so they ship in the wheel and the checkout is left as it was;
* an editable install (``pip install -e .``, ``make setup``): setuptools skips
  ``build_py`` there and imports the package from the checkout, so the stubs are
  written into ``tandem/v1/`` of the checkout (gitignored);
* an sdist carries proto/, so a wheel built from it can do the same.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

ROOT = Path(__file__).resolve().parent


def _proto_build():
    # Loaded by path: importing the tandem package here would need its
    # dependencies, which a build environment does not have.
    spec = importlib.util.spec_from_file_location("_tandem_proto_build", ROOT / "tandem" / "proto_build.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    """``build_py`` that also runs protoc on proto/tandem/v1/*.proto."""

    def run(self) -> None:
        super().run()
        out_root = ROOT if self.editable_mode else Path(self.build_lib)
        generated = [str(p) for p in _proto_build().generate(out_root, ROOT / "proto")]
        if not self.editable_mode and (self.compile or self.optimize):  # as for the copied modules
            self.byte_compile([p for p in generated if p.endswith(".py")])

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = super().get_outputs(include_bytecode)
        if self.editable_mode:
            return outputs
        stubs = {str(p) for p in _proto_build().generated_files(Path(self.build_lib))}
        return sorted(set(outputs) | stubs)


class SdistWithProtos(sdist):
    """``sdist`` that includes proto/, which the wheel build needs (no MANIFEST.in to keep in step)."""

    def make_distribution(self) -> None:
        protos = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "proto").rglob("*.proto"))]
        self.filelist.extend(p for p in protos if p not in self.filelist.files)
        super().make_distribution()


setup(cmdclass={"build_py": BuildPyWithStubs, "sdist": SdistWithProtos})
