"""A request's constraint as llguidance grammar text, checked; no torch, so that a backend
without the engine (vLLM) can check constraints before a request is audited.

JSON is constrained to the usual separators (``", "``, ``": "``) with no free whitespace:
a weak model given free whitespace can spend its whole budget on newlines.
"""

from __future__ import annotations

import json
from typing import Any

import llguidance

from engine.api.types import Constraint, InvalidRequestError

# llguidance's JSON options (its "x-guidance" schema key).
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(constraint: Constraint) -> str:
    """llguidance's grammar for ``constraint`` (ValueError or TypeError when it has none)."""
    if constraint.kind in ("json_schema", "json_object"):
        schema = json.loads(constraint.spec) if constraint.kind == "json_schema" else {}
        if not isinstance(schema, dict):
            raise InvalidRequestError("A JSON schema must be a JSON object.", "response_format")
        if constraint.kind == "json_object":
            schema = {"type": "object"}
        return str(
            llguidance.grammar_from(
                "json_schema", json.dumps({**schema, "x-guidance": JSON_LAYOUT})
            )
        )
    if constraint.kind == "choice":
        return str(llguidance.grammar_from("choice", constraint.spec))
    if constraint.kind == "regex":
        return str(llguidance.grammar_from("regex", constraint.spec))
    return str(llguidance.grammar_from("grammar", constraint.spec))


def checked_grammar(constraint: Constraint, token_table: Any = None) -> str:
    """``constraint``'s grammar, checked by llguidance (against ``token_table`` when given:
    the engine's; without one only the grammar itself is checked); InvalidRequestError
    naming ``response_format`` (the caller knows which parameter asked) when it is invalid."""
    what = constraint.kind.replace("_", " ")
    try:
        text = grammar_text(constraint)
    except (ValueError, TypeError) as error:
        raise InvalidRequestError(
            f"The {what} constraint is invalid: {error}", "response_format"
        ) from error
    problem = llguidance.LLMatcher.validate_grammar(text, token_table)
    if problem:
        raise InvalidRequestError(
            f"The {what} constraint is invalid: {problem.splitlines()[0]}", "response_format"
        )
    return text
