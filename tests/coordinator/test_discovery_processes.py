"""Discovery end to end on tiny models: a coordinator process following EndpointSlices (the Kubernetes
stand-in) over real target worker processes; replicas join, one with another tokenizer is refused, a
draft Service that lists a target worker is refused too (so `auto` stays n-gram), and a terminating
replica gets no new requests and drops out once its slice goes."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client import TandemClient, build_request
from tandem.workers_file import write_workers
from tests.kube_api_stub import KubeApiStub, endpoint, endpoint_slice
from tests.rpc.test_worker_processes import VOCAB, WORKER_ARGS, Worker

NS = "tandem"
PROMPT = [0, 3, 2, 5, 4, 3]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

    dirs = {}
    for name, vocab in (("ours", VOCAB), ("other", VOCAB + 2)):  # another vocabulary: another fingerprint
        path = tmp_path_factory.mktemp(name)
        save_tiny_model(path, "qwen2", seed=3, vocab_size=vocab, bos_token_id=0, eos_token_id=1)
        dirs[name] = save_tiny_tokenizer(path, vocab, eos_token_id=1, bos_token_id=0)
    return dirs


@pytest.fixture(scope="module")
def fleet(model_dirs, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    serve = [sys.executable, "-m", "tandem", "serve", "target"]
    workers = {name: Worker(name, [*serve, "--model", str(model_dirs[model]), *WORKER_ARGS], logs / f"{name}.log")
               for name, model in (("t1", "ours"), ("t2", "ours"), ("stranger", "other"))}
    try:
        for worker in workers.values():
            worker.wait_ready(300)
        yield workers
    finally:
        for worker in workers.values():
            worker.stop()


def worker_slice(name: str, worker: Worker, **conditions) -> dict:
    """One slice per worker: all listen on 127.0.0.1, and a slice's port is every endpoint's port."""
    return endpoint_slice(f"targets-{name}", "targets", [endpoint("127.0.0.1", **conditions)], worker.port)


def wait_until(client: TandemClient, predicate, timeout_s: float = 60.0, role: str = "target"):
    """Until ``predicate`` holds for {address: state} of the coordinator's ``role`` replicas."""
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.info()
        if predicate({w.address: w.state for w in getattr(info, f"{role}_workers")}):
            return info
        if time.monotonic() > deadline:
            raise AssertionError(f"coordinator never got there: {info.target_workers}")
        time.sleep(0.2)


def generate(client: TandemClient):
    return client.generate(build_request(PROMPT, max_new_tokens=8, ignore_eos=True, method="none"))


def test_replicas_join_a_stranger_is_refused_and_a_terminating_one_drains_away(model_dirs, fleet, tmp_path):
    t1, t2, stranger = (f"127.0.0.1:{fleet[n].port}" for n in ("t1", "t2", "stranger"))
    with KubeApiStub() as api:
        api.apply(NS, worker_slice("t1", fleet["t1"]))
        # The draft Service names a target worker by mistake: never used as a draft.
        api.apply(NS, endpoint_slice("drafts-x", "drafts", [endpoint("127.0.0.1")], fleet["t2"].port))
        coordinator = Worker("coordinator", [
            sys.executable, "-m", "tandem", "serve", "coordinator", "--expose-worker-addresses",
            "--tokenizer", str(model_dirs["ours"]),
            "--discovery", "kubernetes", "--target-service", "targets", "--draft-service", "drafts", "--namespace", NS,
            "--kubeconfig", str(api.kubeconfig(tmp_path / "kubeconfig")), "--host", "127.0.0.1", "--port", "0",
            "--metrics-port", "0"], tmp_path / "coordinator.log")
        try:
            coordinator.wait_ready(120)
            with TandemClient(f"127.0.0.1:{coordinator.port}", timeout_s=60) as client:
                first = generate(client)
                assert first.stats.target_worker == t1
                info = wait_until(client, lambda s: s == {t2: "rejected"}, role="draft")
                assert {w.address for w in info.target_workers} == {t1}  # the drafts' slice is not the targets'
                auto = client.generate(build_request(PROMPT, max_new_tokens=4, ignore_eos=True))
                assert auto.stats.method == "ngram" and not auto.stats.draft_worker

                api.apply(NS, worker_slice("t2", fleet["t2"]))
                api.apply(NS, worker_slice("stranger", fleet["stranger"]))
                wait_until(client, lambda s: s.get(t2) == "healthy" and s.get(stranger) == "rejected")

                api.apply(NS, worker_slice("t1", fleet["t1"], ready=False, terminating=True))
                wait_until(client, lambda s: s.get(t1) != "healthy")
                replies = [generate(client) for _ in range(4)]
                assert {r.stats.target_worker for r in replies} == {t2}  # never the leaving one, nor the stranger
                assert all(list(r.token_ids) == list(first.token_ids) for r in replies)

                api.delete(NS, "targets-t1")
                wait_until(client, lambda s: t1 not in s)  # idle, so closed at once
                metrics = _scrape(coordinator)
                assert 'tandem_coordinator_replicas{role="target",state="healthy"} 1.0' in metrics
                assert 'tandem_coordinator_replicas{role="target",state="rejected"} 1.0' in metrics
        finally:
            assert coordinator.stop() == 0


def _scrape(coordinator: Worker) -> str:
    port = re.search(r"metrics_port=(\d+)", coordinator.lines[0]).group(1)
    return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()


def test_a_coordinator_with_no_worker_yet_is_not_serving_and_still_stops_on_sigterm(model_dirs, tmp_path):
    workers_file = tmp_path / "workers.json"
    write_workers(workers_file, {"target": []})  # a fleet scaled to zero, or not scheduled yet
    log = tmp_path / "coordinator.log"
    process = subprocess.Popen([sys.executable, "-m", "tandem", "serve", "coordinator", "--expose-worker-addresses",
                                "--tokenizer",
                                str(model_dirs["ours"]), "--discovery", "file", "--workers-file", str(workers_file),
                                "--host", "127.0.0.1", "--port", "0"], stderr=log.open("w"), text=True)
    try:
        deadline = time.monotonic() + 60
        while not (match := re.search(r"listening on port (\d+)", log.read_text())):
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        with grpc.insecure_channel(f"127.0.0.1:{match.group(1)}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
