# syntax=docker/dockerfile:1
# The coordinator: the public Generation API and the speculation loop. It holds no weights and
# imports no torch, so its image has neither CUDA nor torch: the wheel is installed with
# --no-deps plus its requirements less torch (docker/requirements_without_torch.py), and OpenTelemetry's
# (the tracing extra: --otlp-traces-endpoint).
# Build from the repository root:  docker build -f docker/coordinator.Dockerfile -t tandem/coordinator:0.1.0 .
ARG PYTHON_IMAGE=python:3.12.8-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proto ./proto
COPY tandem ./tandem
COPY coordinator ./coordinator
COPY draft_worker ./draft_worker
COPY target_worker ./target_worker
COPY docker/requirements_without_torch.py /tmp/
# The wheel build runs protoc (grpcio-tools from [build-system]): the stubs ship in the wheel.
# Installs byte-compile (no --no-compile): the root filesystem is read-only at run time.
RUN pip wheel --no-deps --wheel-dir /wheels . \
    && python /tmp/requirements_without_torch.py --extra tracing /wheels/tandem-*.whl > /wheels/requirements.txt \
    && python -m venv /opt/tandem \
    && /opt/tandem/bin/pip install -r /wheels/requirements.txt \
    && /opt/tandem/bin/pip install --no-deps /wheels/tandem-*.whl \
    && if /opt/tandem/bin/pip show torch >/dev/null 2>&1; then echo "torch crept into the coordinator" >&2; exit 1; fi \
    && /opt/tandem/bin/tandem serve coordinator --help >/dev/null

FROM ${PYTHON_IMAGE}
ENV PATH=/opt/tandem/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    TANDEM_HOME=/models/.tandem \
    HOME=/tmp
COPY --from=build /opt/tandem /opt/tandem
RUN groupadd --gid 10001 tandem && useradd --uid 10001 --gid tandem --no-create-home --shell /usr/sbin/nologin tandem
USER 10001:10001
EXPOSE 50051 9100
# The chart passes the flags only (helm/tandem/templates/coordinator.yaml).
ENTRYPOINT ["tandem", "serve", "coordinator"]
CMD ["--help"]
