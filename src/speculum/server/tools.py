"""Tool calls (OpenAI's ``tools``, ``tool_choice``, ``parallel_tool_calls``): the tools shown to the
model, the grammar its calls must follow, and the calls read back from its output.

**The call format** is the one Hermes-style models are trained on: each call is one line
``<tool_call>{"name": NAME, "arguments": {...}}</tool_call>``. An output is either text or one or
more calls (one with ``parallel_tool_calls: false``), never both.

**The grammar** (a Lark grammar for llguidance, :meth:`ToolSet.grammar`) makes every call parse and
its arguments match the function's JSON schema (in OpenAI's strict form, which closes objects:
:func:`~speculum.constrain.strict_schema`), so that a client never sees a call it cannot run. With
``tool_choice`` ``"auto"`` an output that starts with ``<tool_call>`` must be calls and any other is
free text; ``"required"`` allows calls only; a named function, calls of that function only;
``"none"``, no grammar (the tools are still shown). Speculation composes with it as with any grammar.
The budget closer (:data:`TOOL_CLOSE_RESERVE`) closes a call that ``max_tokens`` would cut off.

**The prompt**: a chat template that renders ``tools`` (it names them) gets them, and the calls and
results of earlier turns, in transformers' form; for any other template the tools go into the system
message with the format above, earlier calls become the assistant's text in that format and results
become ``<tool_response>`` user turns (:func:`render_messages`).

Example: ``tools=[get_weather(city)]``, ``tool_choice="auto"``; the model writes
``<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>``; the reply's message
has ``content: null`` and ``tool_calls: [{"id": "call_...", "type": "function", "function": {"name":
"get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}}]`` and ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..constrain import ConstraintSpec
from ..constrain.spec import JSON_OPTIONS, check_schema, strict_schema
from .protocol import APIError, Tool

OPEN, CLOSE = "<tool_call>", "</tool_call>"
DECODER = json.JSONDecoder()
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
# the budget closer's reserve for calls (unless the request sets speculum.close_reserve): a call the
# length would cut off is closed validly instead (finish reason "length"), so every call parses
TOOL_CLOSE_RESERVE = 48


def _system_text(tools: list[Tool]) -> str:
    lines = "\n".join(json.dumps(t.function.model_dump(exclude_none=True)) for t in tools)
    return ("You can call functions. The available functions, as JSON schemas, one per line:\n" + lines
            + f"\nTo call functions, reply only with one line per call: {OPEN}{{\"name\": <function name>, "
            f"\"arguments\": <arguments object>}}{CLOSE}")


@dataclass
class ToolSet:
    """The tools of one request and how it lets the model use them."""

    tools: list[Tool]
    choice: str  # "none", "auto", "required" or a function's name
    parallel: bool = True

    @classmethod
    def of(cls, tools: list[Tool] | None, tool_choice, parallel: bool | None) -> ToolSet | None:
        """The request's tool set (None without tools); 400s for a choice that names no tool."""
        if not tools:
            if tool_choice not in (None, "none"):
                raise APIError("tool_choice needs tools", param="tool_choice")
            return None
        names = [t.function.name for t in tools]
        if len(set(names)) < len(names):
            raise APIError("tool function names must be unique", param="tools")
        choice = tool_choice if isinstance(tool_choice, str) or tool_choice is None else tool_choice.function.name
        if choice not in (None, "none", "auto", "required") and choice not in names:
            raise APIError(f"tool_choice names the function {choice!r}, which is not among the tools",
                           param="tool_choice")
        return cls(tools, choice or "auto", parallel is not False)

    def grammar(self) -> ConstraintSpec | None:
        """The Lark grammar the output follows (None for ``"none"``)."""
        if self.choice == "none":
            return None
        chosen = [t for t in self.tools if self.choice in ("auto", "required") or t.function.name == self.choice]
        for t in chosen:  # the meta-schema check response_format's schemas get
            check_schema(t.function.parameters or EMPTY_PARAMETERS)
        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": t.function.name},
                                 "arguments": strict_schema(t.function.parameters or EMPTY_PARAMETERS)}}
                 for t in chosen]
        body = {**(calls[0] if len(calls) == 1 else {"anyOf": calls}), "x-guidance": JSON_OPTIONS}
        rules = [f"call: {json.dumps(OPEN)} body {json.dumps(CLOSE)}", f"body: %json {json.dumps(body)}",
                 'calls: call ("\\n" call)*' if self.parallel else "calls: call"]
        if self.choice == "auto":  # text that does not start like a call, or calls
            rules += ["start: TEXT | calls", f"TEXT: /(.|\\n)+/ & ~/{re.escape(OPEN)}(.|\\n)*/"]
        else:
            rules.append("start: calls")
        return ConstraintSpec.lark("\n".join(rules) + "\n")


def render_messages(messages: list[dict], tools: ToolSet | None, tokenizer) -> tuple[list[dict], dict]:
    """``(messages, template_kwargs)`` for the chat template: the tools passed as ``tools=`` where the
    template renders them, else written into the system message (see the module docstring)."""
    if tools is None:
        return [{"role": m["role"], "content": m.get("content") or ""} for m in messages], {}
    if "tools" in (getattr(tokenizer, "chat_template", None) or ""):
        return messages, {"tools": [t.model_dump(exclude_none=True) for t in tools.tools]}
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>{m.get('content') or ''}</tool_response>"})
        elif m.get("tool_calls"):
            calls = [f"{OPEN}{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}"
                     f"{CLOSE}" for c in m["tool_calls"]]
            out.append({"role": m["role"], "content": "\n".join(calls)})
        else:
            out.append({"role": m["role"], "content": m.get("content") or ""})
    system = _system_text(tools.tools)
    if out and out[0]["role"] in ("system", "developer"):
        out[0] = {"role": out[0]["role"], "content": out[0]["content"] + "\n\n" + system}
    else:
        out.insert(0, {"role": "system", "content": system})
    return out, {}


class CallStream:
    """Output read as text or calls, whole or as it streams: :meth:`add` takes the output's next
    part and returns ``(content, calls)``: the content to send now (held back while the output may
    still become a call) and the calls completed since, each with its ``index`` among the output's
    calls. With ``final``, what is left of calls cut off before they close (the length ran out) is
    returned as content."""

    def __init__(self):
        self.text, self.mode, self.sent = "", None, 0  # mode: None (undecided), "text" or "calls"
        self.calls = 0  # calls returned so far

    def add(self, delta: str, final: bool = False) -> tuple[str, list[dict]]:
        self.text += delta
        if self.mode is None:
            if self.text.startswith(OPEN):
                self.mode = "calls"
            elif not OPEN.startswith(self.text) or final:
                self.mode = "text"
        if self.mode != "calls":
            if self.mode is None:
                return "", []
            out, self.sent = self.text[self.sent:], len(self.text)
            return out, []
        new, pos, i = [], 0, 0
        while self.text.startswith(OPEN, pos):  # each call: OPEN, a JSON object, CLOSE, then "\n" or the end
            try:
                call, end = DECODER.raw_decode(self.text, pos + len(OPEN))
            except json.JSONDecodeError:
                break  # not complete yet
            if not self.text.startswith(CLOSE, end):
                break
            if i >= self.calls:
                new.append({"index": i, "id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                            "function": {"name": call["name"], "arguments": json.dumps(call["arguments"])}})
            i, pos = i + 1, end + len(CLOSE)
            pos += self.text.startswith("\n" + OPEN, pos)
        self.calls += len(new)
        return (self.text[pos:].strip() if final else ""), new
