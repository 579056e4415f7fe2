"""A throwaway redis-server for tests: a free loopback port, a temp dir, no persistence.

The tests kill and restart it (same port) to check how the shared cache
behaves while Redis is away and after it returns.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


def find_redis_server() -> str | None:
    """The redis-server binary on PATH, or None."""
    return shutil.which("redis-server")


def free_port() -> int:
    """A TCP port nobody listens on right now (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process on ``127.0.0.1:port`` with its files in ``workdir``."""

    def __init__(self, binary: str, port: int, workdir: Path, password: str | None = None) -> None:
        self.binary = binary
        self.port = port
        self.workdir = Path(workdir)
        self.password = password
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """``redis://`` URL without the password (tests pass it separately when they want one)."""
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> None:
        """Start the server and wait until it answers PING."""
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
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
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                reply = s.recv(64)
        except OSError:
            return False
        return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")
