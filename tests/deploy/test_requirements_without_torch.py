"""docker/requirements_without_torch.py: the coordinator image's requirements, read from a wheel."""

from __future__ import annotations

import importlib.util
import zipfile

import pytest

from tests.deploy.chart import REPO

_spec = importlib.util.spec_from_file_location("requirements_without_torch",
                                               REPO / "docker" / "requirements_without_torch.py")
requirements_without_torch = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(requirements_without_torch)

METADATA = """\
Metadata-Version: 2.4
Name: tandem
Version: 0.1.0
Requires-Dist: torch>=2.6
Requires-Dist: transformers>=4.50
Requires-Dist: Accelerate>=0.30
Requires-Dist: grpcio>=1.85.1
Requires-Dist: kubernetes>=29.0
Requires-Dist: pytest>=8; extra == "dev"
Requires-Dist: flash-attn>=2.6; extra == "gpu"
Requires-Dist: opentelemetry-sdk>=1.30; extra == 'tracing'
Provides-Extra: dev

A description that mentions Requires-Dist: torch in passing.
"""


def test_keeps_runtime_requirements_and_drops_torch_and_what_requires_it_and_extras(tmp_path):
    wheel = tmp_path / "tandem-0.1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("tandem-0.1.0.dist-info/METADATA", METADATA)
    assert requirements_without_torch.coordinator_requirements(str(wheel)) == [
        "transformers>=4.50", "grpcio>=1.85.1", "kubernetes>=29.0"]
    # an extra the image asks for (--extra tracing) is printed without its marker; the others stay out
    assert requirements_without_torch.coordinator_requirements(str(wheel), frozenset({"tracing"})) == [
        "transformers>=4.50", "grpcio>=1.85.1", "kubernetes>=29.0", "opentelemetry-sdk>=1.30"]


def test_the_projects_own_requirements_keep_what_the_coordinator_imports():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {requirements_without_torch.canonical(d.split(">")[0].split("=")[0].split("<")[0]) for d in declared}
    # What the coordinator imports at run time (gRPC, the tokenizer, Redis, discovery, metrics) must stay.
    kept = names - requirements_without_torch.WORKER_ONLY
    assert {"grpcio", "grpcio-health-checking", "grpcio-reflection", "protobuf", "transformers", "tokenizers",
            "redis", "kubernetes", "prometheus-client"} <= kept
    assert "torch" not in kept
