# syntax=docker/dockerfile:1
# Draft and target workers: CUDA, torch, flash-attn and the Tandem wheel. One image for both
# roles: the chart runs `tandem serve target ...` or `tandem serve draft ...` (ENTRYPOINT is
# `tandem serve`), and the hub-download init containers run its `hf` command.
# Build from the repository root:  docker build -f docker/worker.Dockerfile -t tandem/worker:0.1.0 .
#
# torch's PyPI wheels for Linux are CUDA builds: torch 2.13.0 is built for CUDA 13.0 (its
# cuda-toolkit 13.0.x requirement), so the base images are CUDA 13.0 too, and the nodes need an
# NVIDIA driver that runs CUDA 13.0 (R580 or newer). For an older driver, build against an older
# CUDA with torch's own index for it, e.g. --build-arg CUDA_VERSION=12.8.1 --build-arg
# TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 (R570+). flash-attn compiles
# against the devel image's nvcc (or takes its published prebuilt wheel when one matches);
# the build stage refuses a CUDA that differs from torch's.
ARG CUDA_VERSION=13.0.2
ARG UBUNTU_VERSION=24.04

FROM nvidia/cuda:${CUDA_VERSION}-devel-ubuntu${UBUNTU_VERSION} AS build
ARG TORCH_VERSION=2.13.0
# Empty: PyPI's torch (CUDA 13.0). Else the index torch comes from (it must match CUDA_VERSION).
ARG TORCH_INDEX_URL=
ARG FLASH_ATTN_VERSION=2.8.3.post2
# Parallel nvcc jobs for flash-attn; each takes several GB of memory.
ARG MAX_JOBS=4
# The GPU generations flash-attn is compiled for (80: A100, 90: H100/H200; 100, 120: Blackwell). Each
# one more multiplies the build's hours and memory; without it flash-attn builds for them all.
ARG FLASH_ATTN_CUDA_ARCHS=80;90
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 DEBIAN_FRONTEND=noninteractive
# The Ubuntu release is pinned by the base image tag; its packages take the release's updates.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-dev python3-venv git \
    && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH
# flash-attn builds without isolation, against this torch, with these build tools.
RUN pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple} \
        "torch==${TORCH_VERSION}" ninja==1.13.2 packaging==26.3 psutil==7.2.2 einops==0.8.2 wheel==0.48.0 \
        setuptools==84.2.1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN torch_cuda=$(python -c "import torch; print(torch.version.cuda)") \
    && nvcc_cuda=$(nvcc --version | sed -n 's/.*release \([0-9]*\.[0-9]*\).*/\1/p') \
    && if [ "$torch_cuda" != "$nvcc_cuda" ]; then \
         echo "torch ${TORCH_VERSION} is built for CUDA $torch_cuda, the base image has $nvcc_cuda: set CUDA_VERSION" >&2; \
         exit 1; \
       fi
RUN MAX_JOBS=${MAX_JOBS} FLASH_ATTN_CUDA_ARCHS="${FLASH_ATTN_CUDA_ARCHS}" \
        pip wheel --no-build-isolation --no-deps --wheel-dir /wheels "flash-attn==${FLASH_ATTN_VERSION}"
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proto ./proto
COPY tandem ./tandem
COPY coordinator ./coordinator
COPY draft_worker ./draft_worker
COPY target_worker ./target_worker
# The wheel build runs protoc (grpcio-tools from [build-system]): the stubs ship in the wheel.
RUN pip wheel --no-deps --wheel-dir /wheels .

FROM nvidia/cuda:${CUDA_VERSION}-runtime-ubuntu${UBUNTU_VERSION}
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
# torch first and pinned, then flash-attn and Tandem against it; the wheels go away after. flash-attn's
# CUDA extension is imported here: one built against another torch fails to load ("undefined symbol"),
# and the workers would fall back to SDPA (with a warning) instead of failing the build.
RUN python3 -m venv /opt/tandem \
    && /opt/tandem/bin/pip install ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple} \
        "torch==${TORCH_VERSION}" \
    && /opt/tandem/bin/pip install /wheels/flash_attn-*.whl "$(ls /wheels/tandem-*.whl)[gpu,tracing]" \
    && rm -rf /wheels \
    && /opt/tandem/bin/python -c "import flash_attn, flash_attn_2_cuda" \
    && /opt/tandem/bin/tandem serve target --help >/dev/null
ENV PATH=/opt/tandem/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TANDEM_HOME=/models/.tandem \
    HOME=/tmp
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid tandem --no-create-home --shell /usr/sbin/nologin tandem
USER 10001:10001
EXPOSE 50052 50053 9102 9103
ENTRYPOINT ["tandem", "serve"]
CMD ["--help"]
