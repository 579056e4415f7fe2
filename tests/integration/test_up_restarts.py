"""`tandem up` outlives one of its processes: the request moves, the fleet keeps serving, the process comes back.

The real command as a user runs it, on a tiny random model: `tandem up` with two
target replicas, a long greedy stream, and the replica serving it killed with
SIGKILL mid-stream. The stream must finish with the target-only output (the
coordinator moved it), `tandem up` must keep running and say it restarts the
worker, and the fleet must be two serving target replicas again afterwards.
Then the same with every link secured (mutual TLS, a token: `tandem up`'s
security flags): `tandem scale` still works, and a killed coordinator comes
back on its port.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys

import grpc
import pytest

from tandem.cli.scale import call
from tandem.client import TandemClient, build_request
from tandem.up_admin import state_file
from tandem.v1 import common_pb2, target_pb2_grpc
from tests.integration.test_scale_up import Output, _wait_ready
from tests.integration.traffic import until

pytestmark = pytest.mark.slow  # real processes (tiny models: each test takes seconds on a quiet machine)

PROMPT = [0, 3, 2, 5, 4]
TOKENS = 480  # one verification round a token (no speculation): the stream lasts long enough to kill into
WORKER = re.compile(r"^\s+target\s+(\S+)\s+metrics :\d+\s+pid (\d+)$")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny6")
    save_tiny_model(path, "qwen2", seed=3, vocab_size=6, bos_token_id=0, eos_token_id=1)
    return save_tiny_tokenizer(path, 6, eos_token_id=1, bos_token_id=0)


@pytest.fixture(scope="module")
def reference(model_dir) -> list[int]:
    """The target-only greedy output of PROMPT, in process."""
    from tandem.config import EngineConfig
    from tandem.engine import ModelEngine
    from tandem.inprocess import GenerationRequest, SpeculativeGenerator

    engine = ModelEngine.load(EngineConfig(model_dir))
    return SpeculativeGenerator(engine).generate([GenerationRequest(PROMPT, TOKENS)])[0].token_ids


def request():
    return build_request(PROMPT, max_new_tokens=TOKENS, ignore_eos=True, method="none")


def holds_a_sequence(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        info = target_pb2_grpc.TargetWorkerStub(channel).Info(common_pb2.WorkerInfoRequest(), timeout=10)
    return info.active_sequences > 0


def tandem_up(model_dir, tmp_path, *flags: str) -> tuple[subprocess.Popen, Output]:
    up = subprocess.Popen([sys.executable, "-m", "tandem", "up", "--target", str(model_dir), "--draft", "none",
                           "--port", "0", "--kv-cache-tokens", "2048", "--worker-threads", "1",
                           "--log-dir", str(tmp_path / "logs"), "--cache-dir", str(tmp_path / "cache"), *flags],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return up, Output(up)


def test_killing_the_serving_target_of_two_mid_stream_keeps_tandem_up_serving(model_dir, reference, tmp_path):
    cache = tmp_path / "cache"
    up, output = tandem_up(model_dir, tmp_path, "--target-replicas", "2", "--log-stats-interval", "1")
    try:
        address = _wait_ready(up, output, timeout_s=300)
        pids = {m.group(1): int(m.group(2)) for line in output.lines if (m := WORKER.match(line))}
        assert len(pids) == 2, output.tail()
        with TandemClient(address, timeout_s=120) as client:
            tokens, stats, killed = [], None, None
            for chunk in client.stream(request()):
                tokens.extend(chunk.token_ids)
                if chunk.HasField("stats"):
                    stats = chunk.stats
                if killed is None and len(tokens) >= 16:
                    killed = next(a for a in pids if holds_a_sequence(a))
                    os.kill(pids[killed], signal.SIGKILL)
            assert killed is not None and stats is not None
            assert tokens == reference  # moved to the other replica, rebuilt, went on
            assert stats.target_moves == 1 and stats.target_worker != killed
            state_path = state_file(cache, int(address.rsplit(":", 1)[1]))
            assert up.poll() is None and state_path.exists(), "tandem up stopped:\n" + output.tail()
            state = json.loads(state_path.read_text())
            admin, secret = state["admin"], state["secret"]

            def two_serving() -> bool:
                targets = call(admin, "/fleet", secret=secret)["target"]
                states = {w.address: w.state for w in client.info().target_workers}
                return len(targets) == 2 and killed not in targets and all(
                    states.get(t) == "healthy" for t in targets)

            assert until(two_serving, timeout_s=120), output.tail()
            assert re.search(r"target-\d \(\S+, pid \d+\) exited \(code -9\); restarting it", "".join(output.lines))
            again = client.generate(build_request(PROMPT, max_new_tokens=8, ignore_eos=True, method="none"))
            assert list(again.token_ids) == tokens[:8]  # the fleet serves as before
            # the coordinator's stats lines, shown on tandem up's own output as it logs them
            assert until(lambda: any(" stats: " in line and " finished (" in line for line in output.lines),
                         timeout_s=30), output.tail()
        assert "stopping" not in "".join(output.lines), output.tail()  # nothing stopped until asked to
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=120)
        output.thread.join(timeout=10)
    assert up.returncode == 0, output.tail()


def test_under_mutual_tls_and_a_token_tandem_scale_works_and_a_killed_coordinator_comes_back(model_dir, reference,
                                                                                              tmp_path):
    from tandem.rpc.tls import ClientTLS
    from tests.tls_certs import make_pki

    pki = make_pki(tmp_path / "pki")
    token_file = tmp_path / "tokens"
    token_file.write_text("client-one-0123456789abcdef\n")
    up, output = tandem_up(
        model_dir, tmp_path, "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
        "--tls-client-ca", str(pki.ca), "--worker-tls-ca", str(pki.ca), "--worker-tls-cert", str(pki.client_cert),
        "--worker-tls-key", str(pki.client_key), "--auth-token-file", str(token_file))
    short = build_request(PROMPT, max_new_tokens=8, ignore_eos=True, method="none")
    try:
        address = _wait_ready(up, output, timeout_s=300)
        tls = ClientTLS(ca=pki.ca, cert=pki.client_cert, key=pki.client_key)
        with TandemClient(address, timeout_s=60, tls=tls) as anonymous, pytest.raises(grpc.RpcError) as refused:
            anonymous.generate(short)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # the coordinator got the token file
        with TandemClient(address, timeout_s=60) as plaintext, pytest.raises(grpc.RpcError):
            plaintext.generate(short)  # and the certificate
        with TandemClient(address, timeout_s=60, tls=tls, token="client-one-0123456789abcdef") as client:
            assert list(client.generate(short).token_ids) == reference[:8]  # the coordinator reaches its workers

            port = address.rsplit(":", 1)[1]
            grown = subprocess.run([sys.executable, "-m", "tandem", "scale", "--port", port, "--target-replicas",
                                    "2", "--cache-dir", str(tmp_path / "cache")], capture_output=True, text=True,
                                   timeout=300)
            assert grown.returncode == 0, grown.stderr
            assert [w.state for w in client.info().target_workers] == ["healthy", "healthy"]  # joined over TLS

            [coordinator_pid] = [int(ln.split("pid")[1]) for ln in output.lines if ln.split()[:1] == ["coordinator"]]
            os.kill(coordinator_pid, signal.SIGKILL)

            def answers() -> bool:
                try:
                    return list(client.generate(short).token_ids) == reference[:8]
                except grpc.RpcError:
                    return False

            assert until(answers, timeout_s=120), output.tail()  # the same address, the same output
            assert re.search(r"coordinator-1 \(\S+, pid \d+\) serving in place of coordinator", "".join(output.lines))
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=120)
        output.thread.join(timeout=10)
    assert up.returncode == 0, output.tail()
