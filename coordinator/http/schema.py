"""An OpenAI request body, checked and turned into the service's own request (``tandem.v1.GenerateRequest``).

Only what is about JSON is checked here: types, the shape of ``messages`` and
``prompt``, ranges a proto field cannot hold, and which fields Tandem honours.
Everything else (sampling values, token ids, lengths against the model's
context, the server's limits, speculation options) is the service's own
validation, the one the gRPC API runs (coordinator/service.py); its messages
are renamed to these fields by ``errors.from_domain``.

A field Tandem cannot honour is refused with a 400 that names it, never
ignored: ``functions``, ``audio``... A neutral value (``functions: []``, ``null``
for any optional field) asks for nothing and is taken, since SDKs send some of
them by default. ``tools``, ``tool_choice`` and ``parallel_tool_calls`` become
the request's ``ToolOptions`` (``tandem.tool_calls`` says what each choice
does). ``response_format`` and vLLM's structured outputs are read by
``coordinator.http.structured`` and enforced on the target's rows
(``tandem.structured_output``). An unknown field is refused too: the official
clients send only what their user set. ``frequency_penalty``,
``presence_penalty`` and ``logit_bias`` are OpenAI's; ``repetition_penalty`` and
``min_tokens`` are vLLM's extensions of the body, taken as vLLM takes them.
Chat completions take vLLM's ``continue_final_message`` (the answer continues the last turn, an assistant's
prefill). Completions take OpenAI's ``suffix`` (fill in the middle: each prompt and the suffix become a
``GenerateRequest.infill``, which the service writes in the model's own format, ``tandem.infill``), a list of
prompts and ``echo`` (the prompt's own scores with
``logprobs``: ``SamplingOptions.prompt_logprobs``); both endpoints take vLLM's
``prompt_logprobs`` (each prompt token's score, rank and alternatives, in vLLM's shape). Chat completions take
OpenAI's ``prediction`` (Predicted Outputs: text the answer is expected to repeat, proposed as drafts,
``tandem.spec.prediction``) and ``metadata`` (checked as OpenAI checks it, and kept nowhere: Tandem stores no
completion, so ``store: true`` is refused), ``prompt_cache_key`` (a routing key: ``GenerateRequest.cache_key``),
``safety_identifier`` (taken, as ``user``) and vLLM's ``chat_template_kwargs``. Both endpoints take vLLM's
top-level sampling and output fields (``_vllm_extras``: ``top_k``, ``min_p``, ``allowed_token_ids``,
``return_token_ids``...), as vLLM and SGLang do.

Defaults are OpenAI's where they differ from the gRPC API's: ``temperature``
1 (sampling), ``top_p`` 1. ``max_tokens`` left out is what the context leaves
for chat completions (OpenAI's and vLLM's default, bounded by
``--max-new-tokens-limit``) and the coordinator's ``--max-new-tokens`` for
completions.
"""

from __future__ import annotations

import ctypes
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from coordinator.http.errors import ApiError, bad_field, unsupported
from coordinator.http.fields import Fields, is_int, kind_of, object_field
from coordinator.http.structured import response_format, structured_outputs
from tandem.sampling_params import MAX_LOGPROBS
from tandem.v1 import generation_pb2

MAX_CHOICES = 16  # n: each choice is a request of its own on the workers
MAX_BATCH = 64  # completions: prompts times n, the requests one call may start
# OpenAI takes 4, vLLM any number; evaluation harnesses send a task's stops plus the model's end token, often more
# than 4 (lm-evaluation-harness's local-completions does not cut them). Each costs a look at the text's tail a token.
MAX_STOP_STRINGS = 16
INT32_MAX = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)  # an int64 or uint64 seed; negative ones wrap into the service's uint64
ROLE_NAMES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default: sampling (the gRPC API's default is greedy)
MAX_SAFETY_IDENTIFIER = 128  # characters, as OpenAI bounds it


def _neutral(*values: Any) -> Callable[[Any], bool]:
    return lambda value: value is None or any(value == v for v in values)


# Fields Tandem cannot honour, and the values that ask for nothing (taken as if absent).
UNSUPPORTED_CHAT: dict[str, Callable[[Any], bool]] = {
    "functions": _neutral([]),
    "function_call": _neutral("none"),
    "audio": _neutral(),
    "modalities": _neutral(["text"]),
    "reasoning_effort": _neutral(),
    "web_search_options": _neutral(),
    "store": _neutral(False),
    "service_tier": _neutral("auto", "default"),
    "verbosity": _neutral("medium"),  # GPT-5's; medium is its default
    "prompt_cache_retention": _neutral("in_memory"),  # Tandem's prefix caches are in memory, least recently used out
    "prompt_cache_options": _neutral(),
}


@dataclass(slots=True)
class ParsedRequest:
    """A checked request: the service's request for its first choice, and what the HTTP edge does around it."""

    chat: bool
    request: generation_pb2.GenerateRequest
    model: str | None  # None: the served model
    n: int = 1
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    logprobs: int | None = None  # alternatives per token asked (0: the tokens' own only); None: no logprobs
    timeout_s: float | None = None  # tandem.timeout_s: the deadline of every worker call made for it
    params: dict[str, str] = field(default_factory=dict)  # the service's field names -> this request's
    prompts: list[str | list[int]] = field(default_factory=list)  # completions: its prompts, n choices each
    suffix: str = ""  # completions' suffix: each prompt is the prefix of a fill-in-the-middle request
    echo: bool = False  # completions: each choice's text (and log-probabilities) starts with its prompt's
    prompt_only: bool = False  # completions' max_tokens 0 with echo: the prompt (and its scores) only, no new text
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs: each prompt token's score, rank and top alternatives
    return_token_ids: bool = False  # vLLM's: the prompt's and each choice's token ids beside the text
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: log-probabilities name tokens token_id:ID
    continuous_usage: bool = False  # vLLM's stream_options.continuous_usage_stats (with include_usage)

    @property
    def choices(self) -> int:
        """Requests this call starts: ``n`` per prompt (OpenAI orders them prompt by prompt)."""
        return self.n * max(1, len(self.prompts))

    def prompt_of(self, index: int) -> int:
        return index // self.n

    @property
    def scores_each_prompt_once(self) -> bool:
        """Whether only each prompt's first choice asks the target to score the prompt (``prompt_logprobs``, or
        echo with logprobs), and its other choices take those scores (``share_prompt_scores``): the scores are
        the same for all of them, and where a kept score cannot be reused (a GPU, unpacked weights) each choice
        computed the prompt again. Not streamed: a streamed choice's first chunk carries its own."""
        return not self.stream and self.request.sampling.HasField("prompt_logprobs")

    def for_choice(self, index: int) -> generation_pb2.GenerateRequest:
        """Choice ``index``'s request: its prompt's; seeded requests take seed + the sample's index among its
        prompt's ``n``, so their samples differ and repeat; only a prompt's first choice scores the prompt when
        ``scores_each_prompt_once``."""
        prompt, sample = divmod(index, self.n)
        seeded = sample > 0 and self.request.sampling.HasField("seed")
        unscored = sample > 0 and self.scores_each_prompt_once
        if prompt == 0 and not seeded and not unscored:
            return self.request
        request = generation_pb2.GenerateRequest()
        request.CopyFrom(self.request)
        if prompt:
            _set_prompt(request, self.prompts[prompt], self.suffix)
        if seeded:
            request.sampling.seed = (self.request.sampling.seed + sample) % 2**64
        if unscored:
            request.sampling.ClearField("prompt_logprobs")
        return request


def parse_json(body: bytes) -> dict[str, Any]:
    """The body as a JSON object: UTF-8 only, no NaN or Infinity literals (not JSON), no lone surrogates (a
    ``\\ud800`` escape: not a character, and not encodable for the workers), else 400."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(400, f"the request body is not valid UTF-8 ({exc.reason} at byte {exc.start})") from None
    try:
        data = json.loads(text, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError; deep nesting a RecursionError
        raise ApiError(400, f"the request body is not valid JSON: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {kind_of(data)}")
    _check_text(data)
    return data


def _check_text(data: Any) -> None:
    """Every string (keys too) is text UTF-8 can carry: JSON's escapes can spell a lone surrogate."""
    pending = [data]
    while pending:  # iterative: json.loads already bounds the depth, this adds no recursion of its own
        value = pending.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        for key, item in items:
            for text in (key, item):
                if isinstance(text, str):
                    try:
                        text.encode("utf-8")
                    except UnicodeEncodeError:
                        raise ApiError(400, "the request holds a lone surrogate (an unpaired \\ud800-\\udfff "
                                            "escape), which is not text") from None
            if isinstance(item, (dict, list)):
                pending.append(item)


def parse_chat(data: dict[str, Any], request_id: str = "") -> ParsedRequest:
    body = Fields(data)
    parsed = _common(body, chat=True, request_id=request_id)
    request = parsed.request
    request.messages.messages.extend(parse_messages(body.take("messages")))
    request.messages.continue_final_message = _continues_final_message(body)
    request.messages.template_kwargs = chat_template_kwargs(body)
    parse_tools(body, request)
    max_tokens, max_completion = body.integer("max_tokens", 1, INT32_MAX), body.integer(
        "max_completion_tokens", 1, INT32_MAX)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise bad_field("max_completion_tokens", f"{max_completion} differs from max_tokens {max_tokens}: give one")
    request.stopping.max_new_tokens = max_completion or max_tokens or 0
    # Left out: as long as the model may write, OpenAI's and vLLM's default (a client such as an agent framework
    # sets none and takes a cut answer for a failure); --max-new-tokens-limit still bounds it.
    request.stopping.up_to_context = max_tokens is None and max_completion is None
    parsed.params.update({"prompt": "messages", "text": "messages", "logprobs": "top_logprobs",
                          "stopping.max_new_tokens": "max_tokens" if max_completion is None else
                          "max_completion_tokens"})
    wanted, top = body.boolean("logprobs"), body.integer("top_logprobs", 0, INT32_MAX)
    if top and not wanted:  # (0 asks for nothing: taken, as other neutral values are)
        raise bad_field("top_logprobs", "needs logprobs: true")
    if wanted:
        parsed.logprobs = request.sampling.logprobs = top or 0
    _prompt_logprobs(body, parsed)
    response_format(body.take("response_format"), request.sampling)
    structured_outputs(body, parsed.request.sampling, parsed.params)
    request.speculation.prediction = prediction(body.take("prediction"))
    metadata(body.take("metadata"))  # tags for stored completions: Tandem stores none (store: true is refused)
    request.cache_key = prompt_cache_key(body)
    body.refuse(UNSUPPORTED_CHAT)
    body.finish()
    return parsed


def parse_completion(data: dict[str, Any], request_id: str = "") -> ParsedRequest:
    body = Fields(data)
    parsed = _common(body, chat=False, request_id=request_id)
    request = parsed.request
    parsed.prompts = _prompts(body.take("prompt"))
    if len(parsed.prompts) * parsed.n > MAX_BATCH:
        raise bad_field("prompt", f"{len(parsed.prompts)} prompts x n {parsed.n} is {len(parsed.prompts) * parsed.n} "
                                  f"completions; one request takes at most {MAX_BATCH}")
    parsed.suffix = _suffix(body, parsed.prompts)
    _set_prompt(request, parsed.prompts[0], parsed.suffix)
    max_tokens = body.integer("max_tokens", 0, INT32_MAX)
    logprobs = body.integer("logprobs", 0, INT32_MAX)
    if logprobs is not None:
        parsed.logprobs = request.sampling.logprobs = logprobs
    parsed.echo = bool(body.boolean("echo"))
    if parsed.suffix and parsed.echo:
        raise bad_field("echo", "not with suffix (the prompt the model reads is the prefix and suffix in its own "
                                "fill-in-the-middle format, not the text sent)")
    if parsed.suffix and request.HasField("truncate_prompt_tokens"):
        raise bad_field("truncate_prompt_tokens", "not with suffix (a cut prompt would lose the prefix's marker): "
                                                  "shorten the prompt instead")
    if parsed.echo and request.HasField("truncate_prompt_tokens"):
        raise bad_field("truncate_prompt_tokens", "not with echo (the echoed prompt is the one sent, not the one cut)")
    if max_tokens == 0:  # OpenAI's legacy "score the prompt, write nothing": the target's one token is dropped
        if not parsed.echo:
            raise bad_field("max_tokens", "must be in 1..2147483647 (0 only with echo: the prompt scored alone)")
        parsed.prompt_only, max_tokens = True, 1
    request.stopping.max_new_tokens = max_tokens or 0
    if parsed.echo and logprobs is not None:  # the prompt's tokens are scored too: lm-evaluation-harness's way
        request.sampling.prompt_logprobs = logprobs
    _prompt_logprobs(body, parsed)
    best_of = body.integer("best_of", 1, INT32_MAX)
    if best_of is not None and best_of != parsed.n:
        raise unsupported("best_of", " unless it equals n (each choice is one sample)")
    response_format(body.take("response_format"), request.sampling)  # not OpenAI's here, but vLLM's: taken alike
    structured_outputs(body, parsed.request.sampling, parsed.params)
    body.finish()
    return parsed


# ----- the parts --------------------------------------------------------------------------
def _common(body: Fields, chat: bool, request_id: str) -> ParsedRequest:
    """The fields both endpoints take."""
    request = generation_pb2.GenerateRequest(request_id=request_id)
    parsed = ParsedRequest(chat, request, body.string("model"))
    parsed.n = body.integer("n", 1, MAX_CHOICES) or 1
    parsed.stream = bool(body.boolean("stream"))
    options = body.take("stream_options")
    if options is not None:
        if not parsed.stream:
            raise bad_field("stream_options", "only with stream: true")
        options = Fields(object_field("stream_options", options), "stream_options.")
        parsed.include_usage = bool(options.boolean("include_usage"))
        # vLLM's: each chunk carries its choice's usage so far, when the usage is asked at all (as vLLM reads it)
        parsed.continuous_usage = parsed.include_usage and bool(options.boolean("continuous_usage_stats"))
        options.finish()
    sampling = request.sampling
    temperature = body.number("temperature")
    sampling.temperature = DEFAULT_TEMPERATURE if temperature is None else temperature
    top_p = body.number("top_p")
    if top_p is not None:
        # On the wire 0 means "unset" (1): a top_p that is or rounds to 0 must not become 1 in silence.
        if not ctypes.c_float(top_p).value > 0:
            raise bad_field("top_p", f"must be in (0, 1], got {top_p}")
        sampling.top_p = top_p
    seed = body.integer("seed", *SEED_RANGE)
    if seed is not None:
        sampling.seed = seed % 2**64
    stop = body.take("stop")
    strings = [stop] if isinstance(stop, str) else stop
    if strings is not None:
        if not isinstance(strings, list) or not all(isinstance(s, str) for s in strings):
            raise bad_field("stop", f"a string or a list of strings, got {kind_of(stop)}")
        if len(strings) > MAX_STOP_STRINGS:
            raise bad_field("stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(strings)}")
        request.stopping.stop_strings.extend(strings)
    body.string("user")  # an end user's id for the caller's own records: taken, used for nothing
    identifier = body.string("safety_identifier")  # OpenAI's successor of user, for its abuse checks: taken alike
    if identifier is not None and len(identifier) > MAX_SAFETY_IDENTIFIER:
        raise bad_field("safety_identifier", f"at most {MAX_SAFETY_IDENTIFIER} characters, got {len(identifier)}")
    request.stopping.min_new_tokens = body.integer("min_tokens", 0, INT32_MAX) or 0  # vLLM's
    _penalties(body, sampling)
    _vllm_extras(body, request, parsed)
    _extension(body.take("tandem"), request, parsed)
    return parsed


def _continues_final_message(body: Fields) -> bool:
    """vLLM's ``continue_final_message`` (the answer continues the last turn, an assistant's prefill) and
    ``add_generation_prompt`` (a new assistant turn starts after the last; the default unless the last is
    continued). An answer is always the assistant's, so a chat that neither starts nor continues one is refused."""
    final = bool(body.boolean("continue_final_message"))
    generation = body.boolean("add_generation_prompt")
    if final and generation:
        raise bad_field("continue_final_message", "cannot be set with add_generation_prompt: give one")
    if generation is False and not final:
        raise bad_field("add_generation_prompt", "false only with continue_final_message: true (the answer is an "
                                                 "assistant's turn: a new one, or the last one continued)")
    return final


def prompt_cache_key(body: Fields) -> str:
    """OpenAI's ``prompt_cache_key``: requests with the same key go to the same target replica (where their shared
    prefix is cached) as ``GenerateRequest.cache_key``; the service bounds its length."""
    return body.string("prompt_cache_key") or ""


def chat_template_kwargs(body: Fields) -> str:
    """vLLM's ``chat_template_kwargs`` (the chat template's extra variables: Qwen3's ``enable_thinking``) as
    ``ChatMessages.template_kwargs``, a JSON object's text; the service refuses the names a template is given."""
    kwargs = body.take("chat_template_kwargs")
    if kwargs is None:
        return ""
    return json.dumps(object_field("chat_template_kwargs", kwargs))


def _prompt_logprobs(body: Fields, parsed: ParsedRequest) -> None:
    """vLLM's ``prompt_logprobs`` (0-20): each prompt token's log-probability and rank, with that many most likely
    tokens. Not streamed, as in vLLM. Completions' ``echo`` with ``logprobs`` scores the prompt too, with that many:
    the two must agree."""
    top = body.integer("prompt_logprobs", 0, MAX_LOGPROBS)
    if top is None:
        return
    if parsed.stream:
        raise bad_field("prompt_logprobs", "not with stream: true (as in vLLM); ask for the whole reply")
    sampling = parsed.request.sampling
    if sampling.HasField("prompt_logprobs") and sampling.prompt_logprobs != top:
        raise bad_field("prompt_logprobs", f"{top} differs from logprobs {sampling.prompt_logprobs}, with which echo "
                                           "scores the prompt too: give the same number")
    parsed.prompt_logprobs = sampling.prompt_logprobs = top


def _penalties(body: Fields, sampling) -> None:
    """``frequency_penalty``, ``presence_penalty``, ``repetition_penalty`` and ``logit_bias`` (ranges: the
    service's, ``tandem.sampling_params``)."""
    for key in ("frequency_penalty", "presence_penalty"):
        value = body.number(key)
        if value is not None:
            setattr(sampling, key, value)
    repetition = body.number("repetition_penalty")
    if repetition is not None:
        # On the wire 0 means "unset" (1): a penalty that is or rounds to 0 must not become 1 in silence.
        if not ctypes.c_float(repetition).value > 0:
            raise bad_field("repetition_penalty", f"must be > 0 (1: none), got {repetition}")
        sampling.repetition_penalty = repetition
    bias = body.take("logit_bias")
    if bias is None:
        return
    ids: dict[int, float] = {}
    for key, value in object_field("logit_bias", bias).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_field("logit_bias", f"keys are token ids (integers as strings), got {key!r}") from None
        if not 0 <= token <= INT32_MAX or token in ids:
            raise bad_field("logit_bias", f"token id {key!r} is " + ("repeated" if token in ids else "out of range"))
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
            raise bad_field("logit_bias", f"the bias of token {key} must be a number, got {kind_of(value)}")
        ids[token] = float(value)
    sampling.logit_bias.update(ids)


# vLLM's display options at the values Tandem's text always has (special tokens skipped, as vLLM's defaults do).
VLLM_DISPLAY_DEFAULTS: dict[str, Callable[[Any], bool]] = {
    "skip_special_tokens": _neutral(True),
    "spaces_between_special_tokens": _neutral(True),
}


def _vllm_extras(body: Fields, request: generation_pb2.GenerateRequest, parsed: ParsedRequest) -> None:
    """vLLM's sampling and stopping fields at the body's top level, where vLLM and SGLang take them (what a
    model card's recommended settings, ``top_k`` 20 and ``min_p`` 0, and ``vllm bench serve --ignore-eos`` send in
    ``extra_body``): ``top_k`` (-1 or 0: none, vLLM's two spellings), ``min_p``, ``ignore_eos``,
    ``stop_token_ids``, ``allowed_token_ids``, ``bad_words``, ``truncate_prompt_tokens``, ``priority`` (lower
    first where a target's KV pool runs short, under ``--scheduling-policy priority``; else only 0),
    ``include_stop_str_in_output``, ``return_token_ids``
    (the prompt's and the answer's token ids beside the text, as RL frameworks read them),
    ``return_tokens_as_token_ids`` (log-probabilities name each token ``token_id:ID``); ``skip_special_tokens`` and
    ``spaces_between_special_tokens`` only at their defaults (true), the text Tandem writes."""
    top_k = body.integer("top_k", -1, INT32_MAX)
    if top_k is not None:
        request.sampling.top_k = max(top_k, 0)
        parsed.params["top_k"] = "top_k"
    min_p = body.number("min_p")
    if min_p is not None:
        if not 0 <= min_p <= 1:
            raise bad_field("min_p", f"must be in [0, 1] (0 disables it), got {min_p}")
        request.sampling.min_p = min_p
    ignore_eos = body.boolean("ignore_eos")
    if ignore_eos is not None:
        request.stopping.ignore_eos = ignore_eos
        parsed.params["stopping.ignore_eos"] = "ignore_eos"  # (also how ``tandem.ignore_eos`` sees it was given)
    ids = body.take("stop_token_ids")
    if ids is not None:
        request.stopping.stop_token_ids.extend(_token_ids("stop_token_ids", ids))
        parsed.params["stopping.stop_token_ids"] = "stop_token_ids"
    allowed = body.take("allowed_token_ids")
    if allowed is not None:
        request.sampling.allowed_token_ids.extend(_token_ids("allowed_token_ids", allowed))
    truncate = body.integer("truncate_prompt_tokens", -1, INT32_MAX)
    if truncate is not None:
        request.truncate_prompt_tokens = truncate
    request.priority = body.integer("priority", -INT32_MAX - 1, INT32_MAX) or 0  # (the service checks the policy)
    bad_words = body.take("bad_words")
    if bad_words is not None:
        if not isinstance(bad_words, list) or not all(isinstance(w, str) for w in bad_words):
            raise bad_field("bad_words", f"a list of strings, got {kind_of(bad_words)}")
        request.sampling.bad_words.extend(bad_words)
    request.stopping.include_stop_string = bool(body.boolean("include_stop_str_in_output"))
    parsed.return_token_ids = bool(body.boolean("return_token_ids"))
    # the prompt's tokens: returned, or counted in each chunk's usage
    request.return_prompt_token_ids = parsed.return_token_ids or parsed.continuous_usage
    parsed.tokens_as_ids = bool(body.boolean("return_tokens_as_token_ids"))
    for key, neutral in VLLM_DISPLAY_DEFAULTS.items():
        if not neutral(body.take(key)):
            raise unsupported(key, " other than true (Tandem's text never holds special tokens)")


def _token_ids(param: str, value: Any) -> list[int]:
    if not isinstance(value, list) or not all(is_int(i) and 0 <= i <= INT32_MAX for i in value):
        raise bad_field(param, "a list of token ids (integers >= 0)")
    return value


def _same(param: str, given: Any, top_level: str, top_value: Any, is_set: bool) -> None:
    """``tandem.X`` and vLLM's top-level ``X`` are one option: both given must agree."""
    if is_set and given != top_value:
        raise bad_field(param, f"{given!r} differs from {top_level} {top_value!r}: give one")


def _extension(value: Any, request: generation_pb2.GenerateRequest, parsed: ParsedRequest) -> None:
    """``tandem``: the gRPC API's own options (speculation, top_k, stop token ids, ignore_eos, a deadline)."""
    if value is None:
        return
    ext = Fields(object_field("tandem", value), "tandem.")
    spec = request.speculation
    spec.method = ext.string("method") or ""
    k = ext.integer("k", 0, INT32_MAX)
    if k is not None:
        spec.k = k
    spec.fixed_k = bool(ext.boolean("fixed_k"))
    spec.heads_nodes = ext.integer("heads_nodes", 0, INT32_MAX) or 0
    spec.disable_pipelining = ext.boolean("pipelining") is False
    tree = ext.take("tree")
    if isinstance(tree, bool):  # ``true``: always a tree where there are candidates, as ``on``
        tree = "on" if tree else "off"
    if tree is not None and not isinstance(tree, str):
        raise bad_field("tandem.tree", f"one of auto, on, off (or true, false), got {kind_of(tree)}")
    spec.tree = tree or ""
    top_k = ext.integer("top_k", 0, INT32_MAX)
    if top_k is not None:
        _same("tandem.top_k", top_k, "top_k", request.sampling.top_k, "top_k" in parsed.params)
        request.sampling.top_k = top_k
        parsed.params["top_k"] = "tandem.top_k"
    ignore_eos = ext.boolean("ignore_eos")
    if ignore_eos is not None:
        _same("tandem.ignore_eos", ignore_eos, "ignore_eos", request.stopping.ignore_eos,
              "stopping.ignore_eos" in parsed.params)
        request.stopping.ignore_eos = ignore_eos
    ids = ext.take("stop_token_ids")
    if ids is not None:
        ids = _token_ids("tandem.stop_token_ids", ids)
        _same("tandem.stop_token_ids", ids, "stop_token_ids", list(request.stopping.stop_token_ids),
              "stopping.stop_token_ids" in parsed.params)
        del request.stopping.stop_token_ids[:]
        request.stopping.stop_token_ids.extend(ids)
        parsed.params["stopping.stop_token_ids"] = "tandem.stop_token_ids"
    timeout = ext.number("timeout_s")
    if timeout is not None and timeout <= 0:
        raise bad_field("tandem.timeout_s", f"must be a positive number of seconds, got {timeout}")
    parsed.timeout_s = timeout
    ext.finish()


def parse_messages(value: Any) -> list[generation_pb2.ChatMessage]:
    """The turns; content given as text parts is joined with newlines. An assistant turn may carry its calls
    (``tool_calls``, its content then null), a tool turn the id of the call it answers (``tool_call_id``)."""
    if value is None:
        raise bad_field("messages", "required: the conversation, a list of {role, content} objects")
    if not isinstance(value, list) or not value:
        raise bad_field("messages", f"a non-empty list of {{role, content}} objects, got {kind_of(value)}")
    turns = []
    for i, item in enumerate(value):
        where = f"messages[{i}]"
        turn = Fields(object_field(where, item), f"{where}.")
        role = turn.string("role")
        if role is None:
            raise bad_field(f"{where}.role", "required")
        if role not in ROLE_NAMES:
            if role == "function":
                raise unsupported(f"{where}.role", " ('function': the deprecated functions API; use tools)")
            raise bad_field(f"{where}.role", f"one of {', '.join(ROLE_NAMES)}, got {role!r}")
        calls = _earlier_calls(where, turn.take("tool_calls")) if role == "assistant" else []
        content = turn.take("content")
        message = generation_pb2.ChatMessage(role=ROLE_NAMES[role], name=turn.string("name") or "", tool_calls=calls,
                                             content="" if content is None and calls else _content(where, content))
        if role == "tool":
            message.tool_call_id = turn.string("tool_call_id") or ""
            if not message.tool_call_id:
                raise bad_field(f"{where}.tool_call_id", "required: the id of the call this answers")
        turn.refuse({"tool_calls": _neutral([]), "function_call": _neutral(), "refusal": _neutral(),
                     "audio": _neutral()})
        turn.finish()
        turns.append(message)
    return turns


def _earlier_calls(where: str, value: Any) -> list[generation_pb2.ToolCall]:
    """An assistant turn's ``tool_calls``: ``{id, type: function, function: {name, arguments}}`` each."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise bad_field(f"{where}.tool_calls", f"a list of calls, got {kind_of(value)}")
    calls = []
    for j, item in enumerate(value):
        at = f"{where}.tool_calls[{j}]"
        call = Fields(object_field(at, item), f"{at}.")
        kind = call.string("type") or "function"
        if kind != "function":
            raise bad_field(f"{at}.type", f"'function', got {kind!r}")
        function = Fields(object_field(f"{at}.function", call.take("function")), f"{at}.function.")
        name, arguments = function.string("name"), function.string("arguments")
        if not name:
            raise bad_field(f"{at}.function.name", "required")
        function.finish()
        calls.append(generation_pb2.ToolCall(id=call.string("id") or "", name=name, arguments=arguments or "{}"))
        call.finish()
    return calls


def parse_tools(body: Fields, request: generation_pb2.GenerateRequest) -> None:
    """``tools`` (functions only), ``tool_choice`` and ``parallel_tool_calls``; their rules (names, schemas, a
    choice naming a tool) are the service's checks (``tandem.tool_calls``)."""
    tools, choice, parallel = body.take("tools"), body.take("tool_choice"), body.boolean("parallel_tool_calls")
    if tools is None and choice is None and parallel is None:
        return
    options = request.tools
    if tools is not None and not isinstance(tools, list):
        raise bad_field("tools", f"a list of tools, got {kind_of(tools)}")
    for i, item in enumerate(tools or ()):
        tool = Fields(object_field(f"tools[{i}]", item), f"tools[{i}].")
        kind = tool.string("type")
        if kind != "function":
            raise unsupported(f"tools[{i}].type", f" ({kind!r}: function tools only)")
        function = Fields(object_field(f"tools[{i}].function", tool.take("function")), f"tools[{i}].function.")
        name = function.string("name")
        if name is None:
            raise bad_field(f"tools[{i}].function.name", "required")
        parameters = function.take("parameters")
        entry = options.tools.add(name=name, description=function.string("description") or "")
        if parameters is not None:
            entry.parameters = json.dumps(object_field(f"tools[{i}].function.parameters", parameters))
        function.boolean("strict")  # taken: calls that must be made always follow their schema
        function.finish()
        tool.finish()
    if isinstance(choice, dict):
        named = Fields(choice, "tool_choice.")
        if named.string("type") != "function":
            raise bad_field("tool_choice.type", "'function' (or tool_choice 'none', 'auto', 'required')")
        function = Fields(object_field("tool_choice.function", named.take("function")), "tool_choice.function.")
        options.choice, options.function = "function", function.string("name") or ""
        function.finish()
        named.finish()
    elif choice is not None:
        if choice not in ("none", "auto", "required"):
            raise bad_field("tool_choice", f"'none', 'auto', 'required' or {{type: function, function: {{name}}}}, "
                                           f"got {choice!r}")
        options.choice = choice
    options.single_call = parallel is False


def prediction(value: Any) -> str:
    """OpenAI's Predicted Outputs, ``{"type": "content", "content": text or text parts}``: text the answer is
    expected to repeat (``speculation.prediction``); "" for none."""
    if value is None:
        return ""
    fields = Fields(object_field("prediction", value), "prediction.")
    kind = fields.string("type")
    if kind != "content":
        raise bad_field("prediction.type", f"must be 'content' (the only kind of prediction), got {kind!r}")
    content = fields.take("content")
    if content is None:
        raise bad_field("prediction.content", "required: the text the answer is expected to repeat")
    text = _content("prediction", content)
    fields.finish()
    return text


# OpenAI's bounds on metadata (tags a stored completion is filtered by)
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def metadata(value: Any, where: str = "metadata") -> dict[str, str]:
    """``metadata``, checked as OpenAI checks it (at most 16 string pairs; keys up to 64 characters, values up to
    512): tags that change nothing about the answer."""
    if value is None:
        return {}
    pairs = object_field(where, value)
    if len(pairs) > METADATA_PAIRS:
        raise bad_field(where, f"at most {METADATA_PAIRS} key-value pairs, got {len(pairs)}")
    for key, item in pairs.items():
        if len(key) > METADATA_KEY_CHARS:
            raise bad_field(where, f"keys are at most {METADATA_KEY_CHARS} characters, got {len(key)} ({key[:20]!r}..)")
        if not isinstance(item, str):
            raise bad_field(f"{where}.{key}", f"a string, got {kind_of(item)}")
        if len(item) > METADATA_VALUE_CHARS:
            raise bad_field(f"{where}.{key}", f"at most {METADATA_VALUE_CHARS} characters, got {len(item)}")
    return pairs


def _content(where: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_field(f"{where}.content", f"a string or a list of text parts, got {kind_of(value)}")
    texts = []
    for j, item in enumerate(value):
        part = Fields(object_field(f"{where}.content[{j}]", item), f"{where}.content[{j}].")
        kind = part.string("type")
        if kind != "text":
            raise unsupported(f"{where}.content[{j}].type", f" ({kind!r}: text parts only)")
        text = part.string("text")
        if text is None:
            raise bad_field(f"{where}.content[{j}].text", "required")
        part.finish()
        texts.append(text)
    return "\n".join(texts)


def _prompts(value: Any) -> list[str | list[int]]:
    """The prompts: a string, or token ids, or a list of either (a batch: each its own ``n`` choices)."""
    if value is None:
        raise bad_field("prompt", "required: a string, a list of token ids, or a list of either")
    if isinstance(value, list) and value and all(isinstance(p, (str, list)) for p in value):
        return [_prompt(p, f"prompt[{i}]") for i, p in enumerate(value)]
    return [_prompt(value, "prompt")]


def _prompt(value: Any, where: str) -> str | list[int]:
    """One prompt: a string, or token ids."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(is_int(t) for t in value):
        if not all(0 <= t <= INT32_MAX for t in value):
            raise bad_field("prompt", f"{where}: token ids must be integers >= 0")
        return value
    if isinstance(value, list) and not value:
        raise bad_field("prompt", f"{where} is empty: give at least one token or a string")
    raise bad_field("prompt", f"{where}: a string, or a list of token ids, got {kind_of(value)}")


def _suffix(body: Fields, prompts: list[str | list[int]]) -> str:
    """OpenAI's ``suffix``: the text after the completion, so that the model fills in the middle between each prompt
    and it (``GenerateRequest.infill``); empty or null asks for nothing. Text prompts only: the model's markers go
    between texts the service tokenizes."""
    suffix = body.string("suffix") or ""
    if suffix and not all(isinstance(p, str) for p in prompts):
        raise bad_field("suffix", "needs text prompts (the prefix before the gap), not token ids")
    return suffix


def _set_prompt(request: generation_pb2.GenerateRequest, prompt: str | list[int], suffix: str = "") -> None:
    if suffix:
        assert isinstance(prompt, str)  # (``_suffix`` refuses token-id prompts with a suffix)
        request.infill.prefix, request.infill.suffix = prompt, suffix
    elif isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids[:] = prompt


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON value")
