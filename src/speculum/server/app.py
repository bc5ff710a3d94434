"""The OpenAI-compatible HTTP app: ``/v1/models``, ``/v1/completions``, ``/v1/chat/completions``,
``/health`` and ``/metrics``.

Requests pass the :class:`~.guard.Guard` (Host, API key, JSON only, body size), are validated
here (OpenAI-shaped 4xx errors, :mod:`.limits`), turned into a :class:`~.worker.Job` and answered
from the worker's token stream, as one JSON body or as server-sent events (``data: {chunk}`` ...
``data: [DONE]``). Text is streamed only once it is final: an incomplete UTF-8 character, or a
tail that may be the start of a stop string, waits for the next tokens.

Parsing, tokenizing and grammar compilation run on a small thread pool, not on the event loop, so
that ``/health`` and other clients are answered while a large request is being prepared.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..constrain import Grammar, compile_constraint, ll_tokenizer, pick_constraint
from ..errors import SpeculumError
from ..kv import make_policy
from ..prompts import encode_messages
from ..result import FinishReason
from ..sampling import SamplingParams
from ..text_stream import StreamingText
from .guard import Guard, GuardSettings
from .limits import RequestLimits, check_constraint_size, load_json
from .metrics import Metrics
from .model_state import SERVABLE_METHODS, ModelState
from .protocol import APIError, ChatCompletionRequest, CommonParams, CompletionRequest
from .tools import TOOL_CLOSE_RESERVE, CallStream, ToolSet, render_messages
from .worker import Job, QueueFull, Worker

# OpenAI's finish reasons; the budget closer ended a cut-off output validly
FINISH = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
          FinishReason.CONTEXT: "length", FinishReason.CLOSED: "length"}


class ServerState:
    """The HTTP side of a server and what it serves: the model side in this process
    (:class:`~.model_state.ModelState`, run by a :class:`~.worker.Worker`), or, with ``engines`` (an
    :class:`~.engines.EnginePool`), in engine processes (``model`` is then None and the tokenizer is
    this process's only copy of the model).

    **Tenants.** A request's tenant is the API key it carried (see :class:`~.guard.Guard`) together
    with its ``cache_salt``; requests with neither share the anonymous tenant, and
    ``share_drafter_state=True`` puts every request in one tenant. Each tenant gets its own methods
    (:class:`~.model_state.ModelState`, which also says what the reproducible mode and batching do).
    """

    def __init__(self, model, tokenizer, model_name: str, method: str = "auto", max_queue: int = 16,
                 max_tree: int = 64, limits: RequestLimits | None = None, share_drafter_state: bool = False,
                 max_tenants: int = 64, deterministic: bool | None = None, max_batch: int | None = None,
                 prefix_cache_mb: int = 256, draft_head: tuple[str, ...] | None = None, engines=None):
        if method not in SERVABLE_METHODS:
            raise SpeculumError(f"unknown method {method!r}; choose from {', '.join(SERVABLE_METHODS)}")
        self.tokenizer, self.model_name, self.default_method = tokenizer, model_name, method
        self.limits = limits or RequestLimits()
        self.share_drafter_state = share_drafter_state
        if engines is None:
            self.engine = ModelState(model, tokenizer, method, max_tree, max_tenants, deterministic, max_batch,
                                     prefix_cache_mb, draft_head)
            info, metrics = self.engine.info(), Metrics()
            worker = Worker(self.engine.get_method, metrics, self.engine.batcher, max_queue, idle=self.engine)
        else:
            self.engine, info, metrics, worker = None, engines.info, engines.metrics, engines
        self.max_tree, self.deterministic, self.max_batch = info["max_tree"], info["deterministic"], info["max_batch"]
        self.chains_only = self.deterministic
        self.context, self.eos_ids, self.vocab_size = info["context"], info["eos_ids"], info["vocab_size"]
        self._serve(metrics, worker)

    @classmethod
    def over_engines(cls, pool, tokenizer, model_name: str, method: str = "auto",
                     limits: RequestLimits | None = None, share_drafter_state: bool = False,
                     max_tenants: int = 64) -> ServerState:
        """The HTTP side of a server whose model runs in the engine processes of ``pool``."""
        return cls(None, tokenizer, model_name, method, limits=limits, share_drafter_state=share_drafter_state,
                   max_tenants=max_tenants, engines=pool)

    @property
    def calibrated(self) -> bool:
        """Whether the model side knows its cost curve (else it measures it in the background)."""
        return self.engine.calibration.done if self.engine is not None else self.worker.calibrated

    # the in-process model side's parts (None with engine processes)
    model = property(lambda self: None if self.engine is None else self.engine.model)
    runner = property(lambda self: None if self.engine is None else self.engine.runner)
    prefix_cache = property(lambda self: None if self.engine is None else self.engine.prefix_cache)

    def _serve(self, metrics: Metrics, worker) -> None:
        """The HTTP side's parts: metrics, worker (a :class:`~.worker.Worker` or an
        :class:`~.engines.EnginePool`), preparation threads."""
        self.metrics, self.worker = metrics, worker
        try:  # built once here (it holds the interpreter ~0.3 s), not inside a request
            ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_ids)
        except SpeculumError:
            pass  # no end-of-sequence token or an unusable tokenizer: constrained requests say so
        self.prep = ThreadPoolExecutor(max_workers=2, thread_name_prefix="speculum-prep")
        # grammars compile on their own threads: a compilation past its timeout cannot be stopped,
        # and must not hold up the parsing and tokenizing of other requests meanwhile
        self.compile_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="speculum-compile")
        self.created = int(time.time())

    def tenant(self, api_key_index: int | None, cache_salt: str | None) -> str:
        """The tenant key of a request (see the class docstring)."""
        if self.share_drafter_state:
            return ""
        return json.dumps([api_key_index, cache_salt])

    def close(self) -> None:
        self.worker.close()
        if self.engine is not None:
            self.engine.calibration.close()
        self.prep.shutdown(wait=False, cancel_futures=True)
        self.compile_pool.shutdown(wait=False, cancel_futures=True)

    async def off_loop(self, fn, *args, timeout: float | None = None, pool: ThreadPoolExecutor | None = None):
        """``fn(*args)`` on the preparation threads (or ``pool``); the event loop keeps serving meanwhile."""
        future = asyncio.get_running_loop().run_in_executor(pool or self.prep, functools.partial(fn, *args))
        return await (asyncio.wait_for(future, timeout) if timeout else future)


def create_app(state: ServerState, guard: GuardSettings | None = None,
               allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """The app for ``state``. ``guard``: Host names, API keys and body size (default: any Host, no
    key, 4 MiB); ``allowed_origins``: web origins allowed to call it from a browser (CORS; none by
    default, so a page elsewhere cannot read its answers)."""
    app = FastAPI(title="speculum", description="OpenAI-compatible server with speculative decoding")
    app.state.speculum = state
    app.add_middleware(Guard, settings=guard or GuardSettings())
    if allowed_origins:  # outermost: a preflight is answered before the key is asked for
        from starlette.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        if exc.status < 500:
            state.metrics.rejected.labels(exc.code or exc.type).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        err = APIError(str(exc.detail), exc.status_code, "invalid_request_error" if exc.status_code < 500
                       else "server_error", code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        if isinstance(exc, RecursionError):  # nesting that got past the depth check: the client's doing
            return await _api_error(request, APIError("the request is nested too deeply", code="nesting_too_deep"))
        err = APIError(f"internal error: {type(exc).__name__}: {exc}", 500, "server_error")
        return JSONResponse(err.body(), status_code=500)

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": state.model_name,
                "calibration": "done" if state.calibrated else "running (trees sized by a stand-in curve meanwhile)"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "speculum", "max_model_len": state.context}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest)
        if isinstance(req.prompt, str):
            if not req.prompt:
                raise APIError("prompt is empty", param="prompt")
            ids = (await state.off_loop(state.tokenizer, req.prompt))["input_ids"]
        else:
            ids = list(req.prompt)
            if not ids or min(ids) < 0 or max(ids) >= state.vocab_size:
                raise APIError(f"prompt token ids must be non-empty and lie in [0, {state.vocab_size})",
                               param="prompt")
        return await _serve(request, req, ids, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = await _parse(request, ChatCompletionRequest)
        tools = ToolSet.of(req.tools, req.tool_choice, req.parallel_tool_calls)
        try:
            messages = [{"role": m.role, "content": m.text(),
                         **({"tool_calls": [c.model_dump() for c in m.tool_calls]} if m.tool_calls else {}),
                         **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})} for m in req.messages]
        except ValueError as e:
            raise APIError(str(e), param="messages") from None
        messages, template_kwargs = render_messages(messages, tools, state.tokenizer)
        try:
            ids = await state.off_loop(functools.partial(encode_messages, **template_kwargs), state.tokenizer, messages)
        except SpeculumError as e:
            raise APIError(str(e), param="messages") from None
        if req.max_completion_tokens is not None:
            if req.max_completion_tokens <= 0:
                raise APIError("max_completion_tokens must be at least 1", param="max_completion_tokens")
            req.max_tokens = req.max_completion_tokens
        return await _serve(request, req, list(ids), chat=True, tools=tools)

    async def _parse(request: Request, model_cls):
        body = await state.off_loop(load_json, await request.body(), state.limits)
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object", code="invalid_json")
        try:
            return model_cls.model_validate(body)
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            msg = first["msg"].removeprefix("Value error, ")
            raise APIError(f"invalid value for {param}: {msg}" if param else msg, param=param,
                           code="invalid_value") from None

    async def _serve(request: Request, req: CommonParams, ids: list[int], chat: bool, tools: ToolSet | None = None):
        n, best_of = req.n, getattr(req, "best_of", None) or req.n
        for param, count in (("n", n), ("best_of", best_of)):
            if count > state.limits.max_n:
                raise APIError(f"{param} is {count}; this server samples at most {state.limits.max_n} choices "
                               "per request (--max-n)", param=param)
        if best_of < n:
            raise APIError(f"best_of ({best_of}) must be at least n ({n})", param="best_of")
        if best_of > n and req.stream:
            raise APIError("best_of cannot be streamed (the best choices are known only at the end)", param="best_of")
        if best_of > state.worker.max_queue:
            raise APIError(f"{best_of} choices do not fit in this server's queue (--max-queue "
                           f"{state.worker.max_queue})", param="best_of" if best_of > n else "n")
        job = await _make_job(req, ids, state.tenant(request.scope["state"].get("api_key_index"), req.cache_salt),
                              rank=best_of > n, tools=tools)
        calls = tools is not None and tools.choice != "none"  # the output is read as text or calls
        jobs = job.choices(best_of)
        try:
            state.worker.submit(*jobs)
        except QueueFull as e:
            raise APIError(str(e), 429, "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after_s)}) from None
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return StreamingResponse(_stream(request, jobs, rid, chat, include_usage, calls),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        results: dict[int, object] = {}
        try:
            async for i, kind, value in _events(request, jobs):
                if kind == "done":
                    results[i] = value
                    if len(results) == len(jobs):
                        break
                elif kind == "error":
                    raise _worker_error(value)
                elif kind in ("cancelled", "disconnected"):
                    return Response(status_code=499)
        finally:
            for job in jobs:
                if job.index not in results:
                    state.worker.cancel(job)
        chosen = [results[i] for i in range(len(jobs))]
        if best_of > n:  # the n of highest total log-probability, their own logprobs only if asked for
            total = lambda r: sum(t.logprob for t in r.logprobs if t.logprob is not None)
            chosen = [r if req.logprob_count() is not None else dataclasses.replace(r, logprobs=None)
                      for r in sorted(chosen, key=total, reverse=True)[:n]]
        request.scope["state"]["completion_tokens"] = sum(r.new_tokens for r in results.values())
        return JSONResponse(_response(rid, chat, state.model_name, chosen, job.method, state.tokenizer, calls))

    async def _make_job(req: CommonParams, ids: list[int], tenant: str, rank: bool = False,
                        tools: ToolSet | None = None) -> Job:
        """Choice 0 of ``req``'s completion (``rank``: its sampled tokens' log-probabilities are
        kept, to rank ``best_of`` choices; ``tools``: its calls follow their grammar)."""
        if req.model not in (None, "", state.model_name, "default"):
            raise APIError(f"the model {req.model!r} does not exist; this server serves {state.model_name!r}",
                           404, code="model_not_found", param="model")
        prompt_param = "messages" if hasattr(req, "messages") else "prompt"
        cap = state.limits.max_prompt_tokens
        if cap is not None and len(ids) > cap:
            raise APIError(f"the prompt has {len(ids)} tokens; this server takes at most {cap} "
                           "(--max-prompt-tokens)", param=prompt_param, code="prompt_too_long")
        if len(ids) >= state.context:
            raise APIError(f"this model's maximum context length is {state.context} tokens, but the prompt has "
                           f"{len(ids)} tokens", param=prompt_param, code="context_length_exceeded")
        max_tokens = req.max_tokens if req.max_tokens is not None else state.context - len(ids)
        if len(ids) + max_tokens > state.context:
            raise APIError(f"this model's maximum context length is {state.context} tokens; the prompt has "
                           f"{len(ids)} tokens and max_tokens is {max_tokens}", param="max_tokens",
                           code="context_length_exceeded")
        opts = req.speculum
        method = (opts.method if opts and opts.method else state.default_method)
        if method not in SERVABLE_METHODS:
            raise APIError(f"unknown speculum method {method!r}; choose from {', '.join(SERVABLE_METHODS)}",
                           param="speculum.method")
        check_constraint_size(req, state.limits)
        kv = None
        if opts is not None and opts.kv_policy not in (None, "", "full"):
            kv = (opts.kv_policy, str(opts.kv_budget if opts.kv_budget is not None else "0.25"))
            try:
                make_policy(*kv)  # refused here, with a 400, rather than in the engine
            except SpeculumError as e:
                raise APIError(str(e), param="speculum.kv_policy") from None
        elif opts is not None and opts.kv_budget is not None:
            raise APIError("speculum.kv_budget needs speculum.kv_policy", param="speculum.kv_budget")
        logprobs = req.logprob_count()
        if rank and logprobs is None:
            logprobs = 0
        try:
            sampling = SamplingParams(temperature=req.temperature, top_k=req.top_k, top_p=req.top_p,
                                      repetition_penalty=req.repetition_penalty,
                                      frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
                                      logprobs=logprobs, logprobs_mode=opts.logprobs_mode if opts else "raw")
            grammar = await state.off_loop(_grammar, req, tools, timeout=state.limits.compile_timeout_s,
                                           pool=state.compile_pool)
        except SpeculumError as e:
            raise APIError(str(e), param="response_format") from None
        except TimeoutError:
            raise APIError(f"the constraint took longer than {state.limits.compile_timeout_s:g} s to compile "
                           f"(--grammar-timeout)", param="response_format", code="grammar_too_large") from None
        return Job(method, ids, max_tokens, sampling, req.stop_list(), req.seed, grammar, asyncio.get_running_loop(),
                   tenant=tenant, kv=kv)

    def _grammar(req: CommonParams, tools: ToolSet | None) -> Grammar | None:
        rf, opts = req.response_format, req.speculum
        schema, strict = None, True
        if rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise SpeculumError("response_format json_schema needs json_schema.schema")
            schema, strict = rf.json_schema.schema_, bool(rf.json_schema.strict)
        spec = pick_constraint(json_schema=schema, strict=strict,
                               json_object=rf is not None and rf.type == "json_object",
                               regex=opts.regex if opts else None, choice=opts.choice if opts else None,
                               grammar=opts.grammar if opts else None,
                               names="response_format, speculum.regex, speculum.choice or speculum.grammar")
        close_reserve = opts.close_reserve if opts is not None else 0
        if tools is not None and tools.choice != "none":
            if spec is not None:
                raise APIError("tools (unless tool_choice is none) cannot be combined with response_format or "
                               "speculum's constraints", param="tools")
            try:
                return compile_constraint(tools.grammar(), state.tokenizer, state.vocab_size, state.eos_ids,
                                          close_reserve or TOOL_CLOSE_RESERVE)
            except SpeculumError as e:
                raise APIError(f"a tool's parameters are not a usable JSON schema: {e}", param="tools") from None
        if close_reserve and spec is None:
            raise SpeculumError("speculum.close_reserve needs a constraint (response_format, regex, choice or grammar)")
        if spec is None:
            return None
        return compile_constraint(spec, state.tokenizer, state.vocab_size, state.eos_ids, close_reserve)

    async def _stream(request: Request, jobs: list[Job], rid: str, chat: bool, include_usage: bool,
                      calls: bool = False) -> AsyncIterator[str]:
        texts = [StreamingText(state.tokenizer, job.stop) for job in jobs]
        outputs = [CallStream() if calls else None for _ in jobs]  # text or tool calls, per choice
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(i: int, delta: str | None, finish: str | None = None, first: bool = False, logprobs=None,
                  tool_calls: list | None = None) -> str:
            lp = None if not logprobs else _logprobs(logprobs, chat, state.tokenizer)
            if chat:
                d = {"role": "assistant", "content": ""} if first else ({"content": delta} if delta else {})
                if tool_calls:
                    d["tool_calls"] = tool_calls
                choice = {"index": i, "delta": d, "finish_reason": finish, "logprobs": lp}
            else:
                choice = {"index": i, "text": delta or "", "finish_reason": finish, "logprobs": lp}
            return _sse({"id": rid, "object": obj, "created": created, "model": state.model_name, "choices": [choice]})

        def deltas(i: int, text: str, logprobs=None, final: bool = False):
            """The chunks for choice ``i``'s next ``text`` (read as content or calls)."""
            new_calls = []
            if outputs[i] is not None:
                text, new_calls = outputs[i].add(text, final)
            if text or logprobs or new_calls:  # (a chunk's logprobs go out with it, its text held back or not)
                yield chunk(i, text, logprobs=logprobs, tool_calls=new_calls)

        results: dict[int, object] = {}
        try:
            if chat:
                for job in jobs:
                    yield chunk(job.index, None, first=True)
            async for i, kind, value in _events(request, jobs):
                if kind == "tokens":
                    ids, logprobs = value
                    for out in deltas(i, texts[i].add(ids), logprobs):
                        yield out
                elif kind == "done":
                    results[i] = value
                    for out in deltas(i, texts[i].finish(value.text), final=True):
                        yield out
                    called = outputs[i] is not None and outputs[i].calls > 0
                    yield chunk(i, None, _finish(value, called))
                    if len(results) < len(jobs):
                        continue
                    request.scope["state"]["completion_tokens"] = sum(r.new_tokens for r in results.values())
                    if include_usage:
                        yield _sse({"id": rid, "object": obj, "created": created, "model": state.model_name,
                                    "choices": [], "usage": _usage(list(results.values()))})
                    yield "data: [DONE]\n\n"
                    return
                elif kind == "error":
                    results[i] = None
                    yield _sse(_worker_error(value).body())
                    yield "data: [DONE]\n\n"
                    return
                else:  # cancelled or disconnected
                    return
        finally:
            for job in jobs:
                if job.index not in results:
                    state.worker.cancel(job)

    async def _events(request: Request, jobs: list[Job], every_s: float = 0.25) -> AsyncIterator[tuple]:
        """The worker's events ``(choice, kind, value)`` for ``jobs`` (the choices of one request,
        which share one event queue); ``(0, "disconnected", None)`` (and the jobs cancelled, their
        queue slots freed) as soon as the client has gone away, checked at least every ``every_s``
        seconds, while the jobs wait and while tokens flow."""
        checked, events = time.perf_counter(), jobs[0].events
        while True:
            try:
                item = await asyncio.wait_for(events.get(), timeout=every_s)
            except TimeoutError:
                item = None
            if item is None or time.perf_counter() - checked > every_s:
                checked = time.perf_counter()
                if await request.is_disconnected():
                    for job in jobs:
                        state.worker.cancel(job)
                    yield 0, "disconnected", None
                    return
            if item is not None:
                yield item

    return app


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _usage(results: list) -> dict:
    """OpenAI's ``usage`` of a request's choices (their prompt counted once)."""
    prompt, completion = results[0].prompt_tokens, sum(r.new_tokens for r in results)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish(result, called: bool) -> str:
    """OpenAI's finish reason of a choice (``called``: its output was tool calls)."""
    finish = FINISH[result.finish_reason]
    return "tool_calls" if called and finish == "stop" else finish


def _response(rid: str, chat: bool, model_name: str, results: list, method: str, tokenizer,
              calls: bool = False) -> dict:
    """The non-streamed body of a request whose choices ended with ``results`` (``calls``: outputs
    are read as text or tool calls)."""
    choices = []
    for i, result in enumerate(results):
        logprobs = None if result.logprobs is None else _logprobs(result.logprobs, chat, tokenizer)
        if chat:
            content, tool_calls = CallStream().add(result.text, final=True) if calls else (result.text, [])
            message = {"role": "assistant", "content": content or (None if tool_calls else "")}
            if tool_calls:
                message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in tool_calls]
            choices.append({"index": i, "message": message, "finish_reason": _finish(result, bool(tool_calls)),
                            "logprobs": logprobs})
        else:
            choices.append({"index": i, "text": result.text, "finish_reason": FINISH[result.finish_reason],
                            "logprobs": logprobs})
    stats = [r.to_dict() for r in results]
    total = lambda key: sum(s[key] for s in stats)
    forwards = sum(r.forwards for r in results)
    return {
        "id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
        "model": model_name, "choices": choices, "usage": _usage(results),
        "speculum": {"method": method, "forwards": forwards,
                     "mean_accepted": round(sum(r.mean_accepted * r.forwards for r in results) / max(forwards, 1), 3),
                     "tok_s": round(sum(r.tok_s for r in results), 2),
                     "drafted": total("drafted"), "accepted": total("accepted"), "forced": total("forced"),
                     "time_mask_s": total("time_mask_s")},
    }


NO_LOGPROB = -9999.0  # a log-probability JSON cannot hold (-inf) or that was not computed, as vLLM writes it


def _logprobs(items, chat: bool, tokenizer) -> dict:
    """OpenAI's ``logprobs`` of a choice from :class:`~speculum.result.TokenLogprob` items: chat's
    ``{"content": [{token, logprob, bytes, top_logprobs}]}`` or completions' ``{tokens,
    token_logprobs, top_logprobs, text_offset}``."""
    text = lambda i: tokenizer.decode([i])
    value = lambda lp: NO_LOGPROB if lp is None or lp == float("-inf") else lp
    if chat:
        def entry(i: int, lp: float | None) -> dict:
            s = text(i)
            return {"token": s, "logprob": value(lp), "bytes": list(s.encode())}

        return {"content": [{**entry(t.token, t.logprob), "top_logprobs": [entry(i, lp) for i, lp in t.top]}
                            for t in items]}
    tokens = [text(t.token) for t in items]
    offsets = list(itertools.accumulate((len(x) for x in tokens[:-1]), initial=0)) if tokens else []
    return {"tokens": tokens, "token_logprobs": [value(t.logprob) for t in items],
            "top_logprobs": [{text(i): value(lp) for i, lp in t.top} for t in items], "text_offset": offsets}


def _worker_error(exc: BaseException) -> APIError:
    if isinstance(exc, SpeculumError):
        return APIError(str(exc), 400)
    return APIError(f"generation failed: {type(exc).__name__}: {exc}", 500, "server_error")
