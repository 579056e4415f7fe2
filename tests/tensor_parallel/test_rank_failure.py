"""A tensor-parallel target worker never hangs on a lost rank: it exits, so that it is restarted.

A real ``tandem serve target --tensor-parallel-size 2`` process (gloo) on a tiny model,
real gRPC calls while a rank is killed or frozen; each test bounds every wait.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from tandem.parallel.ranks import RANK_FAILED_EXIT_CODE
from tandem.v1 import target_pb2, target_pb2_grpc
from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

pytestmark = pytest.mark.alone  # ranks in lockstep: `make test` runs them after the rest, alone

REPO_ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"TANDEM_READY role=target port=(\d+)")
RANKS = re.compile(r"TANDEM_RANKS 1=(\d+)")
START_TIMEOUT_S = 120
EXIT_WITHIN_S = 15  # the watchdog polls every 0.25 s; the worker gets 5 s to stop its server
# --rank-timeout: the frozen rank's test waits it out (the default, 30 s, would be idle time in `make test`).
RANK_TIMEOUT_S = 6.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = save_tiny_model(tmp_path_factory.mktemp("tp-worker"), "qwen2", seed=5)
    return save_tiny_tokenizer(path, 97)


class TensorParallelWorker:
    def __init__(self, model_dir: Path, log_path: Path) -> None:
        self.log_path = log_path
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tandem", "serve", "target", "--model", str(model_dir), "--port", "0",
             "--host", "127.0.0.1", "--tensor-parallel-size", "2", "--dtype", "float32", "--threads", "1",
             "--kv-cache-tokens", "1024", "--block-size", "4", "--rank-timeout", str(RANK_TIMEOUT_S)],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log_path.open("w"), text=True,
            start_new_session=True,  # a process group of its own, as in a terminal or a container
        )
        self.port = self.rank1_pid = 0
        self.ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()
        if not self.ready.wait(START_TIMEOUT_S):
            self.proc.kill()
            pytest.fail(f"worker not ready in {START_TIMEOUT_S}s:\n{log_path.read_text()[-3000:]}")

    def _read(self) -> None:
        for line in self.proc.stdout:
            if match := RANKS.search(line):
                self.rank1_pid = int(match.group(1))
            if match := READY.search(line):
                self.port = int(match.group(1))
                self.ready.set()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.rank1_pid and alive(self.rank1_pid):
            os.kill(self.rank1_pid, signal.SIGKILL)


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie waiting for a parent that may never reap it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "State:\tZ" not in status


class Requests:
    """Prefill and Verify calls in a loop, as a coordinator would send them, until the worker is gone."""

    def __init__(self, port: int) -> None:
        self.codes: list[grpc.StatusCode] = []
        self.answered = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(port,), daemon=True)
        self._thread.start()

    def _loop(self, port: int) -> None:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = target_pb2_grpc.TargetWorkerStub(channel)
            n = 0
            while not self._stop.is_set():
                n += 1
                try:
                    first = stub.Prefill(target_pb2.PrefillRequest(seq_id=f"s{n}", token_ids=[3, 4, 5, 6]),
                                         timeout=60).next_token
                    stub.Verify(target_pb2.VerifyRequest(seq_id=f"s{n}", committed_len=5, draft_tokens=[first, 7]),
                                timeout=60)
                    self.answered += 1
                except grpc.RpcError as exc:
                    self.codes.append(exc.code())
                    time.sleep(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(70)


def wait_exit(proc: subprocess.Popen, timeout_s: float) -> int:
    try:
        return proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the worker did not exit within {timeout_s:.0f}s of losing a rank (it hangs)")


def test_rank_killed_during_requests_makes_the_worker_exit(model_dir: Path, tmp_path: Path) -> None:
    worker = TensorParallelWorker(model_dir, tmp_path / "worker.log")
    try:
        requests = Requests(worker.port)
        while requests.answered < 3:  # serving, with calls in flight
            time.sleep(0.05)
        os.kill(worker.rank1_pid, signal.SIGKILL)
        killed = time.monotonic()
        code = wait_exit(worker.proc, EXIT_WITHIN_S)
        took = time.monotonic() - killed
        requests.stop()
        log = worker.log_path.read_text()
        assert code == RANK_FAILED_EXIT_CODE, log[-3000:]
        assert "tensor-parallel worker failing" in log  # the watchdog or the failed collective, whichever first
        assert grpc.StatusCode.UNAVAILABLE in requests.codes  # the coordinator moves such requests elsewhere
        print(f"worker exited {took:.1f}s after its rank was killed")
    finally:
        worker.close()


def test_frozen_rank_fails_the_worker_after_the_rank_timeout(model_dir: Path, tmp_path: Path) -> None:
    """A rank that stops answering (SIGSTOP) is taken for dead once a collective has waited --rank-timeout for it,
    not sooner (a slow rank is not a dead one) and not much later (the worker does not hang)."""
    worker = TensorParallelWorker(model_dir, tmp_path / "worker.log")
    try:
        os.kill(worker.rank1_pid, signal.SIGSTOP)
        frozen_at = time.monotonic()
        requests = Requests(worker.port)
        code = wait_exit(worker.proc, RANK_TIMEOUT_S + EXIT_WITHIN_S)
        took = time.monotonic() - frozen_at
        requests.stop()
        assert code == RANK_FAILED_EXIT_CODE, worker.log_path.read_text()[-3000:]
        assert took >= RANK_TIMEOUT_S, f"the worker gave up on its rank after {took:.1f}s, before --rank-timeout"
        assert grpc.StatusCode.UNAVAILABLE in requests.codes
    finally:
        worker.close()


def test_ranks_exit_when_rank_zero_dies(model_dir: Path, tmp_path: Path) -> None:
    worker = TensorParallelWorker(model_dir, tmp_path / "worker.log")
    try:
        worker.proc.kill()  # rank 0, SIGKILL: no chance to stop its children
        worker.proc.wait(10)
        deadline = time.monotonic() + EXIT_WITHIN_S
        while alive(worker.rank1_pid):
            if time.monotonic() > deadline:
                pytest.fail(f"rank 1 (pid {worker.rank1_pid}) outlived rank 0 by {EXIT_WITHIN_S}s: an orphan")
            time.sleep(0.1)
    finally:
        worker.close()


def test_sigterm_to_the_process_group_drains_and_stops_every_rank(model_dir: Path, tmp_path: Path) -> None:
    """Ctrl-C or a container stop signals every rank; only rank 0 acts on it, and everyone exits cleanly."""
    worker = TensorParallelWorker(model_dir, tmp_path / "worker.log")
    try:
        os.killpg(worker.proc.pid, signal.SIGTERM)
        code = wait_exit(worker.proc, 30)
        assert code == 0, worker.log_path.read_text()[-3000:]
        deadline = time.monotonic() + EXIT_WITHIN_S
        while alive(worker.rank1_pid):
            assert time.monotonic() < deadline, "rank 1 outlived a clean shutdown"
            time.sleep(0.1)
        assert "failing" not in worker.log_path.read_text()
    finally:
        worker.close()
