"""OpenAI's Responses API replies: the ``response`` object, and its stream of typed events.

A response's ``output`` is its items in order: the assistant's text as a ``message`` item (one
``output_text`` part), each tool call as a ``function_call`` item (``call_id`` is the call's id,
which a ``function_call_output`` item answers). ``status`` is ``completed``, or ``incomplete``
with ``incomplete_details.reason: max_output_tokens`` when the length limit ended it.

Streamed (server-sent events, each ``event: <type>`` and its JSON, numbered by
``sequence_number``): ``response.created`` and ``response.in_progress``; per item
``response.output_item.added``, its content (``response.content_part.added``, then
``response.output_text.delta`` as the text comes, ``.done``s; or a call's
``response.function_call_arguments.delta`` as its arguments are written, then ``.done``),
``response.output_item.done``; last ``response.completed`` (or ``response.incomplete``) with the
whole response. A call starts a new item, so a message item is closed before it; text after a
call opens another. A failure after the first byte is an ``error`` event, then ``response.failed``.
A response that is not streamed is the last event's: the same items, ids and order.

Asked (``include: ["message.output_text.logprobs"]``), an ``output_text`` part carries the
log-probability of each of its tokens with ``top_logprobs`` alternatives (chat completions'
entries), and each ``response.output_text.delta`` those of the tokens it brings. A token whose
text is still held back (a character not finished, text that may start a call) comes with the
next delta; a function call's tokens are not scored anywhere (OpenAI scores output text alone).
The coordinator's messages do not say which of their tokens are a call's, so a round that ends
the text and starts a call in one message leaves that round's text tokens unscored too.
"""

from __future__ import annotations

import time
from typing import Any

from coordinator.http.errors import ApiError
from coordinator.http.responses import Choice, TokenTexts, tandem_stats, usage
from tandem.v1 import generation_pb2


class ResponseShapes:
    """The replies of one Responses request (``echo``: the request fields the response object repeats)."""

    def __init__(self, request_id: str, model: str, echo: dict[str, Any], logprobs: TokenTexts | None = None
                 ) -> None:
        self.request_id = request_id
        self.logprobs = logprobs  # asked (include message.output_text.logprobs): how tokens show; None: not asked
        self.id = "resp_" + request_id
        self.created = int(time.time())
        self.model = model
        self.echo = echo

    def response(self, choice: Choice | None, output: list[dict[str, Any]], status: str | None = None
                 ) -> dict[str, Any]:
        """The response object; ``choice`` None: not finished (``in_progress``, or ``status``)."""
        incomplete = None
        if status is None:
            status = "in_progress"
            if choice is not None:
                status = "incomplete" if choice.finish_reason == "length" else "completed"
        if status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        body: dict[str, Any] = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "error": None, "incomplete_details": incomplete, "store": False,
            "truncation": "disabled", "reasoning": None, **self.echo,
            "usage": None if choice is None else response_usage(choice)}
        if choice is not None:
            body["tandem"] = tandem_stats(choice.stats)
        return body


class ResponseStream:
    """The events of one response, as its stream messages arrive (``Choice.add`` first); the last event's
    ``response`` is the whole response, so a response that is not streamed is built the same way."""

    def __init__(self, shapes: ResponseShapes) -> None:
        self.shapes = shapes
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # every output item so far, in order
        self.text_item: dict[str, Any] | None = None  # the message item being written
        self.calls: dict[str, dict[str, Any]] = {}  # a call's id -> its item
        self.scores: list[dict[str, Any]] = []  # asked: log-probabilities of tokens whose text has not come yet

    def opening(self) -> list[dict[str, Any]]:
        started = self.shapes.response(None, [])
        return [self._event("response.created", response=started),
                self._event("response.in_progress", response=started)]

    def feed(self, choice: Choice, msg: generation_pb2.GenerateStreamResponse) -> list[dict[str, Any]]:
        events = []
        if self.shapes.logprobs is not None:
            self.scores += self.shapes.logprobs.entries(list(msg.token_ids), list(msg.logprobs))
            if msg.tool_call_deltas or msg.tool_calls:  # a call's tokens: OpenAI scores output_text alone
                self.scores = []
        if msg.text:
            events += self._text(msg.text)
        for delta in msg.tool_call_deltas:
            events += self._call_piece(delta.id, delta.name, delta.arguments)
        for call in msg.tool_calls:
            if call.id not in self.calls:  # written otherwise than name, then arguments: it comes whole
                events += self._call_piece(call.id, call.name, call.arguments)
            events += self._call_done(call)
        if msg.finish_reason:
            events += self._close_text()
            final = self.shapes.response(choice, self.items)
            kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
            events.append(self._event(kind, response=final))
        return events

    def final(self, choice: Choice) -> dict[str, Any]:
        """The whole response once every message has been fed."""
        self._close_text()
        return self.shapes.response(choice, self.items)

    def failure(self, error: ApiError) -> list[dict[str, Any]]:
        failed = self.shapes.response(None, self.items, status="failed")
        failed["error"] = {"code": error.code or error.kind, "message": error.message}
        return [self._event("error", code=error.code, message=error.message, param=error.param),
                self._event("response.failed", response=failed)]

    # ----- items -----------------------------------------------------------------------
    def _text(self, text: str) -> list[dict[str, Any]]:
        events = []
        item = self.text_item
        if item is None:
            item = self.text_item = message_item(f"msg_{self.shapes.request_id}_{len(self.items)}", "", "in_progress")
            self.items.append(item)
            events += [self._event("response.output_item.added", output_index=self._index(item), item=_empty(item)),
                       self._event("response.content_part.added", item_id=item["id"], output_index=self._index(item),
                                   content_index=0, part=_part(""))]
        part = item["content"][0]
        part["text"] += text
        scores, self.scores = self.scores, []
        part["logprobs"] += scores
        events.append(self._event("response.output_text.delta", item_id=item["id"], output_index=self._index(item),
                                  content_index=0, delta=text, logprobs=scores))
        return events

    def _close_text(self) -> list[dict[str, Any]]:
        item, self.text_item = self.text_item, None
        if item is None:
            return []
        item["status"] = "completed"
        part = item["content"][0]
        part["logprobs"] += self.scores  # tokens held back for text that never came (an unfinished character)
        self.scores = []
        index = self._index(item)
        return [self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                            text=part["text"], logprobs=part["logprobs"]),
                self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                            part=dict(part)),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _call_piece(self, call_id: str, name: str, arguments: str) -> list[dict[str, Any]]:
        events = []
        item = self.calls.get(call_id)
        if item is None:
            events += self._close_text()
            item = self.calls[call_id] = call_item(call_id, name, "", "in_progress")
            self.items.append(item)
            events.append(self._event("response.output_item.added", output_index=self._index(item), item=dict(item)))
        if arguments:
            item["arguments"] += arguments
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self._index(item), delta=arguments))
        return events

    def _call_done(self, call: generation_pb2.ToolCall) -> list[dict[str, Any]]:
        """A call complete: its arguments are what its deltas carried, as the model wrote them (the same JSON value
        as ``call.arguments``, which spells it canonically)."""
        item = self.calls[call.id]
        item["status"] = "completed"
        index = self._index(item)
        return [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            name=call.name, arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item)]

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, other in enumerate(self.items) if other is item)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": [_part(text)]}


def call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": "fc_" + call_id.removeprefix("call_"), "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def response_usage(choice: Choice) -> dict[str, Any]:
    counted = usage([choice])
    return {"input_tokens": counted["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": counted["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens": counted["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counted["total_tokens"]}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _empty(item: dict[str, Any]) -> dict[str, Any]:
    """A message item as it is announced: no content yet."""
    return {**item, "content": []}
