#!/usr/bin/env bash
# Does the coordinator install and serve from a wheel without torch, as its image runs it?
# Builds the wheel from the files git knows, installs it into a fresh venv exactly as
# docker/coordinator.Dockerfile does (the wheel with --no-deps, plus its requirements less torch
# from docker/requirements_without_torch.py), then, from outside the checkout:
#   - torch is not installed, and importing the coordinator (and building the CLI) loads none;
#   - `tandem serve coordinator --help` works;
#   - when WORKER_PYTHON names a Python with Tandem and torch (e.g. .venv/bin/python) and SmolLM2
#     is prepared (`make models-ci`): a target worker started with it, the wheel's coordinator in
#     front, and a 4-token `tandem generate --addr` through the coordinator.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
python=${BOOTSTRAP_PYTHON:-python3}
worker_python=${WORKER_PYTHON:-}
start=$SECONDS
work=$(mktemp -d "${TMPDIR:-/tmp}/tandem-coordinator-wheel.XXXXXX")
pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$work"
}
trap cleanup EXIT
step() { printf 'coordinator-wheel [%3ds]: %s\n' "$((SECONDS - start))" "$*"; }

step "building the wheel from the checkout's files"
mkdir "$work/src"
(cd "$repo" && git ls-files -z --cached --others --exclude-standard \
    | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done | tar --null -T - -cf -) \
    | tar -xf - -C "$work/src"
"$python" -m pip wheel -q --disable-pip-version-check --no-deps --wheel-dir "$work/dist" "$work/src"
wheel=$(ls "$work"/dist/tandem-*.whl)

step "fresh venv: the wheel --no-deps plus its requirements less torch (as the image)"
"$python" "$repo/docker/requirements_without_torch.py" "$wheel" >"$work/requirements.txt"
sed 's/^/  /' "$work/requirements.txt"
"$python" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip -q --disable-pip-version-check)
"${pip[@]}" install --no-compile -r "$work/requirements.txt"
"${pip[@]}" install --no-compile --no-deps "$wheel"
rm -rf "$work/src"
cd "$work"  # outside the checkout: only the installed package can be imported
unset PYTHONPATH
bin="$work/venv/bin"

step "no torch installed, none imported"
if "${pip[@]}" show torch >/dev/null 2>&1; then echo "coordinator-wheel: torch is installed" >&2; exit 1; fi
"$bin/python" - <<'PY'
import importlib.util
import sys

import coordinator.main, coordinator.service, coordinator.workers  # noqa: E401,F401
import tandem.cli

tandem.cli.build_parser()
assert importlib.util.find_spec("torch") is None, "torch is importable"
loaded = sorted(m for m in ("torch", "transformers.modeling_utils") if m in sys.modules)
assert not loaded, f"importing the coordinator loaded {loaded}"
print(f"  coordinator imported from {coordinator.__file__}, no torch")
PY

step "tandem serve coordinator --help"
"$bin/tandem" serve coordinator --help >"$work/help.txt"
grep -q -- "--tokenizer" "$work/help.txt" || { cat "$work/help.txt"; echo "coordinator-wheel: --help lacks --tokenizer" >&2; exit 1; }

if [ -z "$worker_python" ]; then
    step "passed (no WORKER_PYTHON: serving not checked)"
    exit 0
fi
if ! "$worker_python" -m tandem models path smollm2 >/dev/null 2>&1; then
    step "passed (SmolLM2 not prepared: serving not checked; \`make models-ci\`)"
    exit 0
fi

# Waits for a service's TANDEM_READY line and prints its port.
ready_port() {
    local log=$1 pid=$2
    for _ in $(seq 1 600); do
        port=$(sed -n 's/.*TANDEM_READY role=[a-z]* port=\([0-9]*\).*/\1/p' "$log" | head -1)
        if [ -n "$port" ]; then echo "$port"; return 0; fi
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.5
    done
    cat "$log" >&2
    echo "coordinator-wheel: $log never became ready" >&2
    return 1
}

step "serving: a SmolLM2 target worker ($worker_python), the wheel's coordinator in front"
"$worker_python" -m tandem serve target --model smollm2 --port 0 --host 127.0.0.1 >"$work/target.log" 2>&1 &
pids+=($!)
target_port=$(ready_port "$work/target.log" "${pids[-1]}")
"$bin/tandem" serve coordinator --tokenizer smollm2 --target-addr "127.0.0.1:$target_port" --port 0 \
    --host 127.0.0.1 >"$work/coordinator.log" 2>&1 &
pids+=($!)
coordinator_port=$(ready_port "$work/coordinator.log" "${pids[-1]}")
"$bin/tandem" generate "Hello" --addr "127.0.0.1:$coordinator_port" --max-new-tokens 4 --json >"$work/generate.txt"
"$bin/python" - "$work/generate.txt" <<'PY'
import json
import sys

result = json.loads(open(sys.argv[1], encoding="utf-8").read().strip().splitlines()[-1])
assert 1 <= len(result["token_ids"]) <= 4, result
print(f"  the wheel's coordinator served {len(result['token_ids'])} tokens: {result['text']!r}")
PY
step "passed"
