"""Reading typed fields of a JSON request body: each failure a 400 naming the field."""

from __future__ import annotations

import math
from typing import Any

from shared.errors import InvalidRequestError


def bad(message: str, param: str | None = None) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def integer(body: dict[str, Any], key: str, default: int | None) -> int | None:
    value = body.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(f"'{key}' must be an integer", key)
    if not -(2**63) <= value < 2**63:  # JSON allows any length; nothing here takes more
        raise bad(f"'{key}' must fit in a signed 64-bit integer", key)
    return value


def text_field(value: str, param: str) -> str:
    """`value` if it is valid Unicode text: JSON escapes can make lone surrogates
    ("\\ud800"), which no tokenizer can encode."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise bad(f"'{param}' holds an invalid character (a lone surrogate)", param) from exc
    return value


def number(body: dict[str, Any], key: str, default: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(f"'{key}' must be a number", key)
    return float(value)


def boolean(body: dict[str, Any], key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"'{key}' must be a boolean", key)
    return value
