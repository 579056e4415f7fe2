"""Worker processes on a tiny model: they start, report TANDEM_READY, and serve their calls over gRPC.

Three processes on a 6-token model (with the tiny tokenizer of
``tests.tiny_models``): a target worker, a draft worker and the fault-injected
draft worker of ``tests.integration.faulty_draft_worker``, which must really
run with its coarse format and its double encoding.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime
from pathlib import Path

import grpc
import pytest
import torch

from tandem.device_key import shares_device
from tandem.rpc.distributions import decode_distributions
from tandem.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r"TANDEM_READY role=(\w+) port=(\d+) metrics_port=(\d+)")
VOCAB = 6
PROMPT = [0, 3, 2, 5]
WORKER_ARGS = ["--port", "0", "--host", "127.0.0.1", "--kv-cache-tokens", "1024", "--block-size", "4",
               "--threads", "1", "--log-level", "WARNING"]
DRAFT_ARGS = ["--quantization", "none", "--vocab", "0"]  # the draft's q is then the model's own softmax


class Worker:
    def __init__(self, name: str, command: list[str], log_path: Path) -> None:
        self.name = name
        self.log_path = log_path
        self.port: int | None = None
        self.metrics_port = 0  # 0: none served
        self.ready = threading.Event()
        self.lines: list[str] = []
        self.proc = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=log_path.open("w"),
                                     text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            match = READY.search(line)
            if match:
                self.port, self.metrics_port = int(match.group(2)), int(match.group(3))
                self.ready.set()

    def wait_ready(self, timeout_s: float) -> None:
        if not self.ready.wait(timeout_s):
            raise AssertionError(f"{self.name} not ready after {timeout_s}s; log:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(30)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    from tests.tiny_models import save_tiny_model, save_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny6")
    save_tiny_model(path, "qwen2", seed=3, vocab_size=VOCAB, bos_token_id=0, eos_token_id=1)
    return save_tiny_tokenizer(path, VOCAB, eos_token_id=1, bos_token_id=0)


@pytest.fixture(scope="module")
def workers(model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    serve = [sys.executable, "-m", "tandem", "serve"]
    shared = ["--startup-lock", str(logs / "startup.lock"), "--log-level", "INFO"]  # (the last --log-level wins)
    faulty = [sys.executable, "-m", "tests.integration.faulty_draft_worker", "--fault", "double-encoding"]
    started = {
        "target": Worker("target", [*serve, "target", "--model", str(model_dir), *WORKER_ARGS, *shared,
                                    "--metrics-port", "0"], logs / "target.log"),
        "draft": Worker("draft", [*serve, "draft", "--model", str(model_dir), *WORKER_ARGS, *DRAFT_ARGS, *shared],
                        logs / "draft.log"),
        "faulty": Worker("faulty", [*faulty, "--model", str(model_dir), *WORKER_ARGS, *DRAFT_ARGS],
                         logs / "faulty.log"),
    }
    try:
        for worker in started.values():
            worker.wait_ready(300)
        yield started
    finally:
        codes = {name: worker.stop() for name, worker in started.items()}
    assert codes == {"target": 0, "draft": 0, "faulty": 0}, codes  # SIGTERM drains and exits cleanly


def test_workers_sharing_a_startup_lock_load_and_warm_up_one_at_a_time(workers):
    """The target and the draft name one --startup-lock: each one's span from loading to warmed up (its
    calibration timings) overlaps no other's."""
    spans = []
    for name in ("target", "draft"):
        text = workers[name].log_path.read_text()
        start, end = (re.search(rf"^(\S+ \S+) .*{what}", text, re.M) for what in ("loading", "warmed up"))
        assert start and end, text[-2000:]
        spans.append(tuple(datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") for m in (start, end)))
    (a_start, a_end), (b_start, b_end) = sorted(spans)
    assert a_end <= b_start, spans


def stubs(port: int, stub_class):
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    return channel, stub_class(channel)


def sampling(seed: int) -> common_pb2.SamplingOptions:
    return common_pb2.SamplingOptions(temperature=1.0, seed=seed)


def test_workers_report_ready_with_a_port(workers):
    for name, role in (("target", "target"), ("draft", "draft"), ("faulty", "draft")):
        assert workers[name].port and f"role={role}" in workers[name].lines[0]


def test_workers_load_and_compute_on_one_thread(workers):
    """Ready means warmed up: a model loaded on one thread and warmed on another would have warned by now."""
    for name in ("target", "draft"):
        log_text = workers[name].log_path.read_text()
        assert "ComputeThreadWarning" not in log_text, log_text[-2000:]


def test_a_speculative_round_over_grpc(workers):
    t_channel, target = stubs(workers["target"].port, target_pb2_grpc.TargetWorkerStub)
    d_channel, draft = stubs(workers["draft"].port, draft_pb2_grpc.DraftWorkerStub)
    with t_channel, d_channel:
        t_info, d_info = target.Info(common_pb2.WorkerInfoRequest()), draft.Info(common_pb2.WorkerInfoRequest())
        assert t_info.vocab_size == d_info.vocab_size == VOCAB
        assert t_info.tokenizer_fingerprint == d_info.tokenizer_fingerprint and list(t_info.stop_token_ids) == [1]
        # idle workers say so: a coordinator whose call outlasts its hang timeout asks this before it moves a request
        for info in (t_info, d_info):
            assert info.HasField("step_running_s") and info.step_running_s == 0.0
        # Warmed up over several sizes, the fit has a line, and the last trusted one travels beside it.
        assert t_info.forward_base_s > 0 and t_info.last_forward_base_s > 0
        if t_info.forward_per_token_s > 0:
            assert t_info.last_forward_per_token_s == t_info.forward_per_token_s

        first = target.Prefill(target_pb2.PrefillRequest(seq_id="s", token_ids=PROMPT, sampling=sampling(1)))
        proposal = draft.Propose(draft_pb2.ProposeRequest(seq_id="s", committed_len=0,
                                                          new_tokens=[*PROMPT, first.next_token], k=2,
                                                          sampling=sampling(1)))
        assert len(proposal.tokens) == len(proposal.probs) == 2
        verdict = target.Verify(target_pb2.VerifyRequest(seq_id="s", committed_len=len(PROMPT) + 1,
                                                         draft_tokens=proposal.tokens, draft_probs=proposal.probs))
        assert 0 <= verdict.num_accepted <= 2 and 0 <= verdict.next_token < VOCAB
        # Both on this machine's CPUs: a coordinator prices the draft's steps as taken from the target's device;
        # each has computed, so its steps' calls are counted (one at a time here).
        t_info, d_info = target.Info(common_pb2.WorkerInfoRequest()), draft.Info(common_pb2.WorkerInfoRequest())
        assert t_info.device_key.startswith("cpu:") and shares_device(t_info.device_key, d_info.device_key)
        assert t_info.calls_per_batch >= 1.0 and d_info.calls_per_batch >= 1.0

        # Domain errors come back as their status codes.
        with pytest.raises(grpc.RpcError) as err:
            target.Verify(target_pb2.VerifyRequest(seq_id="nobody", committed_len=1))
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        with pytest.raises(grpc.RpcError) as err:
            target.Verify(target_pb2.VerifyRequest(seq_id="s", committed_len=len(PROMPT) + 1,
                                                   draft_tokens=proposal.tokens, draft_probs=proposal.probs[:1]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            draft.Propose(draft_pb2.ProposeRequest(seq_id="s", committed_len=99, k=1))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION

        for stub in (target, draft):
            assert stub.Release(common_pb2.ReleaseRequest(seq_id="s")).released
            assert not stub.Release(common_pb2.ReleaseRequest(seq_id="s")).released
            info = stub.Info(common_pb2.WorkerInfoRequest())
            assert info.active_sequences == 0 and info.free_blocks == info.total_blocks


def test_the_faulty_worker_sends_q_coarse_and_encoded_twice(workers, model_dir, monkeypatch):
    """Its reply decodes to encode(decode(encode(q))) in the coarse format: what its module doc promises."""
    from tandem.config import EngineConfig
    from tandem.engine import ForwardItem, ModelEngine
    from tandem.rpc import distributions
    from tests.integration import faulty_draft_worker

    channel, faulty = stubs(workers["faulty"].port, draft_pb2_grpc.DraftWorkerStub)
    with channel:
        reply = faulty.Propose(draft_pb2.ProposeRequest(seq_id="f", committed_len=0, new_tokens=PROMPT, k=1,
                                                        sampling=sampling(3)))
        faulty.Release(common_pb2.ReleaseRequest(seq_id="f"))
    received = decode_distributions(list(reply.probs), VOCAB)[0]

    engine = ModelEngine.load(EngineConfig(model_dir, dtype="float32", kv_cache_tokens=64, block_size=4))
    q = torch.softmax(engine.forward([ForwardItem("x", PROMPT)])[0], -1)  # [1, vocab]
    faulty_draft_worker.install(monkeypatch.setattr, "coarse")
    once = distributions.encode_for_sampling(q).dense()
    twice = decode_distributions(distributions.encode_distributions(once), VOCAB)
    assert torch.allclose(received, twice[0], atol=1e-6)
    assert (received - once[0]).abs().max() > 1e-2


def test_a_target_holds_a_prefill_that_asks_to_wait_for_room_until_a_release_frees_it(workers):
    """Through the worker process: with its pool full, a Prefill that asks for no hold is refused at once, and one
    that asks to wait for room (``wait_for_room_s``) is held (counted in Info's queue_depth and the metrics) and
    answered as soon as a release frees its room."""
    channel, target = stubs(workers["target"].port, target_pb2_grpc.TargetWorkerStub)
    prompts = {name: pattern * 100 for name, pattern in  # 400 tokens: 100 of the pool's 256 blocks of 4 tokens
               (("a", [2, 3, 4, 5]), ("b", [3, 4, 5, 2]), ("late", [4, 5, 2, 3]))}

    def prefill(name: str, wait_for_room_s: float = 0.0) -> target_pb2.PrefillRequest:
        return target_pb2.PrefillRequest(seq_id=name, token_ids=prompts[name], sampling=sampling(1),
                                         wait_for_room_s=wait_for_room_s)

    with channel:
        try:
            target.Prefill(prefill("a"))
            target.Prefill(prefill("b"))  # 200 blocks held, each keeping room to grow: no room for a third
            with pytest.raises(grpc.RpcError) as err:
                target.Prefill(prefill("late"))
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            held = target.Prefill.future(prefill("late", wait_for_room_s=60.0))
            # held: one call waiting and no batch running, in three looks in a row (a first look may catch the call
            # queued for its first try, or in it)
            idle_with_one = 0
            for _ in range(200):
                info = target.Info(common_pb2.WorkerInfoRequest())
                idle_with_one = idle_with_one + 1 if info.queue_depth == 1 and info.step_running_s == 0 else 0
                if idle_with_one == 3:
                    break
                time.sleep(0.05)
            assert idle_with_one == 3 and not held.done()
            # ...and so its metrics say, read as they are when scraped (an autoscaler's queue-depth signal)
            metrics = urllib.request.urlopen(f"http://127.0.0.1:{workers['target'].metrics_port}/metrics",
                                             timeout=10).read().decode()
            assert re.search(r"^tandem_target_queue_depth 1\.0$", metrics, re.M), metrics
            assert re.search(r"^tandem_target_held_for_room 1\.0$", metrics, re.M), metrics
            assert target.Release(common_pb2.ReleaseRequest(seq_id="a")).released
            assert 0 <= held.result(timeout=60).next_token < VOCAB  # admitted once "a" left, long before 60 s
        finally:
            for name in prompts:
                target.Release(common_pb2.ReleaseRequest(seq_id=name))
