"""`tandem run-batch` (tandem/cli/run_batch.py) against the coordinator's real HTTP API over a scripted target:
a record per line in the input's order, the API's refusals kept as answers, 429s tried again, a failed start
that writes nothing."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from tandem.cli import main
from tandem.cli.run_batch import api_base, check_reachable, send_all, session
from tandem.errors import InvalidRequestError
from tests.coordinator.inprocess import tiny_tokenizer
from tests.http.harness import MODEL, http_coordinator

TEXT = "&(*,"  # the scripted target's tokens as the tiny tokenizer spells them
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return tiny_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def line(custom_id: str, url: str = "/v1/chat/completions", body: dict | None = None) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": CHAT if body is None else body})


class Lines(list):
    """What send_all writes, a record a line."""

    def write(self, text: str) -> None:
        self.extend(json.loads(part) for part in text.splitlines())

    def flush(self) -> None:
        pass


async def send(running, lines: list[str], concurrency: int = 4, retries: int = 3) -> tuple[Lines, object]:
    out = Lines()
    async with session(None, 30.0) as client:
        summary = await send_all(client, lines, out, api_base(running.url), concurrency, retries)
    return out, summary


def test_every_line_gets_its_record_in_the_input_order_bad_lines_and_refusals_included(tokenizer):
    lines = [line("chat"),
             line("completion", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 4}),
             "{not json",
             line("streamed", body={**CHAT, "stream": True}),
             line("chat"),  # its custom_id again
             line("too-many", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}),
             line("response", "/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4})]

    async def go():
        async with http_coordinator(tokenizer) as running:
            return await send(running, lines)

    records, summary = asyncio.run(go())
    assert [r["custom_id"] for r in records] == ["chat", "completion", None, "streamed", "chat", "too-many",
                                                 "response"]
    chat, completion, not_json, streamed, again, refused, response = records
    assert chat["response"]["status_code"] == 200 and chat["error"] is None
    assert chat["response"]["body"]["object"] == "chat.completion"
    assert chat["response"]["body"]["choices"][0]["message"]["content"] == TEXT
    assert chat["response"]["request_id"].startswith("batch-")  # sent as X-Request-Id, answered as such
    assert completion["response"]["body"]["choices"][0]["text"] == TEXT
    (message,) = response["response"]["body"]["output"]
    assert response["response"]["body"]["object"] == "response" and message["content"][0]["text"] == TEXT
    # an answer with an error status is an answer: its status and the API's own error body
    assert refused["response"]["status_code"] == 400 and refused["error"] is None
    assert refused["response"]["body"]["error"]["param"] == "max_tokens"
    # lines that are no request got no answer: error, and no response
    for record, says in ((not_json, "line 3 is not JSON"), (streamed, "body.stream"),
                         (again, "custom_id 'chat' is used by line 1 already")):
        assert record["response"] is None and record["error"]["code"] == "invalid_request"
        assert says in record["error"]["message"]
    assert len({r["id"] for r in records}) == len(records)
    assert summary.line() == "7 requests: 3 answered 200, 1 answered 400, 3 invalid_request"


def test_refusals_over_the_clients_concurrency_limit_are_tried_again(tokenizer):
    async def go(retries: int):
        async with http_coordinator(tokenizer, max_concurrent_per_client=1) as running:
            running.target.gate.clear()  # the first request holds the client's one slot ...
            sending = asyncio.ensure_future(send(running, [line(f"q{i}") for i in range(3)], retries=retries))
            await asyncio.sleep(0.5)  # ... while the others are refused (429)
            running.target.gate.set()
            return await sending

    records, _ = asyncio.run(go(retries=5))
    assert [r["response"]["status_code"] for r in records] == [200, 200, 200]
    records, summary = asyncio.run(go(retries=0))
    refused = [r for r in records if r["response"]["status_code"] == 429]
    assert len(refused) == 2 and summary.ok == 1
    assert all(r["response"]["body"]["error"]["code"] == "rate_limit_exceeded" for r in refused)


def test_a_server_that_is_not_there_or_refuses_the_token_is_said_before_anything_is_sent(tokenizer):
    async def go():
        async with http_coordinator(tokenizer, tokens=("tok-a-0123456789abcdef",)) as running:
            async with session(None, 5.0) as client:
                with pytest.raises(InvalidRequestError, match="refused the bearer token"):
                    await check_reachable(client, api_base(running.url))
            async with session("tok-a-0123456789abcdef", 5.0) as client:
                await check_reachable(client, api_base(running.url))
            async with session(None, 5.0) as client:
                with pytest.raises(InvalidRequestError, match="cannot reach the coordinator's HTTP API"):
                    await check_reachable(client, "http://127.0.0.1:1")

    asyncio.run(go())


def test_the_command_writes_the_records_file_and_says_how_many_of_each(tokenizer, tmp_path, capsys):
    requests, records = tmp_path / "requests.jsonl", tmp_path / "records.jsonl"
    requests.write_text("\n".join([line("a"), "", line("b"), "[]"]) + "\n")

    async def go():
        async with http_coordinator(tokenizer) as running:
            # (the command runs its own event loop: in a thread, beside the coordinator's)
            return await asyncio.to_thread(main, ["run-batch", "-i", str(requests), "-o", str(records),
                                                  "--url", running.url])

    assert asyncio.run(go()) == 1  # one line was no request
    written = [json.loads(text) for text in records.read_text().splitlines()]
    assert [(r["custom_id"], r["error"] and r["error"]["code"]) for r in written] == [
        ("a", None), ("b", None), (None, "invalid_request")]
    assert f"3 requests: 2 answered 200, 1 invalid_request; records in {records}" in capsys.readouterr().err


@pytest.mark.parametrize(("flags", "says"), [
    (["--concurrency", "0"], "--concurrency must be at least 1"),
    (["--url", "127.0.0.1:8000"], "--url must be the coordinator's http:// or https:// address"),
    (["-o", "SAME"], "--output is --input"),
    (["--target", "smollm2", "--url", "http://127.0.0.1:8000"], "--url and --target: give one"),
    (["--draft", "smollm2"], "--draft and --served-model-name go with --target"),
    (["--target", "smollm2", "--served-model-name", "a", "a"], "--served-model-name gives 'a' more than once"),
    (["--resume", "-o", "-"], "--resume needs --input and --output to be files"),
])
def test_bad_flags_are_refused_naming_them_and_nothing_is_written(tmp_path, capsys, flags, says):
    requests = tmp_path / "requests.jsonl"
    requests.write_text(line("a") + "\n")
    flags = [str(requests) if f == "SAME" else f for f in flags]
    out = tmp_path / "records.jsonl"
    assert main(["run-batch", "-i", str(requests), "-o", str(out), *flags]) == 2
    assert says in capsys.readouterr().err
    assert not out.exists() and requests.read_text() == line("a") + "\n"


def test_a_coordinator_that_is_not_there_leaves_an_existing_output_as_it_was(tmp_path, capsys):
    requests, out = tmp_path / "requests.jsonl", tmp_path / "records.jsonl"
    requests.write_text(line("a") + "\n")
    out.write_text("earlier records\n")
    assert main(["run-batch", "-i", str(requests), "-o", str(out), "--url", "http://127.0.0.1:1"]) == 2
    assert "cannot reach the coordinator's HTTP API at http://127.0.0.1:1" in capsys.readouterr().err
    assert out.read_text() == "earlier records\n"


def test_resume_goes_on_after_the_records_an_earlier_run_wrote_and_drops_a_line_cut_off(tokenizer, tmp_path, capsys):
    requests, records = tmp_path / "requests.jsonl", tmp_path / "records.jsonl"
    requests.write_text("".join(line(custom_id) + "\n" for custom_id in ("a", "b", "c")))
    earlier = json.dumps({"id": "batch_req_earlier", "custom_id": "a", "response": {"status_code": 200},
                          "error": None})
    records.write_text(earlier + "\n" + '{"id": "batch_req_cut", "custom_id": "b", "resp')  # killed mid-write

    async def go():
        async with http_coordinator(tokenizer) as running:
            return await asyncio.to_thread(main, ["run-batch", "-i", str(requests), "-o", str(records),
                                                  "--url", running.url, "--resume"])

    assert asyncio.run(go()) == 0
    written = [json.loads(text) for text in records.read_text().splitlines()]
    assert [r["custom_id"] for r in written] == ["a", "b", "c"] and written[0]["id"] == "batch_req_earlier"
    assert all(r["response"]["status_code"] == 200 for r in written)
    err = capsys.readouterr().err
    assert "holds the records of the first 1 lines" in err and "2 requests: 2 answered 200" in err


@pytest.mark.parametrize(("held", "says"), [
    ([{"custom_id": "other"}], "record 1 of .* is for custom_id 'other', but line 1 of .* is 'a'"),
    ([{"custom_id": "a"}, {"custom_id": "b"}], "holds 2 records, more than the 1 requests"),
])
def test_resume_refuses_records_that_are_not_this_inputs_and_changes_nothing(tmp_path, capsys, held, says):
    requests, records = tmp_path / "requests.jsonl", tmp_path / "records.jsonl"
    requests.write_text(line("a") + "\n")
    text = "".join(json.dumps(r) + "\n" for r in held) + '{"cut'
    records.write_text(text)
    assert main(["run-batch", "-i", str(requests), "-o", str(records), "--resume", "--url", "http://127.0.0.1:1"]) == 2
    assert re.search(says, capsys.readouterr().err) and records.read_text() == text
