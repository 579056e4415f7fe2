"""A throwaway redis-server for tests: a free loopback port, a temp dir, no persistence.

The tests kill and restart it (same port) to check how the shared cache
behaves while Redis is away and after it returns. With ``tls`` it serves TLS
only (no plaintext port), with the given certificate; clients are not asked
for certificates of their own (``tls-auth-clients no``: the password is the
client's credential).
"""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path


def find_redis_server() -> str | None:
    """The redis-server binary on PATH, or None."""
    return shutil.which("redis-server")


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class RedisTLS:
    cert: Path
    key: Path
    ca: Path


class RedisServer:
    """One redis-server process on ``127.0.0.1:port`` with its files in ``workdir``."""

    def __init__(self, binary: str, port: int, workdir: Path, password: str | None = None,
                 tls: RedisTLS | None = None) -> None:
        self.binary = binary
        self.port = port
        self.workdir = Path(workdir)
        self.password = password
        self.tls = tls
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``redis://`` (``rediss://`` with TLS) URL without the password (tests pass it separately)."""
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and wait until it answers PING."""
        ports = ["--port", str(self.port)]
        if self.tls:
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls.cert),
                     "--tls-key-file", str(self.tls.key), "--tls-ca-cert-file", str(self.tls.ca),
                     "--tls-auth-clients", "no"]
        args = [self.binary, *ports, "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout_s
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.workdir / "redis.log")
                tail = log.read_text()[-2000:] if log.exists() else ""
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Kill the server (SIGKILL: a crash, not a clean shutdown) and wait for it."""
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)
            self.process = None

    def restart(self) -> None:
        """Stop, then start again on the same port (empty: nothing is persisted)."""
        self.stop()
        self.start()

    def _answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as raw:
                s = raw
                if self.tls:  # only "is it up": the tests check the certificate through the real client
                    context = ssl.create_default_context(cafile=str(self.tls.ca))
                    s = context.wrap_socket(raw, server_hostname="127.0.0.1")
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
        except OSError:
            return False
        return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")
