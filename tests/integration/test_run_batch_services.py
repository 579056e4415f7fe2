"""`tandem run-batch` as a user runs it: its own process, a JSONL file of requests, the shared SmolLM2 cluster's
coordinator over HTTP. Each answer is the one the same body gets sent on its own through the official client
(greedy: the same text), in the input's order."""

from __future__ import annotations

import json
import subprocess
import sys

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
