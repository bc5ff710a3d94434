"""``speculum bench``: methods compared on the same prompts (Spec-Bench, repeated, structured, serving)."""

from __future__ import annotations

import time
from contextlib import nullcontext

from ..errors import SpeculumError
from ..methods import ENGINE_METHODS, METHODS
from .common import add_model_args, add_verify_args, load_for, sampling_params, verify_options

DEFAULT_BENCH_METHODS = "hf,hf_pld,ar,ngram,suffix,auto"  # float weights: transformers' generate as the reference
DEFAULT_STRUCTURED_METHODS = "hf,ar,ngram,auto"
# quantized weights: llama.cpp on the same GGUF as the reference, where llama-cpp-python is installed
DEFAULT_QUANT_BENCH_METHODS = "ar,ngram,suffix,auto"
DEFAULT_QUANT_STRUCTURED_METHODS = "ar,ngram,auto"

def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="benchmark methods on Spec-Bench-format prompts",
                       description="Run several methods on the same prompts, interleaved, after a warm-up; "
                                   "write results.json, results.md and speedup.png.")
    b.add_argument("--data", default=None,
                   help="Spec-Bench JSONL file (default: the small prompt set bundled with speculum)")
    b.add_argument("--per-task", type=int, default=None, help="first N prompts of each task (default: all)")
    b.add_argument("--max-new-tokens", "--max-tokens", type=int, default=None,
                   help="(default: 128; 64 for --workload serving)")
    b.add_argument("--methods", default=None,
                   help=f"comma-separated subset of {', '.join(METHODS)} (default, quantized weights: "
                        f"{DEFAULT_QUANT_BENCH_METHODS}, plus llama_cpp,llama_cpp_lookup where llama-cpp-python "
                        f"is installed; with --weights float: {DEFAULT_BENCH_METHODS}; "
                        f"{DEFAULT_QUANT_STRUCTURED_METHODS} or {DEFAULT_STRUCTURED_METHODS} for --workload "
                        "structured)")
    b.add_argument("--out", default="bench-out", help="output directory (default: %(default)s)")
    b.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    b.add_argument("--workload", choices=["specbench", "repeated", "structured", "serving"], default="specbench",
                   help="specbench: each prompt of --data once (default); repeated: a bundled set of "
                        "code-editing and agent-style requests replayed --rounds times, reported per round; "
                        "structured: JSON schemas from --schemas, each method constrained and unconstrained; "
                        "serving: concurrent clients against a live server (speculum serve started here, or --url)")
    b.add_argument("--schemas", default=None,
                   help="JSONSchemaBench-format JSONL ({id, dataset, schema} per line) for --workload structured")
    b.add_argument("--n-schemas", type=int, default=30,
                   help="schemas to generate for (of those that compile; default: %(default)s)")
    b.add_argument("--close-reserve", type=int, default=0,
                   help="structured workload: the budget closer (0: off). Each token among the last N of the "
                        "budget is kept only if the grammar can still be completed in the budget after it; else "
                        "the grammar's shortest completion ends the output (finish reason 'closed'). N >= "
                        "--max-new-tokens checks every token (default: %(default)s)")
    b.add_argument("--rounds", type=int, default=3, help="rounds of the repeated workload (default: %(default)s)")
    sv = b.add_argument_group("serving workload")
    sv.add_argument("--concurrency", default="1,4,8,16",
                    help="comma-separated numbers of concurrent clients (default: %(default)s)")
    sv.add_argument("--requests", type=int, default=32, help="requests per concurrency level (default: %(default)s)")
    sv.add_argument("--url", default=None,
                    help="drive this OpenAI-compatible server (e.g. http://127.0.0.1:8000/v1; --model is the model "
                         "name it serves) instead of starting speculum serve with --model, --dtype and the first "
                         "of --methods")
    sv.add_argument("--max-batch", type=int, default=None, help="speculum serve's --max-batch (default: its own)")
    sv.add_argument("--engines", type=int, default=None, help="speculum serve's --engines (default: its own)")
    sv.add_argument("--system-tokens", type=int, default=1000,
                    help="size of the shared system prompt of the prefix-reuse part (0: skip it; default: "
                         "%(default)s)")
    sv.add_argument("--tasks", default=None, metavar="T1,T2",
                    help="only these Spec-Bench tasks (mt_bench, translation, summarization, qa, math_reasoning, rag; "
                         "default: all)")
    sv.add_argument("--label", default=None, help="this run's name in the table (default: the server and method)")
    sv.add_argument("--include", default=None, metavar="DIR1,DIR2",
                    help="other serving runs' output folders (e.g. vLLM's, benchmarks/vllm_serving.py) to put in "
                         "the same table and plot")
    add_model_args(b)
    add_verify_args(b)


def _settings(args) -> dict:
    return {k: v for k, v in vars(args).items() if k not in ("func", "command")}


def _default_bench_methods(args) -> str:
    """The methods ``bench`` compares when none are named: with float weights transformers' generate
    is the reference; with quantized ones (which it cannot run) llama.cpp greedy and prompt lookup on
    the same GGUF file, where llama-cpp-python is installed (``make llama``)."""
    import importlib.util

    from ..loading import resolve_weights

    structured = args.workload == "structured"
    if resolve_weights(args.model, args.weights, args.device) == "float":
        return DEFAULT_STRUCTURED_METHODS if structured else DEFAULT_BENCH_METHODS
    methods = DEFAULT_QUANT_STRUCTURED_METHODS if structured else DEFAULT_QUANT_BENCH_METHODS
    if not structured and importlib.util.find_spec("llama_cpp") is not None:
        methods += ",llama_cpp,llama_cpp_lookup"
    return methods


def run(args) -> int:
    from ..bench.data import demo_prompts_path, load_prompts, repeated_prompts_path, repeated_workload
    from ..bench.harness import bench_meta, run_benchmark, write_outputs
    from ..bench.report import markdown_table

    if args.workload == "serving":
        return _bench_serving(args)
    if args.max_new_tokens is None:
        args.max_new_tokens = 128
    if args.methods is None:
        args.methods = _default_bench_methods(args)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise SpeculumError(f"unknown method(s) {', '.join(unknown) or '(none given)'}; "
                            f"choose from {', '.join(METHODS)}")
    if len(set(methods)) != len(methods):
        raise SpeculumError("--methods lists a method twice")
    if args.max_new_tokens < 1:
        raise SpeculumError("--max-new-tokens must be at least 1")
    sampling = sampling_params(args)
    if args.workload == "structured":
        from ..bench.structured import bench_structured, check_settings

        cases = check_settings(args.schemas, args.n_schemas, methods, args.temperature, args.close_reserve)
        model, tok, _, _ = load_for(args, methods)
        text, out = bench_structured(model, tok, cases, methods, args.n_schemas, args.max_new_tokens, args.chat,
                                     not args.no_progress, args.close_reserve,
                                     bench_meta(model, _settings(args)), args.out)
        print(text)
        print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'per_schema.jsonl'}")
        return 0
    if args.workload == "repeated":
        prompts = repeated_workload(load_prompts(args.data or repeated_prompts_path(), args.per_task), args.rounds)
    else:
        prompts = load_prompts(args.data or demo_prompts_path(), args.per_task)
    prompts = only_tasks(prompts, args.tasks)
    model, tok, draft, draft_tok = load_for(args, methods)
    results, records = run_benchmark(model, tok, prompts, methods, args.max_new_tokens, sampling, args.chat,
                                     draft, draft_tok, seed=args.seed or 0, progress=not args.no_progress,
                                     method_options=_method_options(args, methods))
    meta = bench_meta(model, _settings(args))
    out = write_outputs(args.out, results, records, meta)
    print(markdown_table({**meta, **results}))
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'speedup.png'}")
    return 0


def _method_options(args, methods: list[str]) -> dict[str, dict]:
    """build_method's options per method: the draft head, and --verify / --judge for engine methods."""
    verify = verify_options(args)
    options: dict[str, dict] = {}
    for m in methods:
        options[m] = {"draft_head": args.draft_head} if args.draft_head else {}
        if m in ENGINE_METHODS:
            options[m].update(verify)
    return options


def only_tasks(prompts: list, tasks: str | None) -> list:
    """The prompts of the comma-separated Spec-Bench ``tasks`` (all of them when ``tasks`` is None)."""
    if not tasks:
        return prompts
    wanted = {t.strip() for t in tasks.split(",") if t.strip()}
    kept = [p for p in prompts if p.task in wanted]
    if not kept:
        raise SpeculumError(f"no prompt of --tasks {tasks} in the data")
    return kept


def _bench_serving(args) -> int:
    """``bench --workload serving``: see :mod:`speculum.bench.serving`."""
    import torch

    from ..bench.data import demo_prompts_path, load_prompts
    from ..bench.harness import machine_info, versions
    from ..bench.serving import LocalServer, run_serving, write_serving

    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    except ValueError:
        raise SpeculumError("--concurrency takes comma-separated integers, e.g. 1,4,8,16") from None
    if not levels or min(levels) < 1 or max(levels) > 256:
        raise SpeculumError("--concurrency levels must lie in 1..256")
    if args.requests < 1:
        raise SpeculumError("--requests must be at least 1")
    max_tokens = args.max_new_tokens or 64
    if max_tokens < 1:
        raise SpeculumError("--max-new-tokens must be at least 1")
    if args.system_tokens < 0:
        raise SpeculumError("--system-tokens must be >= 0")
    method = (args.methods or "auto").split(",")[0].strip()
    if args.url is None and method not in ENGINE_METHODS:
        raise SpeculumError(f"the serving workload serves one engine method; choose from {', '.join(ENGINE_METHODS)}")
    prompts = only_tasks(load_prompts(args.data or demo_prompts_path(), args.per_task), args.tasks)
    include = [x.strip() for x in (args.include or "").split(",") if x.strip()]
    meta = {"machine": machine_info(torch.device("cpu")), "versions": versions(), "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "settings": {"concurrency": levels, "requests": args.requests, "max_tokens": max_tokens,
                         "model": args.model, "dtype": args.dtype, "method": method, "url": args.url,
                         "max_batch": args.max_batch, "engines": args.engines, "system_tokens": args.system_tokens,
                         "tasks": args.tasks}}
    options = {"max-batch": args.max_batch, "engines": args.engines}  # speculum serve's, where given
    serve = ["--model", args.model, "--dtype", args.dtype, "--method", method, "--max-queue", str(max(levels) * 2)]
    for flag, value in options.items():
        if value is not None:
            serve += [f"--{flag}", str(value)]
    label = args.label or (args.url if args.url is not None else f"speculum {method}" + "".join(
        f" ({flag} {value})" for flag, value in options.items() if value))
    with LocalServer(serve) if args.url is None else nullcontext() as server:
        run = run_serving(server.url if server else args.url, args.model, prompts, levels, args.requests,
                          max_tokens, args.system_tokens, progress=not args.no_progress)
    text, out = write_serving(args.out, label, run, meta, include)
    print(text)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}, {out / 'serving.png'}")
    return 0
