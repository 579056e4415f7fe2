#!/usr/bin/env bash
# The GPU check on a machine with one NVIDIA GPU and no network, from a copy of the checkout that
# carries .whl (python benchmarks/gpu_wheels.py, run where there is network) and tandem/v1 (the
# generated gRPC stubs). Uses the machine's own python3 (the one with PyTorch and CUDA); installs the
# wheels beside it, not into it. Results and the log go to $OUT when set, else benchmarks/results.
# Arguments pass on to benchmarks/gpu_check.py (--quick, --skip ...).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-benchmarks/results}"
wheels="${TANDEM_WHEELS:-.whl}"  # (another folder, or an empty one for none)
mkdir -p "$out"
if compgen -G "$wheels/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/tandem-site "$wheels"/*.whl || exit 1
    export PYTHONPATH="/tmp/tandem-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# A copy's file times are arbitrary, and tandem/v1 refuses stubs older than their .proto: these were
# made from this very proto/ (gpu_wheels.py regenerates stale ones before they travel).
if ! compgen -G "tandem/v1/*_pb2.py" > /dev/null; then
    echo "no gRPC stubs in tandem/v1: bring them with the copy (python benchmarks/gpu_wheels.py makes them fresh)" >&2
    exit 1
fi
# Only those older than their .proto: touching fresh ones in a checkout would make its .venv's install
# look stale to make (the stubs are its inputs), and the next make target would reinstall.
for proto in proto/tandem/v1/*.proto; do
    for stub in tandem/v1/"$(basename "$proto" .proto)"_pb2*.py; do
        [ "$stub" -nt "$proto" ] || touch "$stub"
    done
done
nvidia-smi -L || true
python3 -c "import torch, transformers, grpc, google.protobuf as pb
print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available(),
      '| transformers', transformers.__version__, '| grpcio', grpc.__version__, '| protobuf', pb.__version__)"
python3 benchmarks/gpu_check.py --device "${DEVICE:-cuda}" --out "$out" "$@" 2>&1 | tee "$out/gpu_check.log"
