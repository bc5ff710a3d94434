"""The OpenAI request shapes the server accepts (pydantic), and OpenAI-shaped errors.

Unknown fields are ignored, as OpenAI does (``user``, ``metadata``, ``store``, ``service_tier``
and the like change nothing here); known fields of the wrong type or out of range are 400 errors
naming the field. Features the server does not implement (``logit_bias``, ``suffix``, ``echo``, the deprecated ``functions``) are refused with a clear 400 rather than silently
ignored; so is an unknown key inside ``speculum``. ``n`` choices (up to the server's ``--max-n``)
share the prompt's prefill and decode in one batch, choice ``i`` seeded with ``seed + i``;
completions' ``best_of`` samples that many and returns the ``n`` of highest total
log-probability (not streamed, as OpenAI). ``logprobs`` (chat: a bool with
``top_logprobs`` 0-20; completions: 0-5 alternatives) come from the verification forward that
accepted each token, from the model's own distribution unless ``speculum.logprobs_mode`` is
``"processed"``; streamed, each chunk carries its tokens'. ``presence_penalty`` and ``frequency_penalty``
(OpenAI's, in [-2, 2]) and ``repetition_penalty`` (vLLM's extra field) are applied
(:mod:`speculum.penalties`). ``tools``, ``tool_choice`` and ``parallel_tool_calls`` are OpenAI's
(:mod:`.tools`).
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from ..sampling import MAX_LOGPROBS


class APIError(Exception):
    """An error the client caused or should see: rendered as ``{"error": {...}}`` with ``status``."""

    def __init__(self, message: str, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def refuse_set(field: str, message: str):
    """A validator for a field the server does not implement: a set value (anything but ``None``,
    ``False``, ``0`` or empty) is a 400 with ``message``, instead of being silently ignored."""

    def check(cls, v):
        if v:
            raise ValueError(message)
        return v

    return field_validator(field)(check)


MAX_STOP_CHARS = 256


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    name: str = "output"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class SpeculumOptions(BaseModel):
    """``extra_body={"speculum": {...}}``: the drafter, and constraints beyond OpenAI's."""

    model_config = ConfigDict(extra="forbid")
    method: str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark
    max_tree: int | None = Field(default=None, ge=1, le=256)
    close_reserve: int = Field(default=0, ge=0)  # the grammar's budget closer (speculum.constrain.Grammar)
    # a KV policy for this request (speculum.kv.make_policy: "snapkv", "streaming:sink=4", ...) and
    # its budget (tokens, or a ratio of the prompt)
    kv_policy: str | None = Field(default=None, max_length=200)
    kv_budget: int | float | str | None = Field(default=None)
    # logprobs from the model's own distribution ("raw") or the one each token was chosen from
    logprobs_mode: Literal["raw", "processed"] = "raw"


class CommonParams(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0)  # not OpenAI's, common in compatible servers
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)  # what torch's generator takes
    n: int = Field(default=1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    logprobs: Any = None
    response_format: ResponseFormat | None = None
    speculum: SpeculumOptions | None = None
    # scopes what drafters learn across requests (vLLM's name): requests share it only with the same
    # salt (and the same API key); see ServerState
    cache_salt: str | None = Field(default=None, max_length=256)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=100.0)  # not OpenAI's: vLLM's and transformers'
    logit_bias: dict[str, float] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("max_tokens")
    @classmethod
    def _positive(cls, v):
        if v is not None and v <= 0:
            raise ValueError("max_tokens must be at least 1")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(len(s) > MAX_STOP_CHARS for s in ([v] if isinstance(v, str) else v or [])):
            raise ValueError(f"a stop sequence is longer than {MAX_STOP_CHARS} characters")
        return v

    _no_bias = refuse_set("logit_bias", "logit_bias is not supported")

    def logprob_count(self) -> int | None:
        """How many alternatives per token the request asks for (0: the token's own only), or None."""
        if self.logprobs is None or self.logprobs is False:
            if self.top_logprobs:
                raise APIError("top_logprobs needs logprobs", param="top_logprobs")
            return None
        try:
            return self._logprob_count()
        except ValueError as e:
            raise APIError(str(e), param="logprobs") from None

    def _logprob_count(self) -> int:
        raise NotImplementedError

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(CommonParams):
    prompt: str | list[int]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(default=None, ge=1)

    _no_echo = refuse_set("echo", "echo is not supported")
    _no_suffix = refuse_set("suffix", "suffix (insertion) is not supported")

    def _logprob_count(self) -> int:  # completions: logprobs is the count, 0-5
        if isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 5:
            raise ValueError("logprobs must be an integer in [0, 5]")
        return self.logprobs


MAX_TOOLS = 128


class FunctionDef(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema (None: no arguments)
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"

    @field_validator("arguments")
    @classmethod
    def _json(cls, v):
        """The arguments as OpenAI sends them (JSON text), read back."""
        if isinstance(v, dict):
            return v
        try:
            return json.loads(v)
        except json.JSONDecodeError:
            raise ValueError("a tool call's arguments must be JSON") from None


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(CommonParams):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    best_of: int | None = None

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v):
        if v not in (None, 1):
            raise ValueError("best_of is a completions parameter; chat samples several choices with n")
        return v

    def _logprob_count(self) -> int:  # chat: logprobs is a bool, top_logprobs the count
        if self.logprobs is not True:
            raise ValueError("logprobs must be true or false")
        return self.top_logprobs or 0

    _no_functions = refuse_set("functions", "functions (deprecated) are not supported: use tools")
