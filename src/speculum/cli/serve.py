"""``speculum serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import argparse

from ..methods import ENGINE_METHODS
from .common import HEAD_HELP, HEAD_METAVAR, add_load_args, add_runner_arg, head_files


def add_parser(sub) -> None:
    s = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API",
                       description="Serve /v1/models, /v1/completions and /v1/chat/completions (streaming, "
                                   "response_format json_object / json_schema, sampling parameters), /health "
                                   "and Prometheus /metrics. Up to --max-batch requests decode together, one "
                                   "forward per step, each with its own drafter (pick one per request with "
                                   "extra_body={'speculum': {'method': 'ngram'}}); prompts sharing a prefix "
                                   "reuse its KV entries.")
    add_load_args(s, "as for generate (default: %(default)s)")
    s.add_argument("--method", default="auto", help=f"default drafter: {', '.join(ENGINE_METHODS[:-1])} "
                                                     "(default: %(default)s)")
    s.add_argument("--draft-head", default=None, type=head_files, metavar=HEAD_METAVAR, help=HEAD_HELP)
    s.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    s.add_argument("--max-queue", type=int, default=16,
                   help="requests allowed to wait while every engine runs --max-batch; more get HTTP 429 "
                        "(default: %(default)s)")
    s.add_argument("--max-batch", type=int, default=None,
                   help="requests each engine decodes together, one forward per step (continuous batching); "
                        "default: from the "
                        "calibration, the most sequences whose forward costs at most 3x one sequence's (16 on a "
                        "2-core AVX-512 CPU in bfloat16); 1 decodes one request at a time")
    s.add_argument("--engines", type=int, default=None,
                   help="processes that run the model, each with its own copy of the weights and its own batch "
                        "(requests go to the least busy one); default: 2 on a CPU with at least 2 cores, else 1. "
                        "Fewer start if memory would not hold the copies. 1 runs the model inside the HTTP process")
    s.add_argument("--replicas", type=int, default=None,
                   help="run N copies of this server as Ray Serve replicas behind Ray's HTTP proxy and router (same "
                        "API, limits and keys; needs `pip install 'speculum[ray]'`); each replica runs one engine "
                        "with the cores shared out, unless --engines/--threads say otherwise (default: no Ray)")
    s.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="with --replicas: join this Ray cluster ('auto' for the one `ray start` runs here, or "
                        "ray://HEAD:10001) so that replicas spread over its nodes; default: a Ray instance "
                        "started on this machine")
    s.add_argument("--threads", type=int, default=None,
                   help="CPU threads for each engine's kernels; default: with several engines, the cores shared out "
                        "among them; with one, all cores but one, which is left to the HTTP side (kernels on "
                        "several threads stall whenever another process takes one of their cores: BENCHMARKS.md)")
    s.add_argument("--prefix-cache-mb", type=int, default=256,
                   help="MiB of recent prompts' KV entries kept so that a prompt starting the same way (a system "
                        "prompt) skips their prefill; per tenant; 0 turns it off (default: %(default)s)")
    s.add_argument("--max-tree", type=int, default=64, help="most drafted tokens per step (default: %(default)s)")
    s.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=None,
                   help="reproducible output: the same temperature-0 or seeded request gives the same text every "
                        "time, in bfloat16 too, whatever the drafters learnt from other requests (verification "
                        "kernels whose rows do not depend on the draft's length, and chain drafts only). Default: "
                        "on where this costs little (the native runner, with kernels that have row floors, as "
                        "oneDNN's bfloat16 ones), else off; --deterministic forces it (padding every step where "
                        "the kernels need it: slow), --no-deterministic verifies whole draft trees")
    add_runner_arg(s)
    s.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the --model argument)")
    sec = s.add_argument_group("access")
    sec.add_argument("--api-key", action="append", default=None, metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on /v1 routes (401 otherwise); repeat for several "
                          "keys, each its own tenant; also read from SPECULUM_API_KEY (comma-separated)")
    sec.add_argument("--allowed-hosts", default=None, metavar="H1,H2",
                     help="Host header names answered besides the bound address and localhost (DNS-rebinding "
                          "guard; '*' for any; default: any when --host is 0.0.0.0 or ::)")
    sec.add_argument("--allowed-origins", default=None, metavar="O1,O2",
                     help="web origins (e.g. https://app.example) allowed to call the API from a browser (CORS); "
                          "default: none")
    sec.add_argument("--share-drafter-state", action="store_true",
                     help="let every request use what drafters learnt from all others (default: per tenant, "
                          "i.e. per API key and cache_salt)")
    sec.add_argument("--no-access-log", action="store_true", help="do not log a line per request on stderr")
    lim = s.add_argument_group("limits (each breach is a 4xx naming the flag)")
    lim.add_argument("--max-request-bytes", type=int, default=4 << 20,
                     help="largest request body (413 beyond; default: %(default)s)")
    lim.add_argument("--max-prompt-tokens", type=int, default=None,
                     help="longest prompt, in tokens, after the chat template (default: the model's context)")
    lim.add_argument("--max-n", type=int, default=16,
                     help="most choices one request may sample (n, and completions' best_of; default: %(default)s)")
    lim.add_argument("--max-json-depth", type=int, default=64,
                     help="deepest nesting of a request body, schemas included (default: %(default)s)")
    lim.add_argument("--max-grammar-bytes", type=int, default=64 << 10,
                     help="largest regex, grammar, JSON schema or choice list (default: %(default)s)")
    lim.add_argument("--grammar-timeout", type=float, default=10.0,
                     help="seconds a constraint may take to compile (default: %(default)s)")


def run(args) -> int:
    from ..server.launch import build_guard, build_state, check_serve_args, serve_http

    check_serve_args(args)
    guard, origins = build_guard(args)
    if args.replicas is not None or args.ray_address:
        from ..integrations.ray_serve import serve_replicas

        return serve_replicas(args, guard, origins)
    serve_http(lambda: build_state(args), guard, origins, args)
    return 0
