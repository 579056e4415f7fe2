"""A whole Tandem system as local processes: target and draft workers, then the coordinator.

Used by `tandem up`, by the integration tests and by the benchmarks, so that
all three start the system the same way. Every service is a real process
talking real gRPC on localhost; each announces itself with a
``TANDEM_READY role=... port=...`` line once it is serving.

How coordinators find the workers (``ClusterSpec.discovery``): ``static``
passes their addresses as flags; ``file`` writes a workers file
(``tandem.workers_file``) that coordinators follow, so that ``add_worker`` /
``remove_worker`` grow and shrink a fleet while it serves; ``given``: the
caller's ``coordinator_args`` say how (a test's Kubernetes stand-in).

A process that exits is not restarted here: ``replace`` starts another in its
place, and ``tandem.supervisor`` decides when (backoff, a bound on restarts).
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

from tandem.config import DEFAULT_KV_CACHE_TOKENS
from tandem.errors import TandemError
from tandem.parent_watch import LAUNCHER_ENV
from tandem.rpc.tls import ClientTLS, ServerTLS, open_channel
from tandem.workers_file import write_workers

# A coordinator with its HTTP API on adds http_port=; lines without it (every worker's) match too.
READY = re.compile(r"TANDEM_READY role=(\w+) port=(\d+) metrics_port=(\d+)(?: http_port=(\d+))?")
DISCOVERY = ("static", "file", "given")
CLI_ERROR = "tandem: error: "  # how a `tandem` command says why it refused to run (tandem/cli/__init__.py)
DRAIN_TIMEOUT_S = 60.0  # a removed worker gets this long to finish its requests before SIGTERM
JOIN_TIMEOUT_S = 30.0  # a coordinator reads the workers file twice a second and asks a new worker's Info at once
CO_LOCATED_SPIN_COUNT = 10_000  # GOMP_SPINCOUNT for services sharing cores: see LocalCluster._launch


class ServiceExited(TandemError, RuntimeError):
    """A process exited before it served; the message is the reason it gave (a bad flag, a model that does not load),
    else its log's end."""


class ServiceStartTimeout(TandemError, TimeoutError):
    """A process still not serving after the start timeout."""


@dataclass(slots=True)
class Service:
    role: str
    process: subprocess.Popen
    log_path: Path
    port: int = 0
    metrics_port: int = 0
    http_port: int = 0  # a coordinator's OpenAI-compatible HTTP API (--http-port); 0: off
    ready: threading.Event = field(default_factory=threading.Event)
    argv: list[str] = field(default_factory=list)  # its command line: what a replacement runs again

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """A coordinator's OpenAI-compatible API (its base URL for OpenAI clients); "" when it has none."""
        return f"http://127.0.0.1:{self.http_port}/v1" if self.http_port else ""

    @property
    def name(self) -> str:
        """``target-0``, ``coordinator``, ...: unique in its cluster (its log file is ``<name>.log``)."""
        return self.log_path.stem


@dataclass(slots=True)
class ClusterSpec:
    target: str  # model spec for the target workers
    draft: str | None = None
    port: int = 0  # coordinator port; 0 picks a free one
    target_replicas: int = 1
    draft_replicas: int = 1
    dtype: str = "auto"
    worker_threads: int | None = None
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS
    tensor_parallel_size: int = 1  # ranks per target worker (`tandem serve target --tensor-parallel-size`)
    metrics: bool = True
    # Pipelined drafting overlaps draft and verify; on one shared CPU the two processes then
    # slow each other down (measured: 7.5 vs 10.4 tok/s), so local clusters default to off.
    pipelining: bool = False
    coordinator_args: tuple[str, ...] = ()
    draft_args: tuple[str, ...] = ()  # extra `tandem serve draft` flags (quantization, vocabulary)
    target_args: tuple[str, ...] = ()  # extra `tandem serve target` flags (--heads)
    # The draft worker's command after the interpreter; tests swap in a fault-injecting wrapper that
    # takes the same flags.
    draft_command: tuple[str, ...] = ("-m", "tandem", "serve", "draft")
    worker_args: tuple[str, ...] = ()  # extra flags for every worker (batching)
    log_dir: Path | None = None
    cache_dir: str | None = None
    # TLS on every link (default: plaintext): every server presents server_tls (mutual TLS when it has a
    # client CA); the coordinator's worker links and the health checks here connect with client_tls.
    server_tls: ServerTLS | None = None
    client_tls: ClientTLS | None = None
    discovery: str = "static"  # static | file | given (see the module docstring)
    # A local cluster's operator is its user: replies and Info name the workers by address (tandem scale,
    # the tests and the benchmarks match them against the processes). False: opaque names, as by default.
    expose_worker_addresses: bool = True
    # The bearer token this launcher presents to its coordinators (Info, while workers join or leave), for
    # a coordinator started with --auth-token-file; None: it has no auth.
    coordinator_token: str | None = None

    def __post_init__(self) -> None:
        if self.target_replicas < 1 or self.draft_replicas < 0:
            raise ValueError("need at least one target replica and a non-negative number of draft replicas")
        if self.discovery not in DISCOVERY:
            raise ValueError(f"discovery must be one of {', '.join(DISCOVERY)}, got {self.discovery!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor-parallel size must be at least 1, got {self.tensor_parallel_size}")


class LocalCluster:
    """Start with ``start()`` (or ``with``); ``stop()`` sends SIGTERM to every process."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        self.services: list[Service] = []
        self.log_dir = spec.log_dir or Path(os.environ.get("TMPDIR", "/tmp")) / f"tandem-up-{os.getpid()}"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.workers_file = self.log_dir / "workers.json"  # what coordinators follow with discovery "file"
        self.startup_lock = self.log_dir / "startup.lock"  # locked by the worker loading and warming up
        self._spawned = {"target": 0, "draft": 0, "coordinator": 0}  # names stay unique as fleets change
        self._starting: list[Service] = []  # started, not yet serving (not in ``services``): stop() ends them too

    # ----- lifecycle --------------------------------------------------------
    def start(self, timeout_s: float = 900.0) -> str:
        """Start every service and wait until all are serving; returns the coordinator's address."""
        try:
            self.start_workers(timeout_s)
            return self.add_coordinator(self.spec.port, self.spec.coordinator_args, timeout_s).address
        except BaseException:
            self.stop()
            raise

    def start_workers(self, timeout_s: float = 900.0) -> None:
        """Start the spec's workers and wait until they serve (``start`` then adds the coordinator)."""
        workers = [self._spawn_worker("target") for _ in range(self.spec.target_replicas)]
        if self.spec.draft:
            workers += [self._spawn_worker("draft") for _ in range(self.spec.draft_replicas)]
        self.services.extend(workers)
        self._wait(workers, timeout_s)
        self._publish_workers()

    def add_coordinator(self, port: int = 0, extra_args: tuple[str, ...] = (), timeout_s: float = 120.0) -> Service:
        """One more coordinator over the same workers (replicas of the coordinator share nothing else)."""
        args = ["--tokenizer", self.spec.target, "--port", str(port)]
        if self.spec.expose_worker_addresses:
            args.append("--expose-worker-addresses")
        if self.spec.discovery == "static":
            args += [a for s in self.workers("target") for a in ("--target-addr", s.address)]
            args += [a for s in self.workers("draft") for a in ("--draft-addr", s.address)]
        elif self.spec.discovery == "file":
            args += ["--discovery", "file", "--workers-file", str(self.workers_file)]
        if not self.spec.pipelining:
            args.append("--no-pipelining")
        if self.spec.client_tls:
            args += self.spec.client_tls.flags("--worker-tls-")
        index = self._spawned["coordinator"]
        coordinator = self._spawn("coordinator", f"coordinator-{index}" if index else "coordinator",
                                  [*args, *extra_args])
        self.services.append(coordinator)
        self._wait([coordinator], timeout_s)
        wait_serving(coordinator.address, timeout_s=30, tls=self.spec.client_tls)
        return coordinator

    # ----- a fleet that grows and shrinks (discovery "file") -------------------------
    def add_workers(self, role: str, count: int = 1, timeout_s: float = 900.0) -> list[Service]:
        """Start ``count`` more workers of ``role``; once they serve, coordinators are told (the workers file);
        returns once the coordinators use them."""
        self._check_elastic(role)
        new = self._start_serving([self._spawn_worker(role) for _ in range(count)], timeout_s)
        self.services.extend(new)  # only now: a watcher of ``services`` never sees a half-started worker
        self._publish_workers()
        self._wait_coordinators({s.address for s in new}, joined=True, timeout_s=JOIN_TIMEOUT_S)
        return new

    def remove_workers(self, role: str, count: int = 1, drain_timeout_s: float = DRAIN_TIMEOUT_S) -> list[Service]:
        """Take the newest ``count`` workers of ``role`` out of the workers file, wait until no coordinator
        has a request on them (or ``drain_timeout_s``), then SIGTERM them."""
        self._check_elastic(role)
        workers = self.workers(role)
        if count > len(workers) or (role == "target" and count >= len(workers)):
            raise ValueError(f"cannot remove {count} of {len(workers)} {role} workers"
                             + (" (at least one target must stay)" if role == "target" else ""))
        leaving = workers[len(workers) - count:]
        for service in leaving:
            self.services.remove(service)
        self._publish_workers()
        self._wait_coordinators({s.address for s in leaving}, joined=False, timeout_s=drain_timeout_s)
        self._terminate(leaving, grace_s=15.0)
        return leaving

    def replace(self, dead: Service, timeout_s: float = 900.0) -> Service:
        """Start a new process in place of ``dead`` (one of ``services`` that exited) and return it once it
        serves and has taken ``dead``'s place: a worker gets a new port, and coordinators are told through
        the workers file (returns once they use it); a coordinator comes back on the port it had. Raises
        RuntimeError or TimeoutError if the new process exits or does not come up (``dead`` stays)."""
        if dead not in self.services:
            raise ValueError(f"{dead.name} is not a service of this cluster")
        if dead.process.poll() is None:
            raise ValueError(f"{dead.name} (pid {dead.process.pid}) is still running")
        if dead.role != "coordinator":
            self._check_elastic(dead.role)
        argv = list(dead.argv)
        if dead.role == "coordinator":  # its clients know its port: the same again (it was 0 if picked)
            argv[argv.index("--port") + 1] = str(dead.port)
            if dead.http_port:  # and so do its HTTP clients
                argv[argv.index("--http-port") + 1] = str(dead.http_port)
        name = f"{dead.role}-{self._spawned[dead.role]}"
        [new] = self._start_serving([self._launch(dead.role, name, argv)], timeout_s)
        self.services[self.services.index(dead)] = new
        if new.role == "coordinator":
            wait_serving(new.address, timeout_s=30, tls=self.spec.client_tls)
        else:
            self._publish_workers()
            self._wait_coordinators({new.address}, joined=True, timeout_s=JOIN_TIMEOUT_S)
        return new

    def _start_serving(self, new: list[Service], timeout_s: float) -> list[Service]:
        """Wait until ``new`` (just started) serve; if one does not, stop them all and raise."""
        self._starting.extend(new)
        try:
            self._wait(new, timeout_s)
        except BaseException:
            self._terminate(new, grace_s=5.0)
            raise
        finally:
            for service in new:
                self._starting.remove(service)
        return new

    def _check_elastic(self, role: str) -> None:
        if self.spec.discovery != "file":
            raise ValueError("workers can be added or removed only when coordinators follow the workers file "
                             "(ClusterSpec.discovery='file')")
        if role not in ("target", "draft"):
            raise ValueError(f"role must be target or draft, got {role!r}")
        if role == "draft" and not self.spec.draft:
            raise ValueError("this cluster has no draft model: it cannot have draft workers")

    def _publish_workers(self) -> None:
        if self.spec.discovery == "file":
            write_workers(self.workers_file, {role: [s.address for s in self.workers(role)]
                                              for role in ("target", "draft")})

    def _wait_coordinators(self, addresses: set[str], joined: bool, timeout_s: float) -> None:
        """Until every coordinator uses these workers (``joined``: listed and healthy), or no longer lists
        them (it closes a leaving one once its requests have finished); at most ``timeout_s``."""
        from tandem.client import TandemClient

        deadline = time.monotonic() + timeout_s
        for coordinator in self.workers("coordinator"):
            with TandemClient(coordinator.address, timeout_s=10, tls=self.spec.client_tls,
                              token=self.spec.coordinator_token) as client:
                while time.monotonic() < deadline:
                    try:
                        info = client.info()
                    except grpc.RpcError:
                        break  # a coordinator that does not answer has nothing to wait for
                    states = {w.address: w.state for w in [*info.target_workers, *info.draft_workers]}
                    if joined and all(states.get(a) == "healthy" for a in addresses):
                        break
                    if not joined and not addresses & states.keys():
                        break
                    time.sleep(0.2)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the coordinator and let it drain, then the workers its requests still needed (and any
        process still starting)."""
        every = [*self.services, *self._starting]
        self._terminate([s for s in every if s.role == "coordinator"], grace_s)
        self._terminate([s for s in every if s.role != "coordinator"], grace_s)

    @staticmethod
    def _terminate(group: list[Service], grace_s: float) -> None:
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
    def _spawn_worker(self, role: str) -> Service:
        model = self.spec.target if role == "target" else self.spec.draft
        assert model is not None
        index = self._spawned[role]
        # Workers here share this machine's cores: they come up one at a time (tandem.rpc.startup_lock).
        args = ["--model", model, "--port", "0", "--dtype", self.spec.dtype,
                "--kv-cache-tokens", str(self.spec.kv_cache_tokens), "--startup-lock", str(self.startup_lock)]
        if self.spec.worker_threads:
            args += ["--threads", str(self.spec.worker_threads)]
        args += self.spec.worker_args
        if role == "target" and self.spec.tensor_parallel_size > 1:
            args += ["--tensor-parallel-size", str(self.spec.tensor_parallel_size)]
        if role == "target":
            args += self.spec.target_args
        if role == "draft":
            args += self.spec.draft_args
            return self._spawn(role, f"{role}-{index}", args, self.spec.draft_command)
        return self._spawn(role, f"{role}-{index}", args)

    def _spawn(self, role: str, name: str, args: list[str], command: tuple[str, ...] | None = None) -> Service:
        if self.spec.metrics:
            args = [*args, "--metrics-port", "0"]
        if self.spec.cache_dir:
            args = [*args, "--cache-dir", self.spec.cache_dir]
        if self.spec.server_tls:
            args = [*args, *self.spec.server_tls.flags()]
        return self._launch(role, name, [sys.executable, *(command or ("-m", "tandem", "serve", role)), *args])

    def _launch(self, role: str, name: str, cmd: list[str]) -> Service:
        log_path = self.log_dir / f"{name}.log"
        # A session of its own (a terminal's Ctrl-C reaches only us, and we stop services in order),
        # and our pid, so that a service stops itself if we are killed before we can stop it.
        env = {**os.environ, LAUNCHER_ENV: str(os.getpid())}
        # The services share this machine's cores, one computing thread each (tandem.compute_thread). An
        # OpenMP worker waits for the next parallel region by spinning, 300,000 spins by default (about 3
        # ms), so two workers computing at once stole the cores from each other; waiting passively instead
        # (OMP_WAIT_POLICY=PASSIVE) made every op of a forward pay a wake-up: a target step 84 -> 92-107
        # ms on 2 cores. 10,000 spins (~0.1 ms) spans the gaps between a forward's ops, not the gaps
        # between calls. Workers also come up one at a time (--startup-lock). A pod keeps the default.
        if "OMP_WAIT_POLICY" not in env:
            env.setdefault("GOMP_SPINCOUNT", str(CO_LOCATED_SPIN_COUNT))
        process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log_path, "w"), text=True,
                                   start_new_session=True, env=env)
        self._spawned[role] += 1
        service = Service(role, process, log_path, argv=cmd)
        threading.Thread(target=self._read_stdout, args=(service,), daemon=True).start()
        return service

    @staticmethod
    def _read_stdout(service: Service) -> None:
        assert service.process.stdout is not None
        for line in service.process.stdout:
            match = READY.search(line)
            if match:
                service.port, service.metrics_port = int(match.group(2)), int(match.group(3))
                service.http_port = int(match.group(4) or 0)
                service.ready.set()

    def _wait(self, services: list[Service], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for service in services:
            while not service.ready.wait(timeout=0.2):
                if service.process.poll() is not None:
                    raise ServiceExited(_exit_message(service))
                if time.monotonic() > deadline:
                    raise ServiceStartTimeout(f"{service.role} not ready after {timeout_s:.0f}s "
                                              f"(log: {service.log_path})")


def _exit_message(service: Service) -> str:
    """Why a service exited while starting: the reason it gave (its CLI's last "tandem: error:" line), else the end
    of its log (a traceback, a signal)."""
    tail = service.log_path.read_text(errors="replace")[-3000:]
    exited = f"{service.role} exited with code {service.process.returncode} while starting"
    reasons = [line.removeprefix(CLI_ERROR) for line in tail.splitlines() if line.startswith(CLI_ERROR)]
    if reasons:
        return f"{exited}: {reasons[-1]} (its log: {service.log_path})"
    return f"{exited}; its log ({service.log_path}) ends:\n{tail}"


def wait_serving(address: str, timeout_s: float = 30.0, tls: ClientTLS | None = None) -> None:
    """Block until the server's grpc.health.v1 says SERVING (over TLS with ``tls``)."""
    deadline = time.monotonic() + timeout_s
    with open_channel(address, tls) as channel:
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
