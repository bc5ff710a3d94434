"""From ``speculum serve``'s arguments to a running server: checks, the access guard, the state.

Shared by ``speculum serve`` (one uvicorn process, :func:`serve_http`) and its Ray Serve replicas
(:mod:`speculum.integrations.ray_serve`, each replica builds its own state with :func:`build_state`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from ..errors import SpeculumError
from .guard import LOOPBACK_NAMES, GuardSettings
from .limits import RequestLimits


def _split(text: str | None) -> tuple[str, ...]:
    return tuple(x.strip() for x in (text or "").split(",") if x.strip())


def check_serve_args(args: argparse.Namespace) -> None:
    """Refuse bad ``speculum serve`` arguments with a clear error (before any model loads)."""
    from .model_state import SERVABLE_METHODS

    if args.method not in SERVABLE_METHODS:
        raise SpeculumError(f"unknown method {args.method!r}; choose from {', '.join(SERVABLE_METHODS)}")
    if args.max_queue < 0:
        raise SpeculumError("--max-queue must be >= 0")
    if args.max_batch is not None and not 1 <= args.max_batch <= 256:
        raise SpeculumError("--max-batch must be in 1..256")
    if args.prefix_cache_mb < 0:
        raise SpeculumError("--prefix-cache-mb must be >= 0")
    if args.threads is not None and args.threads < 1:
        raise SpeculumError("--threads must be at least 1")
    if args.engines is not None and not 1 <= args.engines <= 64:
        raise SpeculumError("--engines must be in 1..64")
    replicas = getattr(args, "replicas", None)
    if replicas is not None and not 1 <= replicas <= 256:
        raise SpeculumError("--replicas must be in 1..256")
    if not 0 < args.port < 65536:
        raise SpeculumError("--port must be in 1..65535")
    if min(args.max_request_bytes, args.max_json_depth, args.max_grammar_bytes, args.max_prompt_tokens or 1,
           args.max_n) < 1 or args.grammar_timeout <= 0:
        raise SpeculumError("--max-request-bytes, --max-prompt-tokens, --max-n, --max-json-depth, --max-grammar-bytes "
                            "and --grammar-timeout must be positive")
    if args.deterministic and args.runner == "hf":
        raise SpeculumError("--deterministic needs the native runner (--runner native or auto)")
    if args.draft_head:
        from ..heads import head_kind

        for path in args.draft_head:
            head_kind(path)  # a missing or foreign file is refused now, not at the first request


def build_guard(args: argparse.Namespace) -> tuple[GuardSettings, tuple[str, ...]]:
    """The access guard (API keys from ``--api-key`` and ``SPECULUM_API_KEY``, Host names, body size)
    and the CORS origins."""
    keys = tuple(args.api_key or ()) + _split(os.environ.get("SPECULUM_API_KEY"))
    if any(not k.strip() or any(c.isspace() for c in k) for k in keys):
        raise SpeculumError("an API key must be non-empty and contain no spaces")
    guard = GuardSettings(api_keys=keys, allowed_hosts=GuardSettings.hosts_for(args.host, _split(args.allowed_hosts)),
                          max_body_bytes=args.max_request_bytes)
    if not keys and args.host not in LOOPBACK_NAMES:
        print(f"speculum: warning: listening on {args.host} without an API key: anyone who can reach this "
              f"port can use the model (--api-key)", file=sys.stderr)
    return guard, _split(args.allowed_origins)


def build_state(args: argparse.Namespace, engines: int | None = None, threads: int | None = None):
    """The server's :class:`~speculum.server.app.ServerState`: the model loaded in this process
    (``engines == 1``) or ``engines`` engine processes. ``engines``/``threads`` override the args'."""
    import torch

    from ..loading import load
    from ..models import load_tokenizer_and_config
    from ..runners import release_if_native, use_runner
    from .app import ServerState
    from .engines import EngineConfig, EnginePool, default_engines
    from .metrics import Metrics

    limits = RequestLimits(args.max_json_depth, args.max_grammar_bytes, compile_timeout_s=args.grammar_timeout,
                           max_prompt_tokens=args.max_prompt_tokens, max_n=args.max_n)
    engines = engines or args.engines or default_engines(args.device)
    threads = threads or args.threads
    cores = torch.get_num_threads()
    name = args.served_model_name or args.model
    if engines > 1:
        config = EngineConfig(args.model, args.dtype, args.device, args.runner, threads or max(1, cores // engines),
                              args.method, args.max_tree, args.deterministic,
                              args.max_batch, args.prefix_cache_mb, args.draft_head,
                              weights=getattr(args, "weights", None))
        tok, _ = load_tokenizer_and_config(args.model)
        pool = EnginePool(config, engines, Metrics(), args.max_queue)
        if pool.skipped:
            print(f"speculum: note: {pool.skipped}", file=sys.stderr)
        state = ServerState.over_engines(pool, tok, name, args.method, limits, args.share_drafter_state)
    else:
        torch.set_num_threads(threads or max(1, cores - 1))  # one core left to HTTP
        model, tok = load(args.model, args.dtype, args.device, weights=getattr(args, "weights", None))
        use_runner(model, args.runner)
        release_if_native(model)  # the server runs only engine methods
        state = ServerState(model, tok, name, args.method, args.max_queue, args.max_tree, limits,
                            args.share_drafter_state, deterministic=args.deterministic, max_batch=args.max_batch,
                            prefix_cache_mb=args.prefix_cache_mb, draft_head=args.draft_head)
    logging.getLogger("speculum.server").setLevel(logging.INFO)  # (the calibration's arrival)
    if not args.no_access_log:
        logging.getLogger("speculum.access").setLevel(logging.INFO)
    if args.deterministic is None and not state.deterministic:
        print("speculum: note: the reproducible mode is off (it would pad every step with this runner, dtype and "
              "machine: --deterministic forces it); repeated requests verify whole trees", file=sys.stderr)
    return state


def describe(state, args: argparse.Namespace) -> str:
    mode = "reproducible" if state.deterministic else "whole trees"
    running = len(state.worker.engines) if hasattr(state.worker, "engines") else 1
    calibration = "" if state.calibrated else "; measuring this machine's forward costs in idle moments"
    return (f"{state.model_name!r} ({args.method}, {mode}, {running} engine{'s' if running > 1 else ''}, "
            f"up to {state.max_batch} requests per forward{calibration})")


class Starting:
    """The ASGI app while the model loads: ``/health`` answers 503 ``{"status": "loading"}`` and
    every other path an OpenAI-shaped 503 with ``Retry-After``; then (``app`` set) the real app."""

    def __init__(self):
        self.app = None

    async def __call__(self, scope, receive, send):
        if self.app is not None:
            return await self.app(scope, receive, send)
        if scope["type"] != "http":
            return None
        from starlette.responses import JSONResponse

        from .protocol import APIError

        body = {"status": "loading"} if scope["path"] == "/health" else APIError(
            "the model is loading; retry in a few seconds", 503, "server_error", code="loading").body()
        return await JSONResponse(body, status_code=503, headers={"Retry-After": "5"})(scope, receive, send)


def serve_http(build, guard: GuardSettings, origins: tuple[str, ...], args: argparse.Namespace) -> None:
    """Listen on ``--host``/``--port`` at once and serve the state ``build()`` makes (the model
    loaded, on a thread of its own; :class:`Starting` answers meanwhile) until interrupted."""
    import threading

    import uvicorn

    from .app import create_app

    front, built, failed = Starting(), [], []
    # (no lifespan events: without them Ctrl-C ends quietly instead of logging a cancelled lifespan task)
    server = uvicorn.Server(uvicorn.Config(front, host=args.host, port=args.port, log_level="warning",
                                           lifespan="off"))

    def load() -> None:
        try:
            built.append(build())
            front.app = create_app(built[0], guard, origins)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread, which stops serving
            failed.append(e)
            server.should_exit = True
            return
        print(f"speculum: serving {describe(built[0], args)}", file=sys.stderr)

    print(f"speculum: listening on http://{args.host}:{args.port}/v1 (loading the model)", file=sys.stderr)
    threading.Thread(target=load, name="speculum-load", daemon=True).start()
    try:
        server.run()
    finally:
        if built:
            built[0].close()
    if failed:
        raise failed[0]
