"""A whole Tandem system as local processes: target and draft workers, then the coordinator.

Used by `tandem up`, by the integration tests and by the benchmarks, so that
all three start the system the same way. Every service is a real process
talking real gRPC on localhost; each announces itself with a
``TANDEM_READY role=... port=...`` line once it is serving.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

READY = re.compile(r"TANDEM_READY role=(\w+) port=(\d+) metrics_port=(\d+)")


@dataclass(slots=True)
class Service:
    role: str
    process: subprocess.Popen
    log_path: Path
    port: int = 0
    metrics_port: int = 0
    ready: threading.Event = field(default_factory=threading.Event)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass(slots=True)
class ClusterSpec:
    target: str  # model spec for the target workers
    draft: str | None = None
    port: int = 0  # coordinator port; 0 picks a free one
    target_replicas: int = 1
    draft_replicas: int = 1
    dtype: str = "auto"
    worker_threads: int | None = None
    kv_cache_tokens: int = 16384
    tensor_parallel_size: int = 1  # ranks per target worker (`tandem serve target --tensor-parallel-size`)
    metrics: bool = True
    # Pipelined drafting overlaps draft and verify; on one shared CPU the two processes then
    # slow each other down (measured: 7.5 vs 10.4 tok/s), so local clusters default to off.
    pipelining: bool = False
    coordinator_args: tuple[str, ...] = ()
    draft_args: tuple[str, ...] = ()  # extra `tandem serve draft` flags (quantization, vocabulary)
    # The draft worker's command after the interpreter; tests swap in a fault-injecting wrapper that
    # takes the same flags.
    draft_command: tuple[str, ...] = ("-m", "tandem", "serve", "draft")
    worker_args: tuple[str, ...] = ()  # extra flags for every worker (batching)
    log_dir: Path | None = None
    cache_dir: str | None = None

    def __post_init__(self) -> None:
        if self.target_replicas < 1 or self.draft_replicas < 0:
            raise ValueError("need at least one target replica and a non-negative number of draft replicas")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor-parallel size must be at least 1, got {self.tensor_parallel_size}")


class LocalCluster:
    """Start with ``start()`` (or ``with``); ``stop()`` sends SIGTERM to every process."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.services: list[Service] = []
        self.log_dir = spec.log_dir or Path(os.environ.get("TMPDIR", "/tmp")) / f"tandem-up-{os.getpid()}"
        self.log_dir.mkdir(parents=True, exist_ok=True)

    # ----- lifecycle --------------------------------------------------------
    def start(self, timeout_s: float = 900.0) -> str:
        """Start every service and wait until all are serving; returns the coordinator's address."""
        try:
            workers = [self._spawn_worker("target", self.spec.target, i) for i in range(self.spec.target_replicas)]
            if self.spec.draft:
                workers += [self._spawn_worker("draft", self.spec.draft, i) for i in range(self.spec.draft_replicas)]
            self._wait(workers, timeout_s)
            return self.add_coordinator(self.spec.port, self.spec.coordinator_args, timeout_s).address
        except BaseException:
            self.stop()
            raise

    def add_coordinator(self, port: int = 0, extra_args: tuple[str, ...] = (), timeout_s: float = 120.0) -> Service:
        """One more coordinator over the same workers (replicas of the coordinator share nothing else)."""
        workers = [s for s in self.services if s.role != "coordinator"]
        args = ["--tokenizer", self.spec.target, "--port", str(port)]
        args += [a for s in workers if s.role == "target" for a in ("--target-addr", s.address)]
        args += [a for s in workers if s.role == "draft" for a in ("--draft-addr", s.address)]
        if not self.spec.pipelining:
            args.append("--no-pipelining")
        index = sum(s.role == "coordinator" for s in self.services)
        coordinator = self._spawn("coordinator", f"coordinator-{index}" if index else "coordinator",
                                  [*args, *extra_args])
        self._wait([coordinator], timeout_s)
        wait_serving(coordinator.address, timeout_s=30)
        return coordinator

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the coordinator and let it drain, then the workers its requests still needed."""
        coordinators = [s for s in self.services if s.role == "coordinator"]
        workers = [s for s in self.services if s.role != "coordinator"]
        for group in (coordinators, workers):
            for service in group:
                if service.process.poll() is None:
                    service.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for service in group:
                try:
                    service.process.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    service.process.kill()
                    service.process.wait()

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def coordinator(self) -> Service:
        return next(s for s in self.services if s.role == "coordinator")

    def workers(self, role: str) -> list[Service]:
        return [s for s in self.services if s.role == role]

    # ----- processes -----------------------------------------------------------
    def _spawn_worker(self, role: str, model: str, index: int) -> Service:
        args = ["--model", model, "--port", "0", "--dtype", self.spec.dtype,
                "--kv-cache-tokens", str(self.spec.kv_cache_tokens)]
        if self.spec.worker_threads:
            args += ["--threads", str(self.spec.worker_threads)]
        args += self.spec.worker_args
        if role == "target" and self.spec.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.spec.tensor_parallel_size)]
        if role == "draft":
            args += self.spec.draft_args
            return self._spawn(role, f"{role}-{index}", args, self.spec.draft_command)
        return self._spawn(role, f"{role}-{index}", args)

    def _spawn(self, role: str, name: str, args: list[str], command: tuple[str, ...] | None = None) -> Service:
        if self.spec.metrics:
            args = [*args, "--metrics-port", "0"]
        if self.spec.cache_dir:
            args = [*args, "--cache-dir", self.spec.cache_dir]
        log_path = self.log_dir / f"{name}.log"
        cmd = [sys.executable, *(command or ("-m", "tandem", "serve", role)), *args]
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log_path, "w"), text=True,
                                   start_new_session=True)
        service = Service(role, process, log_path)
        threading.Thread(target=self._read_stdout, args=(service,), daemon=True).start()
        self.services.append(service)
        return service

    @staticmethod
    def _read_stdout(service: Service) -> None:
        assert service.process.stdout is not None
        for line in service.process.stdout:
            match = READY.search(line)
            if match:
                service.port, service.metrics_port = int(match.group(2)), int(match.group(3))
                service.ready.set()

    def _wait(self, services: list[Service], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for service in services:
            while not service.ready.wait(timeout=0.2):
                if service.process.poll() is not None:
                    tail = service.log_path.read_text()[-3000:]
                    raise RuntimeError(f"{service.role} exited with code {service.process.returncode}:\n{tail}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{service.role} not ready after {timeout_s:.0f}s (log: {service.log_path})")


def wait_serving(address: str, timeout_s: float = 30.0) -> None:
    """Block until the server's grpc.health.v1 says SERVING."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} is not SERVING after {timeout_s:.0f}s")
            time.sleep(0.2)
