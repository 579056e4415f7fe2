"""What constrains an answer's text on the HTTP API: OpenAI's ``response_format`` and vLLM's structured outputs.

Both become the request's one constraint (``SamplingOptions.json_object``, ``.json_schema`` or ``.grammar``),
which the target enforces on every row it verifies (``tandem.structured_output``). Whether a schema or grammar
can be enforced is the service's check; here only the JSON shapes are.
"""

from __future__ import annotations

import json
from typing import Any

from coordinator.http.errors import bad_field
from coordinator.http.fields import Fields, kind_of, object_field
from tandem.errors import InvalidRequestError
from tandem.structured_output import choice_grammar, regex_grammar
from tandem.v1 import common_pb2

STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")  # vLLM's structured_outputs, one of
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def response_format(value: Any, sampling: common_pb2.SamplingOptions) -> None:
    """``response_format``: ``text`` (no constraint), ``json_object``, or ``json_schema`` with its ``schema``
    (``name``, ``description`` and ``strict`` taken: the schema is always enforced). Whether the schema can be
    enforced is the service's check (``tandem.structured_output``)."""
    if value is None:
        return
    fmt = Fields(object_field("response_format", value), "response_format.")
    kind = fmt.string("type")
    if kind == "json_schema":
        where = "response_format.json_schema"
        spec = Fields(object_field(where, fmt.take("json_schema")), where + ".")
        schema = spec.take("schema")
        schema = {} if schema is None else object_field("response_format.json_schema.schema", schema)
        sampling.json_schema = json.dumps(schema)
        spec.string("name")
        spec.string("description")
        spec.boolean("strict")
        spec.finish()
    elif kind == "json_object":
        sampling.json_object = True
    elif kind != "text":
        raise bad_field("response_format.type", f"one of text, json_object, json_schema, got {kind!r}")
    fmt.finish()


def structured_outputs(body: Fields, sampling: common_pb2.SamplingOptions, params: dict[str, str]) -> None:
    """vLLM's ``structured_outputs`` (exactly one of ``json``, ``regex``, ``choice``, ``grammar``, ``json_object``),
    or its older top-level ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``: enforced as
    ``response_format`` is, on every row the target verifies. ``grammar`` is llguidance's Lark dialect."""
    given: list[tuple[str, str, Any]] = []  # (the request's field, the kind, its value)
    value = body.take("structured_outputs")
    if value is not None:
        spec = Fields(object_field("structured_outputs", value), "structured_outputs.")
        for kind in STRUCTURED_KINDS:
            item = spec.take(kind)
            if item is not None and not (kind == "json_object" and item is False):  # false asks for nothing
                given.append((f"structured_outputs.{kind}", kind, item))
        spec.finish()
    for name, kind in GUIDED_FIELDS.items():
        item = body.take(name)
        if item is not None:
            given.append((name, kind, item))
    if not given:
        return
    name, kind, item = given[0]
    if len(given) > 1:
        raise bad_field(given[1][0], f"one structured-output constraint at a time: {name} is given already")
    if sampling.json_object or sampling.json_schema:
        raise bad_field(name, "give response_format or this, not both")
    params["grammar"] = name  # the service names a grammar it cannot enforce "grammar": this field
    params["response_format"] = name
    try:
        if kind == "json":
            schema = json.loads(item) if isinstance(item, str) else item
            sampling.json_schema = json.dumps(object_field(name, schema))
        elif kind == "json_object":
            if item is not True:
                raise bad_field(name, f"true or false, got {kind_of(item)}")
            sampling.json_object = True
        elif kind == "grammar":
            if not isinstance(item, str) or not item.strip():
                raise bad_field(name, "a grammar in llguidance's Lark dialect (text)")
            sampling.grammar = item
        elif kind == "regex":
            if not isinstance(item, str):
                raise bad_field(name, f"a regular expression (text), got {kind_of(item)}")
            sampling.grammar = regex_grammar(item)
        else:
            if not isinstance(item, list) or not all(isinstance(c, str) for c in item):
                raise bad_field(name, f"a list of strings, got {kind_of(item)}")
            sampling.grammar = choice_grammar(item)
    except ValueError as exc:  # not JSON, an empty choice or pattern (InvalidRequestError is a ValueError)
        message = str(exc).partition(": ")[2] if isinstance(exc, InvalidRequestError) else f"not JSON ({exc})"
        raise bad_field(name, message) from None
