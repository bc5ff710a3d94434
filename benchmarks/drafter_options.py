"""One drafter's options side by side: variants of ``build_method`` options on the development
Spec-Bench prompts (one per category), interleaved after a warm-up, against ``ar``. Reports tokens
per second, speed against ``ar``, tokens committed per step, draft and verify milliseconds per step
drafted nodes per step and how many outputs equal ``ar``'s. ``window_off`` (a ``lookahead`` option here only) drops the Jacobi
window's rows from every step: the pool drafts from what it holds.

    .venv/bin/python benchmarks/drafter_options.py 'lookahead' 'lookahead:adaptive=false' \\
        'lookahead:window_off=true'
    .venv/bin/python benchmarks/drafter_options.py --draft-model DIR 'draft_model' \\
        'draft_model:stop_risk=0.5,num_draft=6' 'draft_model_tree'
    .venv/bin/python benchmarks/drafter_options.py --dtype auto --draft-model /tmp/smollm2-first24 --new 64 \
        draft_model specdecpp 'specdecpp:head=calibrated'

A variant is ``method[:key=value,...]`` (values parsed as JSON where they parse: ``true``, ``0.5``).
"""

import argparse
import json
import os
import time

import torch

from speculum import load
from speculum.methods import build_method
from speculum.prompts import encode_prompt


def parse_variant(spec: str) -> tuple[str, dict]:
    name, _, rest = spec.partition(":")
    options = {}
    for item in filter(None, rest.split(",")):
        key, _, value = item.partition("=")
        try:
            options[key] = json.loads(value)
        except ValueError:
            options[key] = value
    return name, options


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="method[:key=value,...]")
    ap.add_argument("--data", default="../shared/data/spec_bench/question_dev.jsonl")
    ap.add_argument("--draft-model", default=None, help="draft model for draft_model variants")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", help="activations' dtype (auto: float32 on GGUF kernels, as "
                    "speculum bench runs; default bfloat16)")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))  # two unless told
    model, tok = load("default", args.dtype)
    draft = load(args.draft_model, args.dtype)[0] if args.draft_model else None
    with open(args.data) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    seen, prompts = set(), []
    for r in rows:
        if r["category"] not in seen:
            seen.add(r["category"])
            prompts.append(encode_prompt(tok, r["turns"][0], None))
    methods = []
    for spec in ["ar", *args.variants]:
        name, options = parse_variant(spec)
        window_off = options.pop("window_off", False)
        method = build_method(name, model, tok, draft, tok if draft is not None else None, **options)
        if window_off:
            method.engine.drafter._window_rows = lambda: None
        methods.append((spec, method))
    for _, m in methods:
        m.run(prompts[0], 16)
    totals = {spec: [0, 0.0, 0, 0.0, 0.0, 0] for spec, _ in methods}
    outputs: dict[str, list] = {spec: [None] * len(prompts) for spec, _ in methods}
    for i, p in enumerate(prompts):
        order = methods[i % len(methods):] + methods[:i % len(methods)]
        for spec, m in order:
            t = time.perf_counter()
            r = m.run(p, args.new)
            t = time.perf_counter() - t
            s = totals[spec]
            s[0] += r.new_tokens
            s[1] += t
            s[2] += len(r.steps)
            s[3] += sum(x.draft_s for x in r.steps)
            s[4] += sum(x.verify_s for x in r.steps)
            s[5] += sum(x.drafted for x in r.steps)
            outputs[spec][i] = r.tokens
    base = totals["ar"][0] / totals["ar"][1]
    print(f"{len(prompts)} prompts, {args.new} new tokens each\n")
    print("| variant | tok/s | vs ar | tokens/step | draft ms/step | verify ms/step | nodes/step | same as ar |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for spec, (n, secs, steps, ds, vs, nodes) in totals.items():
        same = sum(a == b for a, b in zip(outputs[spec], outputs["ar"]))
        print(f"| `{spec}` | {n / secs:.1f} | {n / secs / base:.2f}x | {n / steps:.2f} | {1000 * ds / steps:.1f} "
              f"| {1000 * vs / steps:.1f} | {nodes / steps:.1f} | {same}/{len(prompts)} |")


if __name__ == "__main__":
    main()
