"""What the output must match: a JSON schema, any JSON object, a regex, one of fixed choices, or a
Lark grammar. :meth:`ConstraintSpec.grammar` turns it into llguidance's grammar text.

JSON is generated compactly but readably: ``", "`` between items, ``": "`` after keys and no
other whitespace. Fixed separators make long runs of output forced by the grammar (keys, quotes,
braces), which the engine verifies as free drafts (jump-forward) instead of decoding them.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from ..errors import SpeculumError

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class ConstraintSpec:
    """``kind`` is one of :data:`KINDS`; ``value`` is the schema (dict or JSON text), the regex, the
    list of choices or the Lark grammar text (``None`` for ``json_object``)."""

    kind: str
    value: Any = None

    @classmethod
    def json_schema(cls, schema: dict | str) -> ConstraintSpec:
        return cls("json_schema", schema)

    @classmethod
    def json_object(cls) -> ConstraintSpec:
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> ConstraintSpec:
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> ConstraintSpec:
        return cls("choice", tuple(options))

    @classmethod
    def lark(cls, grammar: str) -> ConstraintSpec:
        return cls("grammar", grammar)

    def grammar(self) -> str:
        """llguidance grammar text for this spec; :class:`SpeculumError` when the value is malformed."""
        from llguidance import LLMatcher

        if self.kind not in KINDS:
            raise SpeculumError(f"unknown constraint kind {self.kind!r}; choose from {', '.join(KINDS)}")
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "json_schema":
            schema = self.value
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise SpeculumError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise SpeculumError("a JSON schema must be a JSON object")
            check_schema(schema)
            try:
                return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            except ValueError as e:
                raise SpeculumError(f"invalid JSON schema: {e}") from None
        if self.kind == "regex":
            if not isinstance(self.value, str) or not self.value:
                raise SpeculumError("a regex constraint needs a non-empty pattern string")
            try:
                re.compile(self.value)
            except re.error as e:
                raise SpeculumError(f"invalid regex {self.value!r}: {e}") from None
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            options = self.value
            if not options or not all(isinstance(o, str) and o for o in options):
                raise SpeculumError("a choice constraint needs a non-empty list of non-empty strings")
            alternatives = " | ".join(json.dumps(o) for o in options)  # Lark string literals
            return LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        if not isinstance(self.value, str) or not self.value.strip():
            raise SpeculumError("a grammar constraint needs Lark grammar text")
        return LLMatcher.grammar_from_lark(self.value)


def pick_constraint(*, json_schema: dict | None = None, strict: bool = True, json_object: bool = False,
                    regex: str | None = None, choice: list[str] | None = None, grammar: str | None = None,
                    names: str = "a JSON schema, a JSON object, a regex, choices or a grammar") -> ConstraintSpec | None:
    """The one constraint a request asks for (None for none), as the CLI and the server read it.

    ``json_schema`` (parsed JSON) is closed in OpenAI's strict mode when ``strict``
    (:func:`strict_schema`); ``names`` lists the options in the caller's words for the error raised
    when more than one is given.
    """
    given = [k for k, v in (("json_schema", json_schema), ("json_object", json_object or None), ("regex", regex),
                            ("choice", choice), ("grammar", grammar)) if v is not None]
    if len(given) > 1:
        raise SpeculumError(f"give at most one of {names}")
    if not given:
        return None
    if json_schema is not None:
        return ConstraintSpec.json_schema(strict_schema(json_schema) if strict else json_schema)
    if json_object:
        return ConstraintSpec.json_object()
    if regex is not None:
        return ConstraintSpec.regex(regex)
    if choice is not None:
        return ConstraintSpec.choice(choice)
    return ConstraintSpec.lark(grammar)


SAFE_INTEGER = 2**53 - 1  # I-JSON (RFC 7493): integers beyond this are not interoperable


def strict_schema(schema):
    """OpenAI's ``strict: true``: objects take no properties beyond those they declare. Without it a
    model may keep adding keys until it runs out of tokens, and the output is cut off, invalid.

    Returns a copy in which every object schema that declares ``properties`` and says nothing about
    ``additionalProperties`` gets ``additionalProperties: false`` (required keys it does not
    describe are added with any value). Every output valid under the copy is valid under the
    original. Integers without bounds get I-JSON's interoperable range ``±(2**53 - 1)``, so a model
    cannot run on writing digits. Schemas that use ``allOf`` are returned unchanged: closing each
    branch would make the keys of one branch illegal in the other.
    """
    if _uses_all_of(schema):  # closing each allOf branch would reject the keys of the others
        return schema
    return _close_objects(schema)


def _uses_all_of(node) -> bool:
    if isinstance(node, dict):
        return "allOf" in node or any(_uses_all_of(v) for k, v in node.items() if k not in ("enum", "const"))
    return isinstance(node, list) and any(_uses_all_of(v) for v in node)


def _close_objects(schema):
    if isinstance(schema, list):
        return [_close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("properties", "patternProperties", "$defs", "definitions") and isinstance(v, dict):
            out[k] = {name: _close_objects(sub) for name, sub in v.items()}  # maps of names to schemas
        elif k in ("enum", "const", "default", "examples", "required"):
            out[k] = v
        else:
            out[k] = _close_objects(v)
    types = out.get("type")
    if (types == "integer" or (isinstance(types, list) and "integer" in types)) \
            and not any(k in out for k in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        out["minimum"], out["maximum"] = -SAFE_INTEGER, SAFE_INTEGER
    if "properties" in out and isinstance(out["properties"], dict) and "additionalProperties" not in out \
            and "patternProperties" not in out:
        out["additionalProperties"] = False
        required = out.get("required")
        if isinstance(required, list):  # a required key the schema does not describe takes any value
            out["properties"] = {**out["properties"],
                                 **{k: {} for k in required if isinstance(k, str) and k not in out["properties"]}}
    return out


def check_schema(schema: dict) -> None:
    """Reject schemas that are not valid JSON Schema (jsonschema's meta-schema check)."""
    try:
        import jsonschema
    except ImportError:  # optional: llguidance still rejects what it cannot compile
        return
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        raise SpeculumError(f"invalid JSON schema: {e.message}") from None
