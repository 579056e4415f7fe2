"""OpenAI's batch file format (tandem.batch_file): which lines are requests, what is wrong with the others."""

from __future__ import annotations

import json

import pytest

from tandem.batch_file import BadLine, BatchRequest, answered, read_lines, unanswered

CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}


def line(**fields) -> str:
    return json.dumps({"custom_id": "q", "method": "POST", "url": "/v1/chat/completions", "body": CHAT, **fields})


def test_a_request_line_keeps_its_place_and_blank_lines_take_none():
    items = list(read_lines([line(custom_id="a"), "", "   \n", line(custom_id="b", url="/v1/completions",
                                                                       body={"prompt": "x"})]))
    assert items == [BatchRequest(0, 1, "a", "/v1/chat/completions", CHAT),
                     BatchRequest(1, 4, "b", "/v1/completions", {"prompt": "x"})]


@pytest.mark.parametrize(("text", "custom_id", "says"), [
    ("{not json", None, "line 1 is not JSON"),
    ("[1, 2]", None, "must be a JSON object, got list"),
    (json.dumps({"method": "POST", "url": "/v1/completions", "body": {}}), None, "custom_id must be a non-empty"),
    (line(custom_id=""), None, "custom_id must be a non-empty"),
    (line(method="GET"), "q", "method must be \"POST\", got 'GET'"),
    (line(url="/v1/embeddings"), "q", "url must be one of /v1/chat/completions, /v1/completions, /v1/responses"),
    (line(url="/chat/completions"), "q", "got '/chat/completions'"),
    (line(body="Hi"), "q", "body must be a JSON object"),
    (line(body={**CHAT, "stream": True}), "q", "body.stream"),
    (line(extra=1), "q", "unknown field 'extra'"),
])
def test_a_line_that_is_not_a_request_says_what_is_wrong(text, custom_id, says):
    (item,) = read_lines([text])
    assert isinstance(item, BadLine) and item.custom_id == custom_id and item.index == 0 and item.line_no == 1
    assert says in item.message


def test_a_custom_id_used_twice_makes_the_later_line_bad_naming_the_first():
    items = list(read_lines([line(custom_id="a"), line(custom_id="b"), line(custom_id="a")]))
    assert [type(i) for i in items] == [BatchRequest, BatchRequest, BadLine]
    assert "line 3: custom_id 'a' is used by line 1 already" in items[2].message and items[2].index == 2


def test_records_are_openais_shape():
    ok = answered("a", 200, {"object": "chat.completion"}, "req-1")
    assert ok["id"].startswith("batch_req_") and ok["error"] is None
    assert ok["response"] == {"status_code": 200, "request_id": "req-1", "body": {"object": "chat.completion"}}
    bad = unanswered("b", "invalid_request", "line 2: ...")
    assert bad["response"] is None and bad["error"] == {"code": "invalid_request", "message": "line 2: ..."}
    assert ok["id"] != answered("a", 200, {}, "req-1")["id"]
