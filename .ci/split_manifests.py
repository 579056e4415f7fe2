"""Split rendered manifests: core Kubernetes kinds (YAML) for kubernetes-validate, and the
custom resources it has no schema for (JSON) for validate_crds.mjs.

Usage: split_manifests.py RENDERED.yaml CORE_OUT.yaml CRDS_OUT.json
A kind that is neither core nor one of CUSTOM_KINDS cannot be validated by either and is refused,
so that nothing is skipped silently.
"""

from __future__ import annotations

import json
import sys

import yaml

CUSTOM_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "ServiceMonitor")}
# API groups kubernetes-validate carries schemas for, as the chart uses them.
CORE_GROUPS = {"v1", "apps/v1", "autoscaling/v2", "policy/v1", "rbac.authorization.k8s.io/v1",
               "networking.k8s.io/v1"}


def main(rendered: str, core_out: str, crds_out: str) -> int:
    with open(rendered, encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    core, custom = [], []
    for doc in docs:
        key = (doc.get("apiVersion"), doc.get("kind"))
        if key in CUSTOM_KINDS:
            custom.append(doc)
        elif key[0] in CORE_GROUPS:
            core.append(doc)
        else:
            print(f"split_manifests: no schema to validate {key[1]} ({key[0]}) against", file=sys.stderr)
            return 1
    with open(core_out, "w", encoding="utf-8") as f:
        yaml.safe_dump_all(core, f, sort_keys=False)
    with open(crds_out, "w", encoding="utf-8") as f:
        json.dump(custom, f)
    print(f"  {len(core)} core objects, {len(custom)} custom resources")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))
