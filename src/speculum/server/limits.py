"""Bounds on what one request may make the server do, checked before the work starts.

The body size is the :class:`~.guard.Guard`'s; these bound what a body under that size can still
cost: JSON nesting (``json`` and ``pydantic`` recurse, so a 10,000-deep body is a
``RecursionError``), and constraint size and compile time (a 200,000-way regex alternation takes
seconds to compile). Each breach is a 400 naming the limit and the flag that sets it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .protocol import APIError, CommonParams


@dataclass(frozen=True)
class RequestLimits:
    max_json_depth: int = 64  # nesting of the request body (a JSON schema inside it included)
    max_grammar_bytes: int = 64 << 10  # a regex, a Lark grammar, a JSON schema (as JSON) or all choices
    max_choices: int = 4096
    compile_timeout_s: float = 10.0
    max_prompt_tokens: int | None = None  # None: the model's context
    max_n: int = 16  # choices per request (n, best_of)


def json_depth(value) -> int:
    """Nesting depth of parsed JSON: ``1`` for a scalar, ``2`` for ``[1]``; iterative, so it
    cannot itself overflow the stack."""
    depth, stack = 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        depth = max(depth, d)
        if isinstance(v, dict):
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return depth


def load_json(raw: bytes, limits: RequestLimits):
    """``raw`` parsed, or a 400 for invalid or too deeply nested JSON."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise APIError(f"the request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:
        body = None
    if body is None or json_depth(body) > limits.max_json_depth:
        raise APIError(f"the request body is nested deeper than {limits.max_json_depth} levels "
                       f"(--max-json-depth)", code="nesting_too_deep") from None
    return body


def check_constraint_size(req: CommonParams, limits: RequestLimits) -> None:
    """A 400 for a regex, grammar, schema, choice list or tools' schemas over the limits (before
    compiling them)."""
    opts, rf = req.speculum, req.response_format
    sizes = {}
    if opts is not None:
        if opts.regex is not None:
            sizes["speculum.regex"] = len(opts.regex.encode())
        if opts.grammar is not None:
            sizes["speculum.grammar"] = len(opts.grammar.encode())
        if opts.choice is not None:
            if len(opts.choice) > limits.max_choices:
                raise APIError(f"speculum.choice has {len(opts.choice)} options; the limit is {limits.max_choices}",
                               param="speculum.choice", code="grammar_too_large")
            sizes["speculum.choice"] = sum(len(c.encode()) for c in opts.choice)
    tools = getattr(req, "tools", None)
    if tools:
        sizes["tools"] = sum(len(json.dumps(t.function.parameters or {})) for t in tools)
    if rf is not None and rf.json_schema is not None and rf.json_schema.schema_ is not None:
        sizes["response_format.json_schema"] = len(json.dumps(rf.json_schema.schema_))
    for param, size in sizes.items():
        if size > limits.max_grammar_bytes:
            raise APIError(f"{param} is {size} bytes; the limit is {limits.max_grammar_bytes} (--max-grammar-bytes)",
                           param=param, code="grammar_too_large")
