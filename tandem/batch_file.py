"""OpenAI's batch file format (the Batch API's JSONL, as `vllm run-batch` reads it): lines in, records out.

A line of the input asks for one request::

    {"custom_id": "q-1", "method": "POST", "url": "/v1/chat/completions", "body": {...}}

and the output has one record per line, in the input's order::

    {"id": "batch_req_...", "custom_id": "q-1",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

A request the server answered, whatever its status, has its answer in ``response``
(an error's body is the API's ``{"error": ...}``); ``error`` is for what never got
an answer: a line that is not a request, a server that could not be reached.

This module only reads lines and writes records; ``tandem.cli.run_batch`` sends them.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

# What a line may ask for: the coordinator's generation routes (coordinator/http/app.py).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
LINE_KEYS = frozenset({"custom_id", "method", "url", "body"})


@dataclass(frozen=True, slots=True)
class BatchRequest:
    index: int  # its place in the output (the input's order, blank lines left out)
    line_no: int  # 1-based, in the input
    custom_id: str
    url: str  # one of ENDPOINTS
    body: dict[str, Any]


@dataclass(frozen=True, slots=True)
class BadLine:
    index: int
    line_no: int
    custom_id: str | None  # when the line named one
    message: str  # what is wrong, naming the field


def read_lines(lines: Iterable[str]) -> Iterator[BatchRequest | BadLine]:
    """Each non-blank line as a request, or as what is wrong with it. A ``custom_id`` seen on an earlier line
    makes a later line bad (the output could not be matched to its input otherwise)."""
    first_seen: dict[str, int] = {}
    index = 0
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        parsed = _read_line(index, line_no, line)
        if isinstance(parsed, BatchRequest):
            earlier = first_seen.setdefault(parsed.custom_id, line_no)
            if earlier != line_no:
                parsed = BadLine(index, line_no, parsed.custom_id, f"line {line_no}: custom_id {parsed.custom_id!r} is "
                                 f"used by line {earlier} already; each must be unique")
        yield parsed
        index += 1


def _read_line(index: int, line_no: int, line: str) -> BatchRequest | BadLine:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        return BadLine(index, line_no, None, f"line {line_no} is not JSON: {exc.msg} at column {exc.colno}")
    if not isinstance(item, dict):
        return BadLine(index, line_no, None, f"line {line_no} must be a JSON object, got {type(item).__name__}")
    custom_id = item.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(index, line_no, None, f"line {line_no}: custom_id must be a non-empty string")

    def bad(message: str) -> BadLine:
        return BadLine(index, line_no, custom_id, f"line {line_no}: {message}")

    unknown = sorted(set(item) - LINE_KEYS)
    if unknown:
        return bad(f"unknown field {unknown[0]!r} (a line has custom_id, method, url and body)")
    if item.get("method") != "POST":
        return bad(f"method must be \"POST\", got {item.get('method')!r}")
    url = item.get("url")
    if url not in ENDPOINTS:
        return bad(f"url must be one of {', '.join(ENDPOINTS)}, got {url!r}")
    body = item.get("body")
    if not isinstance(body, dict):
        return bad(f"body must be a JSON object (the request {url} takes), got {type(body).__name__}")
    if body.get("stream"):
        return bad("body.stream: a batch request is answered whole; leave stream out or false")
    return BatchRequest(index, line_no, custom_id, url, body)


def answered(custom_id: str, status: int, body: Any, request_id: str) -> dict[str, Any]:
    """The record of a request the server answered (with any status)."""
    return {"id": _record_id(), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


def unanswered(custom_id: str | None, code: str, message: str) -> dict[str, Any]:
    """The record of a line that got no answer: ``code`` says why (invalid_request, connection_error, timeout)."""
    return {"id": _record_id(), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message}}


def _record_id() -> str:
    return f"batch_req_{uuid.uuid4().hex}"
