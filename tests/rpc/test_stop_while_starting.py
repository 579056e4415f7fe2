"""A worker stopped while it starts (waiting its turn, loading, warming up) exits at once.

A container's PID 1 never receives a signal left at its default action: the kernel drops it. The
test gives the worker the same start (SIGTERM ignored, a disposition a child inherits through exec)
and holds the startup lock, so that the worker is certain to be starting when the signal comes.
"""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_a_worker_stopped_while_waiting_to_start_exits_at_once_even_as_pid_1(tmp_path):
    from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

    model = save_tiny_model(tmp_path / "model", "qwen2", seed=3, vocab_size=6, bos_token_id=0, eos_token_id=1)
    save_tiny_tokenizer(model, 6, eos_token_id=1, bos_token_id=0)
    lock = tmp_path / "startup.lock"
    held = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(held, fcntl.LOCK_EX)  # a worker beside it is warming up
    log = tmp_path / "worker.log"
    # SIGTERM ignored by a shell that then execs the worker: as PID 1, whose default action is none. (Not
    # preexec_fn: it runs Python in the forked child of a process with gRPC's threads, which crashed it once in CI.)
    worker = subprocess.Popen(
        ["sh", "-c", "trap '' TERM; exec \"$0\" \"$@\"", sys.executable, "-m", "tandem", "serve", "target",
         "--model", str(model), "--port", "0", "--host", "127.0.0.1", "--kv-cache-tokens", "256", "--block-size", "4",
         "--threads", "1", "--startup-lock", str(lock), "--log-level", "INFO"],
        cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=log.open("w"),
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        deadline = time.monotonic() + 60
        while "waiting for the workers beside it" not in log.read_text():
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.05)
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(10)  # ignored, it would wait here for the lock, then load and serve
        assert code == 128 + signal.SIGTERM
        assert "stopped by SIGTERM while starting" in log.read_text()
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        os.close(held)
