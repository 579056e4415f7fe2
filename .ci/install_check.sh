#!/usr/bin/env bash
# Does Tandem install from a wheel and run from anywhere, both as the coordinator's image installs
# it (no torch) and as `pip install tandem` does? One wheel, built from a copy of the files git
# knows (tracked, or new and not ignored), so that stubs left in tandem/v1/ by an editable install
# cannot stand in for the build step and the checkout gets no build/ or *.egg-info; one fresh venv
# in a temp dir, used from outside the checkout:
#   1. as docker/coordinator.Dockerfile installs it: the wheel with --no-deps plus its requirements
#      less torch (docker/requirements_without_torch.py). torch is not installed, importing the
#      coordinator (and building the CLI) loads none, `tandem serve coordinator --help` works; and,
#      when WORKER_PYTHON names a Python with Tandem and torch (e.g. .venv/bin/python) and SmolLM2
#      is prepared (`make models-ci`): a target worker started with it, the wheel's coordinator in
#      front, and a 4-token `tandem generate --addr` through the coordinator;
#   2. then the whole package: the wheel again with its dependencies and torch (pinned: pip takes the
#      local CPU wheel instead of downloading a CUDA build), `pip check`; the generated stubs are
#      shipped in the wheel, `tandem serve coordinator --help` and a 4-token `tandem generate` on
#      SmolLM2 in this process.
# One venv for both saves a second wheel build and a second install of the shared requirements
# (about 45 s of CI). --no-compile: byte-compiling torch alone takes a minute, and the few modules
# the checks import compile as they load.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
python=${BOOTSTRAP_PYTHON:-python3}
worker_python=${WORKER_PYTHON:-}
torch_version=${TORCH_VERSION:-2.13.0}
start=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/tandem-install-check.XXXXXX")
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT
step() { printf 'install-check [%3ds]: %s\n' "$((SECONDS - start))" "$*"; }
fail() { echo "install-check: $*" >&2; exit 1; }

step "building the wheel from the checkout's files"
mkdir "$work/src"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done | tar --null -T - -cf -) \
    | tar -xf - -C "$work/src"
"$python" -m pip wheel -q --disable-pip-version-check --no-deps --wheel-dir "$work/dist" "$work/src"
rm -rf "$work/src"  # from here on, only the wheel exists
wheel=$(ls "$work"/dist/tandem-*.whl)

step "fresh venv, as the coordinator's image: the wheel --no-deps plus its requirements less torch"
"$python" "$repo/docker/requirements_without_torch.py" --extra tracing "$wheel" >"$work/requirements.txt"
sed 's/^/  /' "$work/requirements.txt"
"$python" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip -q --disable-pip-version-check)
"${pip[@]}" install --no-compile -r "$work/requirements.txt"
"${pip[@]}" install --no-compile --no-deps "$wheel"
cd "$work"  # outside the checkout: only the installed package can be imported
unset PYTHONPATH
bin="$work/venv/bin"

step "no torch installed, none imported"
if "${pip[@]}" show torch >/dev/null 2>&1; then fail "torch is installed"; fi
"$bin/python" - <<'PY'
import importlib.util
import sys

import coordinator.main, coordinator.service, coordinator.workers  # noqa: E401,F401
import tandem.cli

tandem.cli.build_parser()
from tandem.tracing import Tracing  # the image's tracing extra: spans without torch

Tracing.open("http://127.0.0.1:4317", "tandem-coordinator").shutdown(0.1)
assert importlib.util.find_spec("torch") is None, "torch is importable"
loaded = sorted(m for m in ("torch", "transformers.modeling_utils") if m in sys.modules)
assert not loaded, f"importing the coordinator loaded {loaded}"
print(f"  coordinator imported from {coordinator.__file__}, no torch")
PY

step "tandem serve coordinator --help (no torch)"
"$bin/tandem" serve coordinator --help >"$work/help.txt"
grep -q -- "--tokenizer" "$work/help.txt" || { cat "$work/help.txt"; fail "--help lacks --tokenizer"; }

# Waits for a service's TANDEM_READY line and prints its port.
ready_port() {
    local log=$1 pid=$2
    for _ in $(seq 1 600); do
        # (the log appears once the background process's shell has opened it: until then, nothing to read)
        port=$(sed -n 's/.*TANDEM_READY role=[a-z]* port=\([0-9]*\).*/\1/p' "$log" 2>/dev/null | head -1)
        if [ -n "$port" ]; then echo "$port"; return 0; fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    cat "$log" >&2
    fail "$log never became ready"
}

if [ -z "$worker_python" ]; then
    step "serving through the torch-less coordinator not checked (no WORKER_PYTHON)"
elif ! "$worker_python" -m tandem models path smollm2 >/dev/null 2>&1; then
    step "serving through the torch-less coordinator not checked (SmolLM2 not prepared: \`make models-ci\`)"
else
    step "serving: a SmolLM2 target worker ($worker_python), the torch-less coordinator in front"
    "$worker_python" -m tandem serve target --model smollm2 --port 0 --host 127.0.0.1 >"$work/target.log" 2>&1 &
    pids+=($!)
    target_port=$(ready_port "$work/target.log" "${pids[-1]}")
    "$bin/tandem" serve coordinator --tokenizer smollm2 --target-addr "127.0.0.1:$target_port" --port 0 \
        --host 127.0.0.1 >"$work/coordinator.log" 2>&1 &
    pids+=($!)
    coordinator_port=$(ready_port "$work/coordinator.log" "${pids[-1]}")
    "$bin/tandem" generate "Hello" --addr "127.0.0.1:$coordinator_port" --max-new-tokens 4 --json \
        >"$work/served.txt"
    "$bin/python" - "$work/served.txt" <<'PY'
import json
import sys

result = json.loads(open(sys.argv[1], encoding="utf-8").read().strip().splitlines()[-1])
assert 1 <= len(result["token_ids"]) <= 4, result
print(f"  the torch-less coordinator served {len(result['token_ids'])} tokens: {result['text']!r}")
PY
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    pids=()
fi

step "the whole package: the wheel again with its dependencies, torch==$torch_version among them"
# Uninstalled first, so that pip resolves the wheel's whole dependency set afresh (a wheel already installed
# at its version would be taken as satisfied, its missing dependencies with it); `pip check` then says
# that every installed requirement is met.
"${pip[@]}" uninstall -y tandem
"${pip[@]}" install --no-compile "torch==$torch_version" "$wheel"
"${pip[@]}" check

step "the installed package and its generated stubs"
"$bin/python" - <<'PY'
import importlib.metadata
from pathlib import Path

import tandem
from tandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc  # noqa: F401  (package imports inside)

site = Path(tandem.__file__).resolve().parents[1]
assert site.name == "site-packages", f"tandem imported from {tandem.__file__}, not from the venv"
shipped = {str(f) for f in importlib.metadata.files("tandem")}
for name in ("common", "draft", "target", "generation"):
    for suffix in ("_pb2.py", "_pb2_grpc.py"):
        assert f"tandem/v1/{name}{suffix}" in shipped, f"the wheel lacks tandem/v1/{name}{suffix}"
assert generation_pb2_grpc.GenerationStub is not None
print(f"  tandem {tandem.__version__} from {site}; stubs shipped in the wheel")
PY

step "tandem serve coordinator --help"
"$bin/tandem" serve coordinator --help >"$work/help.txt"
grep -q -- "--target-addr" "$work/help.txt" || { cat "$work/help.txt"; fail "--help lacks --target-addr"; }

step 'tandem generate "Hello" --target smollm2 --max-new-tokens 4'
"$bin/tandem" generate "Hello" --target smollm2 --max-new-tokens 4 --json >"$work/generate.txt"
"$bin/python" - "$work/generate.txt" <<'PY'
import json
import sys

lines = open(sys.argv[1], encoding="utf-8").read().strip().splitlines()
result = json.loads(lines[-1])
assert 1 <= len(result["token_ids"]) <= 4, result
print(f"  generated {len(result['token_ids'])} tokens: {result['text']!r}")
PY

step "passed"
