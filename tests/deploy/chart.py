"""Renders the Helm chart with the real helm binary and finds objects in what it renders.

helm comes from TANDEM_HELM, else .tools/bin/helm (where .ci/deploy_tools.sh installs it),
else PATH; the tests skip, saying so, when there is none.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "tandem"
VARIANTS = REPO / "tests" / "deploy" / "values"
RELEASE, NAMESPACE = "tandem", "serving"
DEFAULT_TOOLS_HELM = REPO / ".tools" / "bin" / "helm"


def helm_binary() -> str:
    for candidate in (os.environ.get("TANDEM_HELM"), str(DEFAULT_TOOLS_HELM), shutil.which("helm")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    pytest.skip("no helm binary: run .ci/deploy_tools.sh (or set TANDEM_HELM); CI's deploy-check installs it")


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm_binary(), *args], capture_output=True, text=True, timeout=60)


@functools.cache
def _render(variant: str | None, sets: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE]
    if variant:
        args += ["-f", str(VARIANTS / f"{variant}.yaml")]
    for s in sets:
        args += ["--set", s]
    out = helm(*args)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def render(variant: str | None = None, *sets: str) -> list[dict[str, Any]]:
    """The chart's objects for the default values, a variant file of tests/deploy/values, and --set pairs."""
    return list(_render(variant, sets))


def render_error(*sets: str) -> str:
    """helm's error for values the chart must refuse."""
    args = ["template", RELEASE, str(CHART)]
    for s in sets:
        args += ["--set", s]
    out = helm(*args)
    assert out.returncode != 0, f"the chart accepted {sets}"
    return out.stderr


def name(component: str) -> str:
    # The release name contains the chart name, so the chart does not repeat it.
    return f"{RELEASE}-{component}"


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict[str, Any]], kind: str, object_name: str) -> dict[str, Any]:
    found = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == object_name]
    assert len(found) == 1, f"{len(found)} {kind} named {object_name}"
    return found[0]


def container(objects: list[dict[str, Any]], component: str) -> dict[str, Any]:
    """The main container of a component's Deployment."""
    pod = one(objects, "Deployment", name(component))["spec"]["template"]["spec"]
    (main,) = [c for c in pod["containers"] if c["name"] == component]
    return main


def flag(args: list[str], option: str) -> str:
    assert args.count(option) == 1, f"{option} given {args.count(option)} times in {args}"
    return args[args.index(option) + 1]


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector (matchLabels only, as the chart writes them) against a pod's labels."""
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def pod_labels(objects: list[dict[str, Any]], component: str) -> dict[str, str]:
    return one(objects, "Deployment", name(component))["spec"]["template"]["metadata"]["labels"]


def variant_names() -> list[str]:
    return sorted(p.stem for p in VARIANTS.glob("*.yaml"))
