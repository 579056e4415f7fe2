"""The chart's TLS exec probe, run as the kubelet would run it, against a real gRPC server with TLS.

Native gRPC probes speak plaintext only, so with tls.enabled the chart probes with a small Python
program (the image's own grpcio) that calls grpc.health.v1 over TLS. The certificates are made by
the openssl command; the server is grpcio's, with the same health servicer our servers use.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from tests.deploy.chart import container, render

SERVER_NAME = "localhost"  # the chart's default tls.serverName


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def tls_dir(tmp_path_factory) -> Path:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make test certificates")
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=tandem-test-ca", cwd=d)
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=tandem", cwd=d)
    # One certificate for server and client use, as one Secret serves every pod in the chart.
    (d / "ext.cnf").write_text(
        f"subjectAltName=DNS:{SERVER_NAME}\nextendedKeyUsage=serverAuth,clientAuth\n")
    _openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
             "-out", "tls.crt", "-days", "2", "-extfile", "ext.cnf", cwd=d)
    return d


def _serve(tls_dir: Path, require_client_cert: bool) -> tuple[grpc.Server, health.HealthServicer, int]:
    servicer = health.HealthServicer()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    credentials = grpc.ssl_server_credentials(
        [((tls_dir / "tls.key").read_bytes(), (tls_dir / "tls.crt").read_bytes())],
        root_certificates=(tls_dir / "ca.crt").read_bytes(), require_client_auth=require_client_cert)
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    return server, servicer, port


def _probe_command(mutual: bool, tls_dir: Path, port: int) -> list[str]:
    """The readiness probe the chart renders for a target worker, pointed at this server and these files."""
    objects = render("tls-auth", f"tls.mutual={str(mutual).lower()}")
    command = list(container(objects, "target")["readinessProbe"]["exec"]["command"])
    assert command[0] == "python" and command[3] == "/etc/tandem/tls"
    assert command[4] == "50052" and command[5] == SERVER_NAME
    command[0], command[3], command[4] = sys.executable, str(tls_dir), str(port)
    return command


def _run(command: list[str]) -> int:
    return subprocess.run(command, capture_output=True, timeout=60).returncode


@pytest.mark.parametrize("mutual", [False, True])
def test_the_probe_passes_only_while_the_server_reports_serving(tls_dir, mutual):
    server, servicer, port = _serve(tls_dir, require_client_cert=mutual)
    try:
        command = _probe_command(mutual, tls_dir, port)
        servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # weights still loading
        assert _run(command) != 0
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert _run(command) == 0
    finally:
        server.stop(None)


def test_a_server_that_requires_client_certificates_refuses_a_probe_without_one(tls_dir):
    server, servicer, port = _serve(tls_dir, require_client_cert=True)
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert _run(_probe_command(False, tls_dir, port)) != 0
        assert _run(_probe_command(True, tls_dir, port)) == 0
    finally:
        server.stop(None)
