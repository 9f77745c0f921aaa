"""Response formats as llguidance grammars: compiled and checked where no model is loaded
(the router, which must not import torch; every node checks again before it runs one).

`shared/engine/guided.py` applies them while sampling.
"""

from __future__ import annotations

import json
from typing import Any

from shared.errors import InvalidRequestError

MAX_GUIDE_CHARS = 64 * 1024  # a grammar this long is no one's response format


def grammar_for(response_format: dict[str, Any]) -> str:
    """The llguidance grammar of an OpenAI `response_format` (json_object, json_schema),
    or "" for text; InvalidRequestError naming `response_format` if it is not one."""
    from llguidance import LLMatcher

    def bad(why: str) -> InvalidRequestError:
        return InvalidRequestError(f"'response_format' {why}", param="response_format")

    kind = response_format.get("type")
    if kind == "text":
        return ""
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise bad("json_schema needs an object with a 'schema' object")
        schema = spec.get("schema", {})
    else:
        raise bad("type must be text, json_object or json_schema")
    try:
        grammar = LLMatcher.grammar_from_json_schema(json.dumps(schema))
    except (ValueError, TypeError) as exc:
        raise bad(f"schema is not valid: {exc}") from exc
    if len(grammar) > MAX_GUIDE_CHARS:
        raise bad(f"schema is longer than {MAX_GUIDE_CHARS} characters")
    check(grammar)
    return grammar


def check(grammar: str) -> None:
    """InvalidRequestError if llguidance cannot build `grammar` (every node checks too)."""
    from llguidance import LLMatcher

    if len(grammar) > MAX_GUIDE_CHARS:
        raise InvalidRequestError("the response format's grammar is too long", param="guide")
    error = LLMatcher.validate_grammar(grammar)
    if error:
        raise InvalidRequestError(
            f"'response_format' cannot be followed: {error}", param="response_format"
        )
