"""OpenAI's response shapes, built from the service's stream messages (``GenerateStreamResponse``).

A whole completion (``chat.completion`` / ``text_completion``) or its stream of
chunks (``chat.completion.chunk``; completions stream ``text_completion``
objects too), the usage, the log-probabilities in each endpoint's format, and
Tandem's extension: each choice's ``tandem`` field holds its request's
statistics (``GenerationStats``: drafted, accepted, rounds, method, ...) plus
``acceptance`` (accepted / drafted).

A token's text in log-probabilities is the token decoded alone (a byte-level
token that ends inside a character shows U+FFFD there), and ``bytes`` its UTF-8.

Completions' ``echo``: each choice's text starts with its prompt (the string sent,
or the token ids decoded); with ``logprobs``, its log-probabilities start with the
prompt's tokens, the first with ``null`` (nothing comes before it), the others the
target's (``sampling.prompt_logprobs``). Streamed, the first chunk of a choice
carries them.

vLLM's ``prompt_logprobs`` (not streamed): per prompt token, ``null`` for the first, else
``{token id: {logprob, rank, decoded_token}}`` for the token and its most likely alternatives
(rank: 1 + how many tokens are more likely); on each completions choice, and once at the top of
a chat completion, as vLLM places them.

vLLM's ``return_token_ids``: the prompt's tokens (``prompt_token_ids``: at the top of a chat completion, on each
completions choice; streamed, on the first chunk) and each choice's generated tokens (``token_ids``; streamed, each
chunk's new ones; with echo, the prompt's first), so a client (an RL trainer) has the very tokens the model read
and wrote, not a re-tokenization of the text.
"""

from __future__ import annotations

import time
from typing import Any

from google.protobuf import json_format

from tandem.v1 import common_pb2, generation_pb2


class Choice:
    """One choice's output as its messages arrive."""

    def __init__(self, index: int, prompt: int = 0) -> None:
        self.index = index
        self.prompt = prompt  # which of the request's prompts (completions take a list)
        self.prompt_ids: list[int] = []  # asked (echo with logprobs): the prompt's tokens and their scores
        self.prompt_logprobs: list[common_pb2.TokenLogprobs] = []
        self.echoed = False  # echo: its prompt's text went out (streamed: in its first chunk)
        self.echoed_logprobs = False  # echo with logprobs: its prompt's scores went out
        self.texts: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[common_pb2.TokenLogprobs] = []
        self.tool_calls: list[generation_pb2.ToolCall] = []
        self.call_index: dict[str, int] = {}  # a call's id -> its index among the choice's calls, as streamed
        self.finish_reason: str | None = None
        self.stats: generation_pb2.GenerationStats | None = None
        self.text_offset = 0  # completions' logprobs: where the next token's text starts in this choice's text

    def add(self, msg: generation_pb2.GenerateStreamResponse) -> None:
        self.texts.append(msg.text)
        self.token_ids.extend(msg.token_ids)
        self.logprobs.extend(msg.logprobs)
        self.tool_calls.extend(msg.tool_calls)
        self.prompt_ids.extend(msg.prompt_token_ids)
        self.prompt_logprobs.extend(msg.prompt_logprobs)
        if msg.finish_reason:
            self.finish_reason = msg.finish_reason
            self.stats = msg.stats

    @property
    def text(self) -> str:
        return "".join(self.texts)


def share_prompt_scores(choices: list[Choice], n: int) -> None:
    """Each prompt's first choice's prompt scores (and the tokens they score) given to the prompt's other choices,
    which did not ask for them (``ParsedRequest.scores_each_prompt_once``)."""
    for choice in choices:
        first = choices[choice.index - choice.index % n]
        if first is not choice:
            choice.prompt_ids, choice.prompt_logprobs = list(first.prompt_ids), list(first.prompt_logprobs)


class Shapes:
    """The JSON objects of one request's reply (``chat``: the chat endpoint's; else the completions')."""

    def __init__(self, chat: bool, request_id: str, model: str, tokenizer: Any, logprobs: int | None,
                 echo: list[str | list[int]] | None = None, prompt_logprobs: int | None = None,
                 token_ids: bool = False, tokens_as_ids: bool = False, continuous_usage: bool = False) -> None:
        self.chat = chat
        self.echo = echo  # completions' echo: the request's prompts, each choice's text starts with its own
        self.id = ("chatcmpl-" if chat else "cmpl-") + request_id
        self.created = int(time.time())
        self.model = model
        self.tokenizer = tokenizer
        self.logprobs = logprobs  # None: not asked
        self.prompt_logprobs = prompt_logprobs  # vLLM's prompt_logprobs: alternatives per prompt token; None: not asked
        self.texts = TokenTexts(tokenizer, tokens_as_ids)
        self.token_ids = token_ids  # vLLM's return_token_ids: prompt_token_ids and each choice's token_ids
        self.continuous_usage = continuous_usage  # vLLM's stream_options.continuous_usage_stats: usage on each chunk

    # ----- whole -------------------------------------------------------------------
    def completion(self, choices: list[Choice], n: int = 1) -> dict[str, Any]:
        out = []
        for c in choices:
            item: dict[str, Any] = {"index": c.index}
            if self.chat:
                # As OpenAI: content null when the turn is only calls; tool_calls only when there are some.
                item["message"] = {"role": "assistant", "content": c.text if c.text or not c.tool_calls else None,
                                   "refusal": None}
                if c.tool_calls:
                    item["message"]["tool_calls"] = [_call(call) for call in c.tool_calls]
            else:
                item["text"] = self._echo(c) + c.text
            item["logprobs"] = self._logprobs(c, c.token_ids, c.logprobs)
            item["finish_reason"] = c.finish_reason or "length"
            if self.prompt_logprobs is not None and not self.chat:
                item["prompt_logprobs"] = self._prompt_scores(c)
            if self.token_ids:
                if not self.chat:
                    item["prompt_token_ids"] = c.prompt_ids
                item["token_ids"] = [*c.prompt_ids, *c.token_ids] if self.echo is not None else c.token_ids
            item["tandem"] = tandem_stats(c.stats)
            out.append(item)
        body = {**self._head(chat_object="chat.completion"), "choices": out, "usage": usage(choices, n)}
        if self.prompt_logprobs is not None and self.chat:  # vLLM's place: one conversation, scored once
            body["prompt_logprobs"] = self._prompt_scores(choices[0]) if choices else None
        if self.token_ids and self.chat:  # vLLM's place: the conversation's tokens, once
            body["prompt_token_ids"] = choices[0].prompt_ids if choices else None
        return body

    def _prompt_scores(self, choice: Choice) -> list[dict[str, dict[str, Any]] | None]:
        """vLLM's ``prompt_logprobs``: per prompt token, None for the first (nothing comes before it), else the
        token's and its ``prompt_logprobs`` most likely tokens' ``{logprob, rank, decoded_token}`` by token id."""
        out: list[dict[str, dict[str, Any]] | None] = [None] if choice.prompt_ids else []
        for token, score in zip(choice.prompt_ids[1:], choice.prompt_logprobs):
            label = self.texts.label
            entry = {str(token): {"logprob": score.logprob, "rank": score.rank, "decoded_token": label(token)}}
            for place, (other, logprob) in enumerate(zip(score.top_ids, score.top_logprobs), start=1):
                entry.setdefault(str(other), {"logprob": logprob, "rank": place, "decoded_token": label(other)})
            out.append(entry)
        return out

    # ----- streamed ------------------------------------------------------------------
    def opening(self, index: int) -> dict[str, Any] | None:
        """A chat choice's first chunk (the assistant's role, as OpenAI sends it first); None for completions."""
        if not self.chat:
            return None
        return self._chunk({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                            "finish_reason": None})

    def chunks(self, choice: Choice, msg: generation_pb2.GenerateStreamResponse) -> list[dict[str, Any]]:
        """The chunks of one stream message of ``choice`` (added to it already): its text, then its end."""
        out = []
        asked = self.logprobs is not None
        echo = self._echo(choice)
        shows_ids = self.token_ids and bool(msg.token_ids or msg.prompt_token_ids)
        if msg.text or echo or (asked and msg.token_ids) or shows_ids:  # (tokens with no text yet: their scores, ids)
            logprobs = self._logprobs(choice, list(msg.token_ids), list(msg.logprobs)) if asked else None
            body = {"delta": {"content": msg.text}} if self.chat else {"text": echo + msg.text}
            item = {"index": choice.index, **body, "logprobs": logprobs, "finish_reason": None}
            chunk = self._chunk(item)
            if self.token_ids:  # vLLM's: the prompt's tokens on the first chunk, each chunk's new tokens
                prompt = list(msg.prompt_token_ids)
                if prompt and self.chat:
                    chunk["prompt_token_ids"] = prompt
                elif prompt:
                    item["prompt_token_ids"] = prompt
                item["token_ids"] = [*prompt, *msg.token_ids] if echo else list(msg.token_ids)
            if self.continuous_usage:  # this choice's so far (its prompt's tokens came with its first message)
                chunk["usage"] = {"prompt_tokens": len(choice.prompt_ids), "completion_tokens": len(choice.token_ids),
                                  "total_tokens": len(choice.prompt_ids) + len(choice.token_ids)}
            out.append(chunk)
        if self.chat and (msg.tool_call_deltas or msg.tool_calls):
            calls = [*(self._delta(choice, d) for d in msg.tool_call_deltas),
                     *(self._whole(choice, c) for c in msg.tool_calls if c.id not in choice.call_index)]
            out.append(self._chunk({"index": choice.index, "delta": {"tool_calls": calls}, "logprobs": None,
                                    "finish_reason": None}))
        if msg.finish_reason:
            body = {"delta": {}} if self.chat else {"text": ""}
            out.append(self._chunk({"index": choice.index, **body, "logprobs": None,
                                    "finish_reason": msg.finish_reason, "tandem": tandem_stats(msg.stats)}))
        return out

    @staticmethod
    def _delta(choice: Choice, delta: generation_pb2.ToolCallDelta) -> dict[str, Any]:
        """A call's piece as its arguments are written: the first names it, the next add arguments text (``index``:
        the call's place among the choice's calls, by which a client joins the pieces)."""
        if delta.id not in choice.call_index:
            choice.call_index[delta.id] = len(choice.call_index)
            return {"index": choice.call_index[delta.id], "id": delta.id, "type": "function",
                    "function": {"name": delta.name, "arguments": delta.arguments}}
        return {"index": choice.call_index[delta.id], "function": {"arguments": delta.arguments}}

    @staticmethod
    def _whole(choice: Choice, call: generation_pb2.ToolCall) -> dict[str, Any]:
        """A call that streamed no deltas (its block written otherwise than name, then arguments): whole."""
        choice.call_index[call.id] = len(choice.call_index)
        return {"index": choice.call_index[call.id], **_call(call)}

    def usage_chunk(self, choices: list[Choice], n: int = 1) -> dict[str, Any]:
        """``stream_options.include_usage``: the last chunk, with no choices."""
        return {**self._head(), "choices": [], "usage": usage(choices, n)}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self._head(), "choices": [choice]}

    def _head(self, chat_object: str = "chat.completion.chunk") -> dict[str, Any]:
        kind = chat_object if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    # ----- log-probabilities ---------------------------------------------------------------
    def _logprobs(self, choice: Choice, token_ids: list[int],
                  scores: list[common_pb2.TokenLogprobs]) -> dict[str, Any] | None:
        if self.logprobs is None:
            return None
        if self.chat:
            return {"content": self.texts.entries(token_ids, scores), "refusal": None}
        entries: list[tuple[int, common_pb2.TokenLogprobs | None]] = list(zip(token_ids, scores))
        if self.echo is not None and choice.prompt_ids and not choice.echoed_logprobs:
            # The prompt's tokens first: its first has no score (nothing comes before it), the rest the target's.
            choice.echoed_logprobs = True
            entries = [(choice.prompt_ids[0], None), *zip(choice.prompt_ids[1:], choice.prompt_logprobs), *entries]
        offsets = []
        for t, _ in entries:
            offsets.append(choice.text_offset)
            choice.text_offset += len(self._text(t))
        label = self.texts.label
        return {"tokens": [label(t) for t, _ in entries],
                "token_logprobs": [None if s is None else s.logprob for _, s in entries],
                "top_logprobs": [None if s is None else {label(i): lp for i, lp in zip(s.top_ids, s.top_logprobs)}
                                 for _, s in entries] if self.logprobs else None,
                "text_offset": offsets}

    def _echo(self, choice: Choice) -> str:
        """Completions' echo: the choice's prompt text, once per choice (streamed: in its first chunk)."""
        if self.echo is None or choice.echoed:
            return ""
        choice.echoed = True
        prompt = self.echo[choice.prompt]
        return prompt if isinstance(prompt, str) else self.tokenizer.decode(prompt)

    def _text(self, token_id: int) -> str:
        return self.texts.text(token_id)


class TokenTexts:
    """Tokens as log-probabilities show them: each decoded alone, once per request; or, with ``as_ids`` (vLLM's
    ``return_tokens_as_token_ids``), as ``token_id:ID``, which names a token whose bytes are not a character."""

    def __init__(self, tokenizer: Any, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self._texts: dict[int, str] = {}  # token id -> its text alone

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text

    def label(self, token_id: int) -> str:
        """The token as log-probabilities name it: its text, or ``token_id:ID``."""
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)

    def token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.label(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def entries(self, token_ids: list[int], scores: list[common_pb2.TokenLogprobs]) -> list[dict[str, Any]]:
        """Chat completions' (and the Responses API's) list: each token with its score and its alternatives."""
        return [{**self.token(t, s.logprob),
                 "top_logprobs": [self.token(i, lp) for i, lp in zip(s.top_ids, s.top_logprobs)]}
                for t, s in zip(token_ids, scores)]


def _call(call: generation_pb2.ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def usage(choices: list[Choice], n: int = 1) -> dict[str, Any]:
    """OpenAI's usage: each prompt once (its ``n`` choices have the same), the completions of all choices, and
    (``prompt_tokens_details.cached_tokens``) the prompt tokens each prompt's first choice's target took from its
    prefix cache. Choices after a prompt's first usually find its prompt cached; OpenAI counts a prompt once, so
    they are not added. ``completion_tokens_details``: of the request's ``prediction``, the tokens verification
    kept and those it proposed and did not keep, over every choice (OpenAI counts the prediction's tokens that
    the answer does not contain as rejected; Tandem counts those it verified: a prediction's tail that the
    answer never reached is neither)."""
    prompt = cached = 0
    for first in range(0, len(choices), n):
        stats = next((c.stats for c in choices[first:first + n] if c.stats is not None), None)
        if stats is not None:
            prompt += stats.prompt_tokens
            cached += stats.prompt_tokens_reused
    completion = sum(len(c.token_ids) for c in choices)
    predicted = [c.stats for c in choices if c.stats is not None]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "accepted_prediction_tokens": sum(s.prediction_accepted for s in predicted),
                "rejected_prediction_tokens": sum(s.prediction_rejected for s in predicted)}}


def tandem_stats(stats: generation_pb2.GenerationStats | None) -> dict[str, Any] | None:
    """Tandem's extension field: a choice's speculation statistics (``acceptance``: accepted / drafted, ``null``
    when nothing was drafted: a ``none`` request, or one whose every round verified the target's own token alone,
    has no rate to report, and 0.0 would read as a draft that was always wrong)."""
    if stats is None:
        return None
    out = json_format.MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    out["acceptance"] = stats.acceptance_rate if stats.drafted else None
    return out
