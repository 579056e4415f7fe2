#!/usr/bin/env bash
# Does Tandem install from a wheel and run from anywhere? `pip install .` (not editable) of
# this checkout's files into a fresh venv in a temp dir, then, from outside the checkout:
# the generated gRPC stubs import, `tandem serve coordinator --help`, and a 4-token
# `tandem generate` on SmolLM2 (prepared in $TANDEM_HOME or ~/.cache/tandem: `make models-ci`).
#
# The wheel is built from a copy of the files git knows (tracked, or new and not ignored), so
# stubs left in tandem/v1/ by an editable install cannot stand in for the build step, and
# the checkout gets no build/ or *.egg-info. torch comes first and pinned: pip takes the
# local CPU wheel instead of downloading a CUDA build. --no-compile: byte-compiling torch
# alone takes a minute, and the few modules the checks import compile as they load.
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
venv_python=${VENV_PYTHON:-python3}
torch_version=${TORCH_VERSION:-2.13.0}
start=$SECONDS

work=$(mktemp -d "${TMPDIR:-/tmp}/tandem-install-check.XXXXXX")
trap 'rm -rf "$work"' EXIT

step() { printf 'install-check [%3ds]: %s\n' "$((SECONDS - start))" "$*"; }

step "copying the checkout's files to $work/src"
mkdir "$work/src"
(
    cd "$repo"
    git ls-files -z --cached --others --exclude-standard \
        | while IFS= read -r -d '' f; do [ -e "$f" ] && printf '%s\0' "$f"; done \
        | tar --null -T - -cf -
) | tar -xf - -C "$work/src"

step "fresh venv, torch==$torch_version, then pip install . (a wheel, not editable)"
"$venv_python" -m venv "$work/venv"
pip=("$work/venv/bin/python" -m pip --disable-pip-version-check)
"${pip[@]}" install -q --no-compile "torch==$torch_version"
"${pip[@]}" install -q --no-compile "$work/src"
rm -rf "$work/src"  # from here on, only the installed package exists

cd "$work"  # outside the checkout, so nothing can be imported from it
unset PYTHONPATH
bin="$work/venv/bin"

step "the installed package and its generated stubs"
"$bin/python" - <<'EOF'
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
EOF

step "tandem serve coordinator --help"
"$bin/tandem" serve coordinator --help >"$work/help.txt"
grep -q -- "--target-addr" "$work/help.txt" || { cat "$work/help.txt"; echo "install-check: --help lacks --target-addr" >&2; exit 1; }

step 'tandem generate "Hello" --target smollm2 --max-new-tokens 4'
"$bin/tandem" generate "Hello" --target smollm2 --max-new-tokens 4 --json >"$work/generate.txt"
"$bin/python" - "$work/generate.txt" <<'EOF'
import json
import sys

lines = open(sys.argv[1], encoding="utf-8").read().strip().splitlines()
result = json.loads(lines[-1])
assert 1 <= len(result["token_ids"]) <= 4, result
print(f"  generated {len(result['token_ids'])} tokens: {result['text']!r}")
EOF

step "passed"
