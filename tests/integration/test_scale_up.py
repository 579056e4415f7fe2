"""`tandem up` grows and shrinks a fleet while it serves, and its coordinator never restarts.

The real commands as a user runs them: `tandem up` (one target), then `tandem
scale --target-replicas 2`, then back to 1, while a client keeps sending
greedy requests. Every request is answered with the same tokens; requests
reach the new replica once it has joined; after the shrink the coordinator
lists only the first replica and the removed worker is gone. Run on a tiny
random model (fast: `make test`) and on SmolLM2 (a real model: the long tier,
`make test-long`).
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from tandem.client import TandemClient
from tests.integration.traffic import Traffic, until, until_used

READY = re.compile(r"ready: .* --addr (\S+)")


@pytest.fixture(params=["tiny", pytest.param("smollm2", marks=[pytest.mark.slow, pytest.mark.long])])
def model(request, tmp_path_factory) -> tuple[Path, str | list[int]]:
    """(model directory, prompt): the prompt in the model's own terms."""
    if request.param == "smollm2":
        return request.getfixturevalue("smollm2_dir"), "Write a story about a cat."
    from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny6")
    save_tiny_model(path, "qwen2", seed=3, vocab_size=6, bos_token_id=0, eos_token_id=1)
    return save_tiny_tokenizer(path, 6, eos_token_id=1, bos_token_id=0), [0, 3, 2, 5, 4]


def tandem(*args: str, cache: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem", *args, "--cache-dir", str(cache)],
                          capture_output=True, text=True, timeout=900)


def test_tandem_up_grows_and_shrinks_a_fleet_while_serving(model, tmp_path):
    model_dir, prompt = model
    cache, logs = tmp_path / "cache", tmp_path / "logs"
    up = subprocess.Popen([sys.executable, "-m", "tandem", "up", "--target", str(model_dir), "--draft", "none",
                           "--port", "0", "--kv-cache-tokens", "2048", "--worker-threads", "1",
                           "--log-dir", str(logs), "--cache-dir", str(cache)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output = Output(up)
    try:
        address = _wait_ready(up, output)
        port = address.rsplit(":", 1)[1]
        with Traffic(address, [prompt]) as traffic:  # shorter than a block: no prefix key, so load places it
            [reference] = traffic.take_references()
            first_target = reference.stats.target_worker
            traffic.start()

            grown = tandem("scale", "--port", port, "--target-replicas", "2", cache=cache)
            assert grown.returncode == 0, grown.stderr
            targets = re.search(r"target\s+2: (\S+) (\S+)", grown.stdout).groups()
            new_target = next(t for t in targets if t != first_target)
            with TandemClient(address, timeout_s=60) as client:
                assert {w.address: w.state for w in client.info().target_workers} == {
                    first_target: "healthy", new_target: "healthy"}  # joined without a coordinator restart
                used = until_used(traffic, new_target)
                assert used, f"no request reached the new replica {new_target}"

                shrunk = tandem("scale", "--port", port, "--target-replicas", "1", "--drain-timeout", "120",
                                cache=cache)
                assert shrunk.returncode == 0, shrunk.stderr
                assert re.search(rf"target\s+1: {re.escape(first_target)}\n", shrunk.stdout)
                assert [w.address for w in client.info().target_workers] == [first_target]
                after = len(traffic.replies)
                until(lambda: len(traffic.replies) >= after + 3, 120)
        assert not traffic.errors, traffic.errors[:3]
        assert not traffic.wrong_replies()
        assert traffic.workers(after) == {first_target}
        with pytest.raises(grpc.FutureTimeoutError):  # the removed worker was stopped
            grpc.channel_ready_future(grpc.insecure_channel(new_target)).result(timeout=2)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=120)
        output.thread.join(timeout=10)
    assert up.returncode == 0, output.tail()
    assert not list((cache / "run").glob("up-*.json"))  # its state file goes with it


class Output:
    """Every line a process prints, read on a thread (so its pipe never fills)."""

    def __init__(self, process: subprocess.Popen) -> None:
        self.lines: list[str] = []
        self.thread = threading.Thread(target=lambda: self.lines.extend(process.stdout), daemon=True)
        self.thread.start()

    def tail(self) -> str:
        return "".join(self.lines[-60:])


def _wait_ready(up: subprocess.Popen, output: Output, timeout_s: float = 900.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in list(output.lines):
            if match := READY.search(line):
                return match.group(1)
        if up.poll() is not None:
            raise AssertionError("tandem up exited:\n" + output.tail())
        time.sleep(0.2)
    raise AssertionError("tandem up not ready:\n" + output.tail())
