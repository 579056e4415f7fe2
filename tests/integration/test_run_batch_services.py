"""`tandem run-batch` as a user runs it: its own process, a JSONL file of requests, the shared SmolLM2 cluster's
coordinator over HTTP. Each answer is the one the same body gets sent on its own through the official client
(greedy: the same text), in the input's order. And what the coordinator's log says of such work: its stats lines."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest

from tests.integration.conftest import PROMPTS

pytestmark = pytest.mark.slow


def test_a_batch_file_through_the_command_answers_each_line_as_the_api_answers_it_alone(shared_cluster, tmp_path):
    url = shared_cluster.coordinator.http_url
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120) as api:
        [card] = api.models.list().data
        bodies = [{"model": card.id, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16,
                   "temperature": 0} for prompt in PROMPTS[:3]]
        alone = [api.chat.completions.create(**body).choices[0].message.content for body in bodies]
    requests, records = tmp_path / "requests.jsonl", tmp_path / "records.jsonl"
    lines = [{"custom_id": f"q{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
             for i, body in enumerate(bodies)]
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))

    done = subprocess.run([sys.executable, "-m", "tandem", "run-batch", "-i", str(requests), "-o", str(records),
                           "--url", url, "--concurrency", "3"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "3 requests: 3 answered 200" in done.stderr
    written = [json.loads(text) for text in records.read_text().splitlines()]
    assert [r["custom_id"] for r in written] == ["q0", "q1", "q2"]
    assert [r["response"]["body"]["choices"][0]["message"]["content"] for r in written] == alone
    assert all(r["response"]["body"]["usage"]["completion_tokens"] > 0 for r in written)


def test_the_coordinator_logs_a_stats_line_while_it_works(shared_cluster, shared_client):
    """Its --log-stats-interval (10 s by default): a line saying what the interval ran, in the process's own log."""
    from tandem.client import build_request

    log_path = shared_cluster.coordinator.log_path

    def stats_lines() -> list[str]:
        return [text for text in log_path.read_text(errors="replace").splitlines()
                if "coordinator.stats_log: stats: " in text and " finished (" in text]

    before = len(stats_lines())
    shared_client.generate(build_request(PROMPTS[0], max_new_tokens=8))
    deadline = time.monotonic() + 30
    while len(stats_lines()) == before:
        assert time.monotonic() < deadline, "no stats line within 30 s of a request"
        time.sleep(0.5)
    line = stats_lines()[-1]
    assert "tokens/s generated" in line and "target KV" in line


def test_with_target_the_command_starts_a_system_of_its_own_and_stops_it(tiny_served_dir, tmp_path):
    """--target: real workers and a coordinator started for the batch (the tiny served model: what is tested is the
    plumbing), answering under the name the lines were written for, and gone when the command returns."""
    model = shutil.copytree(tiny_served_dir, tmp_path / "model")  # (its path names this test's processes alone)
    requests, records = tmp_path / "requests.jsonl", tmp_path / "records.jsonl"
    body = {"model": "gpt-4o-mini", "max_tokens": 4, "temperature": 0}
    lines = [{"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
              "body": {**body, "messages": [{"role": "user", "content": "hi"}]}},
             {"custom_id": "completion", "method": "POST", "url": "/v1/completions", "body": {**body, "prompt": "hi"}}]
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    done = subprocess.run([sys.executable, "-m", "tandem", "run-batch", "-i", str(requests), "-o", str(records),
                           "--target", str(model), "--served-model-name", "gpt-4o-mini",
                           "--cache-dir", str(tmp_path / "cache")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "2 requests: 2 answered 200" in done.stderr
    written = [json.loads(text) for text in records.read_text().splitlines()]
    assert [(r["custom_id"], r["response"]["body"]["model"]) for r in written] == [
        ("chat", "gpt-4o-mini"), ("completion", "gpt-4o-mini")]
    assert all(r["response"]["body"]["usage"]["completion_tokens"] == 4 for r in written)
    assert not [pid for pid in os.listdir("/proc") if pid.isdigit() and str(model) in _cmdline(pid)], \
        "processes of the system it started are still running"


def _cmdline(pid: str) -> str:
    try:
        return (Path("/proc") / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
