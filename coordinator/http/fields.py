"""A JSON request body's fields, taken one by one with their types checked, and refusals that name them.

Every HTTP route parses its body with these (``coordinator.http.schema`` and the modules beside it):
``Fields.take`` and its typed cousins pop a field (null is absent), ``finish`` refuses what is left as
an unknown field, ``refuse`` what Tandem cannot honour unless it asks for nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from coordinator.http.errors import ApiError, bad_field, unsupported


class Fields:
    """An object's fields, taken one by one with their types checked; ``finish`` refuses what is left."""

    def __init__(self, data: dict[str, Any], prefix: str = "") -> None:
        self.data = dict(data)
        self.prefix = prefix

    def take(self, key: str) -> Any:
        return self.data.pop(key, None)  # null is absent: the default

    def string(self, key: str) -> str | None:
        value = self.take(key)
        if value is not None and not isinstance(value, str):
            raise bad_field(self.prefix + key, f"a string, got {kind_of(value)}")
        return value

    def boolean(self, key: str) -> bool | None:
        value = self.take(key)
        if value is not None and not isinstance(value, bool):
            raise bad_field(self.prefix + key, f"true or false, got {kind_of(value)}")
        return value

    def integer(self, key: str, low: int, high: int) -> int | None:
        """An integer in ``low..high``."""
        value = self.take(key)
        if value is None:
            return None
        if not is_int(value):
            raise bad_field(self.prefix + key, f"an integer, got {kind_of(value)}")
        if not low <= value <= high:
            raise bad_field(self.prefix + key, f"must be in {low}..{high}, got {value}")
        return value

    def number(self, key: str) -> float | None:
        value = self.take(key)
        if value is None:
            return None
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise bad_field(self.prefix + key, f"a number, got {kind_of(value)}")
        if not math.isfinite(value) or abs(value) > 3.4e38:  # beyond float32 (the wire's) is not a value
            raise bad_field(self.prefix + key, f"must be a finite number, got {value}")
        return float(value)

    def refuse(self, fields: dict[str, Callable[[Any], bool]]) -> None:
        """Fields Tandem cannot honour: refused unless they ask for nothing."""
        for key, neutral in fields.items():
            if key in self.data and not neutral(self.data.pop(key)):
                raise unsupported(self.prefix + key)

    def finish(self) -> None:
        if self.data:
            key = next(iter(self.data))
            raise ApiError(400, f"{self.prefix}{key}: unknown field", self.prefix + key, code="unknown_parameter")


def object_field(where: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise bad_field(where, f"an object, got {kind_of(value)}")
    return value


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def kind_of(value: Any) -> str:
    """What a JSON value is, as an error names it ("an empty list" for [], so that "got a list" is never said of
    the value a "non-empty list" was asked for)."""
    if value == [] or value == "":
        return "an empty list" if isinstance(value, list) else "an empty string"
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer",
            float: "a number", type(None): "null"}.get(type(value), type(value).__name__)
