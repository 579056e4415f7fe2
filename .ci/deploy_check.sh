#!/usr/bin/env bash
# CI for the deployment half: the Helm chart and the images (the coordinator's wheel: .ci/install_check.sh).
#   1. tools (.ci/deploy_tools.sh: helm v4, kubernetes-validate, hadolint, CRD validators)
#   2. for the default values and every variant in tests/deploy/values/: `helm lint --strict`,
#      `helm template`, core objects through `kubernetes-validate --strict -k 1.30.0` (any kind it
#      has no schema for fails the check), custom resources (ScaledObject, ServiceMonitor) through
#      their CRDs' published schemas (.ci/validate_crds.mjs)
#   3. hadolint on every Dockerfile
#   4. pytest tests/deploy (the assertions on the rendered objects), with the tools from step 1
# Environment: TANDEM_TOOLS (default .tools in the checkout), VENV_PYTHON (the project's Python, with pytest;
# default .venv/bin/python), KUBERNETES_VERSION (default 1.30.0).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)
tools=${TANDEM_TOOLS:-$repo/.tools}
venv_python=${VENV_PYTHON:-$repo/.venv/bin/python}
k8s_version=${KUBERNETES_VERSION:-1.30.0}
work=$(mktemp -d "${TMPDIR:-/tmp}/tandem-deploy-check.XXXXXX")
trap 'rm -rf "$work"' EXIT
say() { printf 'deploy-check: %s\n' "$*"; }

bash .ci/deploy_tools.sh "$tools"
helm="$tools/bin/helm"

variants=(default tests/deploy/values/*.yaml)
for variant in "${variants[@]}"; do
    name=$(basename "$variant" .yaml)
    values=()
    [ "$variant" = default ] || values=(-f "$variant")
    say "chart, $name values"
    "$helm" lint --strict --namespace tandem helm/tandem "${values[@]}" >"$work/lint.txt" || { cat "$work/lint.txt"; exit 1; }
    grep -E 'linted|\[(WARNING|ERROR)\]' "$work/lint.txt" | sed 's/^/  /'
    "$helm" template tandem helm/tandem --namespace tandem "${values[@]}" >"$work/$name.yaml"
    "$tools/venv/bin/python" .ci/split_manifests.py "$work/$name.yaml" "$work/$name.core.yaml" "$work/$name.crds.json"
    rc=0
    "$tools/bin/kubernetes-validate" --strict -k "$k8s_version" "$work/$name.core.yaml" >"$work/$name.validate.txt" 2>&1 \
        || rc=$?
    passed=$(grep -c '^INFO' "$work/$name.validate.txt" || true)
    if [ "$rc" != 0 ] || grep -qv '^INFO' "$work/$name.validate.txt" \
        || [ "$passed" != "$(grep -c '^kind:' "$work/$name.core.yaml")" ]; then
        grep -v '^INFO' "$work/$name.validate.txt" || true
        say "kubernetes-validate did not pass every object of the $name values"
        exit 1
    fi
    echo "  $passed core objects valid against Kubernetes $k8s_version (strict)"
    node .ci/validate_crds.mjs "$tools" <"$work/$name.crds.json"
done

say "hadolint"
"$tools/bin/hadolint" docker/*.Dockerfile
echo "  $(ls docker/*.Dockerfile | tr '\n' ' ')clean"

say "pytest tests/deploy"
TANDEM_HELM="$helm" "$venv_python" -m pytest -q tests/deploy

say "passed"
